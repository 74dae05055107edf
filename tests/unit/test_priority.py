"""Processes that yield the CPU to training: a DHT node and its daemon (`control.yield_cpu`), and the coordinator
the local swarm starts beside its peers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hetpeer.protocol.control import yield_cpu
from hetpeer.swarm.launcher import COORDINATOR_NICE, Process

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="threads' niceness is read from /proc")

# a process with a second thread and a child of its own, all asleep; it prints the child's pid when they are there
TREE = """
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


def niceness(pid: int) -> dict[int, int]:
    """Every thread of `pid`: its niceness."""
    return {int(t): os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")}


@pytest.fixture
def tree():
    parent = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 30  # a hang guard: the thread is started before the child's pid is printed
        while len(niceness(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        yield parent.pid, child
    finally:
        if child is not None:
            os.kill(child, 9)
        parent.kill()
        parent.wait()


def test_a_process_its_threads_and_its_children_are_lowered_to_the_niceness(tree):
    parent, child = tree
    assert set(niceness(parent).values()) == {0} and len(niceness(parent)) == 2
    yield_cpu(parent, 10)
    assert set(niceness(parent).values()) == {10} and len(niceness(parent)) == 2  # every thread: Linux sets it per thread
    assert set(niceness(child).values()) == {10}


def test_a_process_already_nicer_is_not_raised(tree):
    parent, child = tree
    os.setpriority(os.PRIO_PROCESS, child, 15)
    yield_cpu(parent, 10)
    assert niceness(child) == {child: 15}
    assert set(niceness(parent).values()) == {10}


def test_a_process_that_is_gone_or_none_is_left_alone():
    own = os.getpriority(os.PRIO_PROCESS, 0)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    yield_cpu(gone.pid, 19)  # no error: nothing to lower
    yield_cpu(None, 19)
    assert os.getpriority(os.PRIO_PROCESS, 0) == own  # and not this process instead


def test_the_swarms_coordinator_process_starts_at_its_niceness(tmp_path):
    lines: list[str] = []
    done = threading.Event()

    def on_line(name: str, line: str) -> None:
        lines.append(line)
        done.set()

    process = Process("coordinator", [sys.executable, "-c", "import os; print(os.nice(0))"], tmp_path / "log", on_line,
                      nice=COORDINATOR_NICE).start()
    assert done.wait(30)
    process.popen.wait(30)
    assert lines == [str(COORDINATOR_NICE)]
    assert COORDINATOR_NICE > 0
