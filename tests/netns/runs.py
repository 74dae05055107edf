"""`hetpeer` processes on the lab's hosts, for the tier's swarm tests: how they are started (the `run` fixture of
conftest.py) and how their logs are read."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

Start = Callable[..., subprocess.Popen]  # run(host, name, *hetpeer_args)


def starter(folder: Path, started: list[subprocess.Popen]) -> Start:
    """run(host, name, *hetpeer_args): `hetpeer` in the host's namespace, in a process group of its own, its output in
    folder/name.log; each process is added to `started` (for `stop`)."""
    def start(host, name: str, *args: str) -> subprocess.Popen:
        log = open(folder / f"{name}.log", "wb")
        argv = host.argv([sys.executable, "-m", "hetpeer.cli", *args])
        started.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"}))
        log.close()
        return started[-1]

    return start


def stop(started: list[subprocess.Popen]) -> None:
    """Stop every process (its whole group, p2pd included): SIGTERM, SIGKILL to those still up 30 s later."""
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in started:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_for_line(path: Path, pattern: str, proc: subprocess.Popen, deadline: float) -> re.Match:
    """The first line of the log at `path` matching `pattern`; fails when the process ends or time runs out first."""
    regex = re.compile(pattern, re.MULTILINE)
    while True:
        text = path.read_text(errors="replace") if path.exists() else ""
        found = regex.search(text)
        if found:
            return found
        assert proc.poll() is None or regex.search(path.read_text(errors="replace")), (
            f"{path.name} ended (exit {proc.returncode}) without a line matching {pattern!r}:\n{text[-3000:]}")
        assert time.monotonic() < deadline, f"no line matching {pattern!r} in {path.name} in time:\n{text[-3000:]}"
        time.sleep(0.5)


def start_coordinator(run: Start, host, tmp_path: Path, swarm: str, deadline: float, *args: str) -> tuple[subprocess.Popen, Path]:
    """`hetpeer coordinator` of `swarm` on `host`, its DHT on port 31337 of every interface, announced at the
    host's address, with `args` beside; once it wrote its join file: (its process, the join file)."""
    join = tmp_path / "join.json"
    coordinator = run(
        host, "coordinator", "coordinator", "--swarm", swarm, "--home", str(tmp_path / "coordinator"),
        "--host-maddr", "/ip4/0.0.0.0/tcp/31337", "--announce-maddr", f"/ip4/{host.address}/tcp/31337",
        "--join-file", str(join), "--workers", "1", *args,  # one planner process: the peers share this machine's cores
    )
    wait_for_line(tmp_path / "coordinator.log", r"join file:", coordinator, deadline)
    return coordinator, join
