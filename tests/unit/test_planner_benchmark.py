"""`benchmarks/planner.py --part scale` at a tiny size: every case runs its two long solves and its rounds and lands in
the table with the long solves' spread; bad options are refused by name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "planner.py"), "--part", "scale", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_scale_part_runs_each_generator_and_seed_and_tables_them():
    done = bench("--sizes", "16", "--scale-budgets", "0.2", "--factor", "3", "--scale-seeds", "2", "--rounds", "3",
                 "--generators", "mixed,home", "--jobs", "2")
    assert done.returncode in (0, 1), done.stderr[-2000:]  # 1: a goal missed, which at this size says nothing
    out = done.stdout
    for generator in ("mixed", "home"):
        for seed in (0, 1):
            assert f"{generator} seed {seed}, 16 devices: 0.6 s solve:" in out
            assert f"{generator} seed {seed}, 16 devices: 0.6 s solve (seeded apart):" in out  # the second reference
            assert f"{generator} seed {seed}, 16 devices: round 3 of 0.2 s:" in out
    rows = [row for row in map(str.split, out.splitlines()) if row[:1] in (["mixed"], ["home"]) and row[1].isdigit()]
    assert [(row[0], row[1], row[2]) for row in rows] == [("mixed", "0", "16"), ("mixed", "1", "16"),
                                                          ("home", "0", "16"), ("home", "1", "16")]
    for row in rows:  # the rounds never end worse than their first round: each goes on from the last
        first, after_rounds = float(row[4]), float(row[-2])
        assert after_rounds <= first * (1 + 1e-9)
        assert row[-4].endswith("%") and float(row[-4].rstrip("%")) >= 0  # the two long solves' spread
    assert out.rstrip().endswith(("summary: scale met", "summary: scale NOT met"))


def test_unknown_generators_and_bad_counts_are_refused_by_name():
    done = bench("--generators", "geo,moon")
    assert done.returncode == 2 and "--generators: unknown moon (known: geo, mixed, regions, sites, home)" in done.stderr
    done = bench("--rounds", "0")
    assert done.returncode == 2 and "--rounds" in done.stderr


def test_the_workers_part_solves_each_case_on_one_and_on_two_workers():
    done = bench("--part", "workers", "--sizes", "16", "--scale-budgets", "0.3", "--scale-seeds", "2")
    assert done.returncode in (0, 1), done.stderr[-2000:]  # 1: a goal missed, which at this size says nothing
    out = done.stdout
    for seed in (0, 1):
        for workers in (1, 2):
            assert f"mixed seed {seed}, 16 devices, {workers} worker(s):" in out
    rows = [row for row in map(str.split, out.splitlines()) if row[:1] == ["mixed"] and row[1].isdigit()]
    assert [(row[1], row[2]) for row in rows] == [("0", "16"), ("1", "16")]
    for row in rows:
        one, two, ratio = float(row[4]), float(row[10]), float(row[-2])  # shapes are 5 words: "3 stages x 4 lanes"
        assert ratio == pytest.approx(two / one, abs=1e-4)
    assert out.rstrip().endswith(("summary: workers met", "summary: workers NOT met"))
    done = bench("--part", "workers", "--workers", "1")
    assert done.returncode == 2 and "--workers at least 2" in done.stderr
