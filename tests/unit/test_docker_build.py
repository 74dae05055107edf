"""docker/build.sh and the build arguments it passes: its options, the Debian mirror it reads from apt
sources, and the files that make an offline build (no Docker engine needed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
BUILD = DOCKER / "build.sh"


def build_sh(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BUILD), *args], capture_output=True, text=True, timeout=30, env={**os.environ, **(env or {})}
    )


def dockerfile_text() -> str:
    return (DOCKER / "Dockerfile").read_text()


def test_build_sh_is_strict_executable_bash():
    assert os.access(BUILD, os.X_OK)
    lines = BUILD.read_text().splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    assert "set -euo pipefail" in lines


def test_help_names_every_option():
    done = build_sh("--help")
    assert done.returncode == 0
    for option in ("--image", "--base", "--online", "--rebuild-base", "--mirror", "--print-mirror"):
        assert option in done.stdout


@pytest.mark.parametrize("args", [["--bogus"], ["--image"], ["--base", "python:3.11-slim", "--rebuild-base"]])
def test_a_bad_command_line_is_one_line_and_exit_2(args):
    done = build_sh(*args)
    assert done.returncode == 2
    assert done.stderr.startswith("build.sh: error: ") and done.stderr.count("\n") == 1


def test_an_unreachable_docker_is_one_line_and_fails():
    done = build_sh(env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    assert done.returncode != 0
    assert done.stderr.startswith("build.sh: error: docker ") and done.stderr.count("\n") == 1


# apt sources as machines have them; the hosts are example names (RFC 2606)
DEB822 = {
    "sources.list.d/a-thirdparty.sources": """\
Types: deb
URIs: https://vendor.example.com/linux/debian
Suites: bookworm
Components: stable
""",
    "sources.list.d/debian.sources": """\
Types: deb
# a comment inside the stanza
URIs: http://mirror.example.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.example.org/debian-security
Suites: bookworm-security
Components: main
""",
    "sources.list.d/other.list.disabled": "deb http://wrong.example.org/debian bookworm main\n",
}
ONE_LINE = {
    "sources.list": """\
# deb http://commented.example.org/debian bookworm main
deb-src http://source.example.org/debian bookworm main
deb http://security.example.org/debian-security bookworm-security main
deb [ arch=amd64 signed-by=/usr/share/keyrings/k.gpg ] http://mirror.example.org/debian/ bookworm main contrib
""",
    "sources.list.d/z.sources": "Types: deb\nURIs: http://later.example.org/debian\nSuites: bookworm\nComponents: main\n",
}
SKIPPED_STANZAS = {
    "sources.list.d/debian.sources": """\
Types: deb-src
URIs: http://source.example.org/debian
Suites: bookworm
Components: main

Types: deb
Enabled: no
URIs: http://disabled.example.org/debian
Suites: bookworm
Components: main

types: deb
uris: http://mirror.example.org/debian
 http://second.example.org/debian
suites: bookworm
components: main
""",
}
NONE = {"sources.list": "deb http://mirror.example.org/ubuntu noble main\n", "sources.list.d/README": "no sources\n"}


def apt_dir(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize("files", [DEB822, ONE_LINE, SKIPPED_STANZAS], ids=["deb822", "one-line", "skipped-stanzas"])
def test_the_mirror_is_the_debian_bookworm_main_source(tmp_path, files):
    done = build_sh("--print-mirror", env={"HETPEER_APT_DIR": str(apt_dir(tmp_path, files))})
    assert (done.returncode, done.stdout, done.stderr) == (0, "http://mirror.example.org/debian\n", "")


def test_no_bookworm_source_is_one_line_naming_the_way_out(tmp_path):
    done = build_sh("--print-mirror", env={"HETPEER_APT_DIR": str(apt_dir(tmp_path, NONE))})
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "--mirror URL" in done.stderr


def test_the_repository_names_no_mirror_or_registry_host():
    # The mirror is read from the machine building; only the PyTorch index is named, for the online path.
    for path in (BUILD, DOCKER / "Dockerfile", DOCKER / "Dockerfile.dockerignore"):
        hosts = set(re.findall(r"[a-z]+://([^/\s\"']+)", path.read_text()))
        assert hosts <= {"download.pytorch.org"}, path


def test_the_dockerfile_takes_a_base_and_a_wheel_folder():
    text = dockerfile_text()
    first_from = text.index("\nFROM ")
    assert re.search(r"^ARG BASE=python:3\.11-slim$", text[:first_from], re.M)
    assert re.findall(r"^FROM (\S+)", text, re.M) == ["${BASE}"] * 2
    wheels = re.search(r"^ARG WHEELS=(\S+)$", text, re.M)
    assert wheels and wheels.group(1) == "docker/wheels"
    # the `*` keeps a missing folder (a fresh clone, --online) from failing the COPY
    assert re.search(r"^COPY pyproject\.toml \$\{WHEELS\}\* /wheels/$", text, re.M)


def admitted() -> list[str]:
    lines = (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
    return [line[1:] for line in lines if line.startswith("!")]


def test_the_dockerignore_admits_the_sources_and_the_wheel_folder_only():
    lines = (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
    assert "*" in lines
    assert sorted(admitted()) == ["README.md", "docker/wheels/", "hetpeer/", "pyproject.toml"]
    default = re.search(r"^ARG WHEELS=(\S+)$", dockerfile_text(), re.M).group(1)
    assert f"{default}/" in admitted()
    assert re.search(rf"^WHEELS={re.escape(default)}\b", BUILD.read_text(), re.M)  # what build.sh fills


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git checkout")
@pytest.mark.parametrize("path", ["docker/wheels/torch-2.13.0-cp311.whl", "docker/wheels/.stamp", "docker/.wheels.x1Yz/a.whl"])
def test_the_wheels_stay_out_of_git(path):
    done = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "--no-index", path], timeout=30)
    assert done.returncode == 0, f"{path} is not ignored"


def test_build_sh_gathers_the_torch_the_dockerfile_installs():
    pinned = set(re.findall(r"torch==[\d.]+", dockerfile_text()))
    assert len(pinned) == 1
    assert re.search(rf"^TORCH={re.escape(pinned.pop())}\s", BUILD.read_text(), re.M)
