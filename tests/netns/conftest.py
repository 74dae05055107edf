"""Fixtures of the multi-host tier: a lab of network namespaces (`lab.py`), with public hosts and NAT routers, and
`hetpeer` processes run on its hosts (`run`). It needs root; HETPEER_REQUIRE_NETNS=1 (CI) turns a machine that cannot run it into a failure, not a skip."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from lab import Lab, netns_missing
from runs import Start, starter, stop

REQUIRED = os.environ.get("HETPEER_REQUIRE_NETNS") == "1"


@pytest.fixture(scope="session")
def netns_ready() -> None:
    reason = netns_missing()
    if reason is not None:
        if REQUIRED:
            pytest.fail(f"HETPEER_REQUIRE_NETNS=1, but the lab cannot run: {reason}", pytrace=False)
        pytest.skip(reason)


@pytest.fixture
def lab(netns_ready) -> Iterator[Lab]:
    with Lab() as made:
        yield made


@pytest.fixture
def run(lab: Lab, tmp_path: Path) -> Iterator[Start]:
    """run(host, name, *hetpeer_args): `hetpeer` in the host's namespace, its output in tmp_path/name.log;
    stopped (its whole process group, p2pd included) before the lab closes."""
    started: list[subprocess.Popen] = []
    yield starter(tmp_path, started)
    stop(started)
