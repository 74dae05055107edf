"""`hetpeer status` as a user runs it against a coordinator's API on 127.0.0.1: the table (rich, whole
lines when piped), `--watch` redrawing it until Ctrl+C and riding out a coordinator that stops answering,
and the options that do not go together."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from test_api import make_plan, view

GUARD_S = 60.0  # a hang guard, not a timing


def status(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hetpeer", "status", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def test_the_table_names_every_peer_and_the_plan(serve):
    server = serve(lambda: view(make_plan()))
    out, err = status("--api", server.address).communicate(timeout=GUARD_S)
    assert err == ""
    lines = out.splitlines()
    assert lines[0].startswith("swarm demo  coordinator abababab")
    assert "epoch 3  step 105  loss 2.5000  tokens/s 500.0" in out and "2 records dropped" in out
    header = next(line for line in lines if line.startswith("peer "))
    assert header.split() == ["peer", "state", "stage", "step", "loss", "tok/s", "TFLOPS", "achieved", "int8", "MB/s", "device",
                              "reachable", "age", "s"]
    row = next(line for line in lines if line.startswith("c "))
    assert row.split()[:6] == ["c", "training", "s1/l0", "[4,6)", "105", "2.0000"]  # whole lines, though piped
    assert "lane 1: b -> d" in out and "standby: 1 without a stated reason (e)" in out


def test_watch_redraws_until_interrupted_and_waits_for_a_coordinator_that_went_away(serve):
    figures = {"view": view(make_plan())}
    server = serve(lambda: figures["view"])
    address = server.address
    watcher = status("--api", address, "--watch", "0.2", "--timeout", "1")
    try:
        seen = []
        deadline = time.monotonic() + GUARD_S
        while sum(line.startswith("swarm demo") for line in seen) < 3 and time.monotonic() < deadline:
            seen.append(watcher.stdout.readline())
        figures["view"] = view(None)  # the next rounds: no plan
        while not any("no plan yet" in line for line in seen) and time.monotonic() < deadline:
            seen.append(watcher.stdout.readline())
        server.shutdown(0)
        while not any("retrying" in line for line in seen) and time.monotonic() < deadline:
            seen.append(watcher.stdout.readline())
        assert any(f"cannot reach the coordinator API at {address}" in line and "retrying" in line for line in seen), seen
        watcher.send_signal(signal.SIGINT)
        assert watcher.wait(GUARD_S) == 0 and "Traceback" not in watcher.stderr.read()
    finally:
        watcher.kill()


def test_watch_and_json_do_not_go_together():
    done = status("--api", "127.0.0.1:1", "--watch", "--json")
    out, err = done.communicate(timeout=GUARD_S)
    assert done.returncode == 2 and "--watch redraws the table: leave out --json" in err
