"""The swarm's commands on bad input, as a user runs them (`python -m hetpeer ...`): exit code 2 (1 for
an unreachable API) and one line on stderr that says what is wrong, never a traceback. Nothing here
joins a DHT: every case is refused before a process would start one.

The commands import torch and hivemind, so the cases run as concurrent subprocesses, started once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetpeer.cli import main

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 180  # generous: each case is refused in seconds; this only stops a peer that did start
KEY = "0123456789abcdef" * 4

# case -> (arguments, expected exit code, fragments the one stderr line must hold)
CASES = {
    "join without a coordinator key": (["join", "--swarm", "demo"], 2, ["--coordinator-key"]),
    "join with a malformed key": (["join", "--swarm", "demo", "--coordinator-key", "abc123"], 2, ["coordinator key", "'abc123'"]),
    "join with a key one digit short": (["join", "--swarm", "demo", "--coordinator-key", KEY[:-1]], 2, ["64"]),
    "join a swarm with --plan": (["join", "--swarm", "demo", "--coordinator-key", KEY, "--plan", "plan.json"], 2, ["--plan"]),
    "join slowed down below 1": (["join", "--swarm", "demo", "--coordinator-key", KEY, "--slowdown", "0.5"], 2, ["--slowdown", "0.5"]),
    "join with a negative slowdown": (["join", "--swarm", "demo", "--coordinator-key", KEY, "--slowdown", "-2"], 2, ["--slowdown"]),
    "join with a bad name": (["join", "--swarm", "demo", "--coordinator-key", KEY, "--name", "Bad-Name"], 2, ["--name", "'Bad-Name'"]),
    "join a badly named swarm": (["join", "--swarm", "no spaces!", "--coordinator-key", KEY], 2, ["swarm", "'no spaces!'"]),
    "join with neither --swarm nor --plan": (["join"], 2, ["--swarm", "--plan"]),
    "coordinator with a micro-batch over the batch": (
        ["coordinator", "--swarm", "demo", "--batch", "4", "--micro-batch", "8"], 2, ["micro-batch 8", "batch 4"]
    ),
    "coordinator with --data-url but no --data": (
        ["coordinator", "--swarm", "demo", "--data-url", "http://127.0.0.1:1/d/"], 2, ["--data-url", "--data DIR"]
    ),
    "coordinator with --data that is not prepared": (
        ["coordinator", "--swarm", "demo", "--data", str(ROOT / "docs")], 2, ["not a prepared corpus", "hetpeer data prepare"]
    ),
    "coordinator with a gain of 1.5": (["coordinator", "--swarm", "demo", "--gain", "1.5"], 2, ["gain", "1.5"]),
    "coordinator with a negative gain": (["coordinator", "--swarm", "demo", "--gain", "-0.1"], 2, ["gain", "-0.1"]),
    "coordinator of a badly named swarm": (["coordinator", "--swarm", "no spaces!"], 2, ["swarm", "'no spaces!'"]),
    "coordinator with a last step of 0": (["coordinator", "--swarm", "demo", "--steps", "0"], 2, ["--steps", "'0'"]),
    "join with a join file that is no JSON": (["join", "--join-file", "join.json"], 2, ["join file", "not JSON"]),
    "join with a join file of another swarm": (
        ["join", "--join-file", "other.json", "--swarm", "demo"], 2, ["--swarm demo", "disagrees", "other"]
    ),
    "join with a join file that names no peer id": (["join", "--join-file", "no-id.json"], 2, ["join.initial_peers[0]"]),
    "join a swarm of a model folder without it": (
        ["join", "--join-file", "folder-model.json"], 2, ["gpt2-0123456789ab", "give --model"]
    ),
    "join with another model folder": (
        ["join", "--join-file", "folder-model.json", "--model", "gpt2"], 2, ["--model gpt2-", "disagrees", "gpt2-0123456789ab"]
    ),
    "coordinator of a folder without a config": (["coordinator", "--swarm", "demo", "--model", "."], 2, ["has no config.json"]),
    "status of an API nobody serves": (["status", "--api", "127.0.0.1:1", "--timeout", "1"], 1, ["127.0.0.1:1"]),
    "swarm with a slowdown that is no number": (["swarm", "--slowdowns", "1,x"], 2, ["--slowdowns", "'1,x'"]),
    "swarm with a zero bandwidth cap": (["swarm", "--bandwidth-caps", "0"], 2, ["bandwidth caps", "positive"]),
"swarm with a negative latency": (["swarm", "--latencies", "5,-2"], 2, ["latencies", "-2"]),
    "swarm with a slowdown below 1": (["swarm", "--peers", "2", "--slowdowns", "1,0.5"], 2, ["slowdowns", "0.5"]),
}


def join_file(swarm: str, peers: list[str], model: str = "tiny") -> str:
    return json.dumps({"version": 1, "swarm": swarm, "coordinator_key": KEY, "initial_peers": peers, "model": model, "dtype": "fp32"})


# files a case's folder holds before it runs
FILES = {
    "join.json": "{nope",
    "other.json": join_file("other", ["/ip4/127.0.0.1/tcp/1/p2p/12D3KooWPeer"]),
    "no-id.json": join_file("demo", ["/ip4/127.0.0.1/tcp/1"]),
    "folder-model.json": join_file("demo", ["/ip4/127.0.0.1/tcp/1/p2p/12D3KooWPeer"], model="gpt2-0123456789ab"),
    "gpt2/config.json": json.dumps({"model_type": "gpt2", "n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": 32,
                                    "vocab_size": 256}),
}


def isolated(args: list[str], home: Path) -> list[str]:
    """Keys and reports go under the test's folder, never the user's home."""
    command = args[0]
    if command == "coordinator" or (command == "join" and ("--swarm" in args or "--join-file" in args)):
        return args + ["--home", str(home / "home")]
    if command == "swarm":
        return args + ["--out", str(home / "out")]
    return args


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    started = {}
    for i, (case, (args, _, _)) in enumerate(CASES.items()):
        folder = tmp_path_factory.mktemp(f"case{i}")
        for name, text in FILES.items():
            (folder / name).parent.mkdir(exist_ok=True)
            (folder / name).write_text(text)
        command = [sys.executable, "-m", "hetpeer", *isolated(args, folder)]
        process = subprocess.Popen(
            command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        started[case] = (command, process, folder)
    deadline = time.monotonic() + HANG_GUARD_S
    done = {}
    for case, (command, process, folder) in started.items():
        try:
            out, err = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            err += f"\n(hung for {HANG_GUARD_S} s: killed)"
        done[case] = (subprocess.CompletedProcess(command, process.returncode, out, err), folder)
    for _, process, _ in started.values():  # whatever a case left behind in its session
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return done


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_clear_line(runs, case):
    _, code, fragments = CASES[case]
    done, _ = runs[case]
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert done.returncode == code, done.stderr
    command = done.args[3]
    assert lines[0].startswith(f"hetpeer {command}:"), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_refused_commands_leave_nothing_behind(runs):
    for case, (done, folder) in runs.items():
        assert not (folder / "home").exists(), case  # no key was made: nothing started
        assert not (folder / "out").exists(), case


@pytest.mark.parametrize(
    "command, options",
    [
        ("join", ["--swarm", "--join-file", "--coordinator-key", "--initial-peers", "--name", "--home", "--slowdown", "--plan"]),
        ("coordinator", ["--swarm", "--min-peers", "--replan-interval", "--gain", "--api", "--batch", "--micro-batch", "--steps",
                         "--join-file"]),
        ("status", ["--api", "--json", "--timeout"]),
        ("swarm", ["--peers", "--steps", "--slowdowns", "--bandwidth-caps", "--latencies", "--out"]),
    ],
)
def test_help_names_the_key_options(capsys, command, options):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: hetpeer {command}")
    for option in options:
        assert option in text, option
