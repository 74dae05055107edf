"""The compose tier: swarms of containers on Docker networks, driven the way users drive them (docker/build.sh,
`docker-compose -f docker/compose.yaml up -d`, `hetpeer testbed`).

Without a Docker engine these tests are skipped, saying why; `.ci/run` sets HETPEER_REQUIRE_DOCKER=1, which
makes a missing engine a failure instead. Every project gets a name unique to the run and is removed at the
end, also after a failure."""

from __future__ import annotations

import os
import subprocess

import pytest

from compose_helpers import IMAGE, ROOT
from hetpeer.testbed.compose import ComposeError, check_docker


@pytest.fixture(scope="session")
def image() -> str:
    """The hetpeer image of this checkout, built (or brought up to date) by docker/build.sh."""
    try:
        check_docker()
    except ComposeError as error:
        if os.environ.get("HETPEER_REQUIRE_DOCKER") == "1":
            pytest.fail(f"HETPEER_REQUIRE_DOCKER=1 but {error}")
        pytest.skip(f"no Docker here: {error}")
    done = subprocess.run([str(ROOT / "docker" / "build.sh"), "--image", IMAGE], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, f"docker/build.sh failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return IMAGE
