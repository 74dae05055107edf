"""`benchmarks/punching.py` and `benchmarks/home_swarm.py`: a small punching run through both router kinds gives
its rows and its JSON line (and reaches the goal), the interval is Wilson's, and bad options are refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from punching import wilson  # noqa: E402


def bench(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_the_interval_is_wilsons_and_holds_the_share():
    low, high = wilson(200, 200)
    assert (round(low, 4), high) == (0.9812, 1.0)  # 1 - 1.96^2 / (200 + 1.96^2)
    low, high = wilson(3, 200)
    assert low < 3 / 200 < high and 0.005 < low and high < 0.05
    assert wilson(0, 0) == (0.0, 1.0)


@pytest.mark.usefixtures("netns_ready")
def test_a_small_run_punches_through_both_router_kinds_with_the_opening_syn():
    done = bench("punching.py", "--attempts", "10", "--rules", "opening", "--skew", "0.5", "--json")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rows = {row["router"]: row for row in result["rows"]}
    assert set(rows) == {"drop", "reset"} and all(row["attempts"] == 10 for row in rows.values())
    assert all(row["succeeded"] >= 8 for row in rows.values()), rows  # 200 of 200 each where measured
    assert "reset   opening" in done.stdout


@pytest.mark.parametrize("script,args,said", [
    ("punching.py", ["--routers", "drop,nat"], "unknown router 'nat'"),
    ("punching.py", ["--rules", "fast"], "unknown rule 'fast'"),
    ("punching.py", ["--attempts", "0"], "--attempts and --at-once are at least 1"),
    ("home_swarm.py", ["--variants", "public,cgnat"], "unknown variant(s) cgnat"),
    ("home_swarm.py", ["--steps", "10", "--settle", "9"], "--settle must leave at least two steps"),
])
def test_bad_options_are_refused_by_name(script, args, said):
    done = bench(script, *args, timeout=60)
    assert done.returncode == 2 and said in done.stderr, done.stderr
