"""What the compose tests share: names unique to the run, waiting for a swarm to get somewhere, and running
`hetpeer testbed`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, TypeVar

import pytest

from hetpeer.coordinator.api_errors import ApiError
from hetpeer.peer.reach import free_port
from hetpeer.swarm.report import RunReport
from hetpeer.testbed.compose import Compose, run

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("HETPEER_TEST_IMAGE", "hetpeer:latest")
T = TypeVar("T")


def unique(prefix: str) -> str:
    """A compose project name no other run uses."""
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def wait_for(read: Callable[[], T], what: str, timeout_s: float = 180.0, every_s: float = 1.0,
             explain: Callable[[], str] | None = None) -> T:
    """`read()` until it gives something true (an unreachable API counts as not yet), else fail naming `what`
    and adding what `explain()` tells (the end of a log, say)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = read()
        except ApiError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}" + (f"\n{explain()}" if explain else ""))
        time.sleep(every_s)


class TestbedRun:
    """`hetpeer testbed` on a topology as users run it, in a process of its own with a project name unique to the
    run: `stop()` sends SIGTERM (as Ctrl+C) and returns the command's output, once it ended well; leaving the
    `with` kills it if it still runs and removes what it did not; `left()` lists its containers still running."""

    __test__ = False  # not a pytest test class

    def __init__(self, topology: dict, folder: Path, image: str, *options: str, prefix: str = "hetpeer-testbed") -> None:
        path = folder / f"{topology['name']}.json"
        path.write_text(json.dumps(topology))
        self.port, self.project, self.out = free_port(), unique(prefix), folder / "bed"
        self.command = [sys.executable, "-m", "hetpeer", "testbed", str(path), *options, "--out", str(self.out),
                        "--project", self.project, "--api-port", str(self.port), "--http-port", str(free_port()),
                        "--image", image]
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "TestbedRun":
        self.process = subprocess.Popen(self.command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return self

    @property
    def api(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> str:
        self.process.send_signal(signal.SIGTERM)  # the command keeps logs and a report, then removes everything
        output, _ = self.process.communicate(timeout=300)
        assert self.process.returncode == 0, output[-3000:]
        return output

    def report(self) -> RunReport:
        return RunReport.from_json((self.out / "report.json").read_text())

    def log(self, service: str) -> str:
        return (self.out / "logs" / f"{service}.log").read_text()

    def left(self) -> list[str]:
        return run(["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={self.project}"]).stdout.split()

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()
        if (self.out / "compose.yaml").exists():
            Compose(self.out / "compose.yaml", self.project).down()  # what the command did not get to remove
