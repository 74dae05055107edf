"""`benchmarks/gossip_scale.py --small` on the CPU: every group size runs all-reduce and decentralized Adam on the same
data for the same steps, the summary and the JSON lines agree, the other methods (second moments of a group,
AccumAdam, outer steps) run too, `benchmarks/gossip_table.py` pairs runs by seed into the quality table, and bad
options are refused by name."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def bench(*args: str, timeout: float = 120, script: str = "gossip_scale.py") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[dict, Path, str]:
    out = tmp_path_factory.mktemp("gossip-scale")
    done = bench("--small", "--json", "--out", str(out))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), out, done.stdout


def test_every_group_size_runs_both_methods_on_equal_tokens_and_steps(small):
    summary, _, _ = small
    runs = summary["runs"]
    assert sorted((r["peers"], r["method"]) for r in runs) == [(2, "allreduce"), (2, "dadam"), (4, "allreduce"), (4, "dadam")]
    assert summary["complete"] and summary["steps"] == 30
    for run in runs:
        assert run["status"] == "done" and run["steps_done"] == run["steps"] == 30
        assert run["tokens"] == 30 * run["peers"] * summary["tokens_per_peer"]
        assert [step for step, _ in run["curve"]] == [10, 20, 30]  # every 10 steps, the same points for every run
        losses = [run["initial_loss"], run["train_loss"], run["val_loss"], *(loss for _, loss in run["curve"])]
        assert all(math.isfinite(loss) for loss in losses)
    # one initial point for every run: the same seed builds the same model, validated on the same sequences
    assert len({run["initial_loss"] for run in runs}) == 1


def test_all_reduce_learns_and_only_gossip_peers_disagree(small):
    summary, _, _ = small
    for run in summary["runs"]:
        curve = [loss for _, loss in run["curve"]]
        if run["method"] == "allreduce":
            assert curve[-1] < curve[0] < run["initial_loss"]
            assert run["consensus"] == 0.0  # one model
        else:
            # peers read different data, so they drift apart, and mixing keeps them close
            assert all(0 < c < 0.1 for _, c in run["consensus_curve"])
            assert curve[-1] < run["initial_loss"]


def test_the_comparison_is_against_the_all_reduce_run_of_the_same_size(small):
    summary, _, _ = small
    runs = {(r["peers"], r["method"]): r for r in summary["runs"]}
    for peers in (2, 4):
        found = summary["comparison"][str(peers)]
        assert found["reference"] == "allreduce lr 0.003" and found["at_step"] == 30
        reference, gossip = found["runs"]["allreduce lr 0.003"], found["runs"]["dadam lr 0.003"]
        assert reference["gap"] == 0 and reference["steps_factor"] == 1
        assert gossip["val_loss"] == runs[(peers, "dadam")]["val_loss"]
        assert gossip["gap"] == pytest.approx(gossip["val_loss"] / reference["val_loss"] - 1)
        # more of all-reduce's steps where it ended above all-reduce, fewer where below
        assert (gossip["steps_factor"] > 1) == (gossip["gap"] > 0) and (gossip["steps_factor"] < 1) == (gossip["gap"] < 0)


def test_results_are_written_as_they_come(small):
    summary, out, stdout = small
    lines = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [(r["peers"], r["method"], r["val_loss"]) for r in lines] == [
        (r["peers"], r["method"], r["val_loss"]) for r in summary["runs"]]
    evals = [json.loads(line) for line in (out / "evals.jsonl").read_text().splitlines()]
    assert len(evals) == 4 * 4  # four runs, at steps 0, 10, 20 and 30
    assert json.loads((out / "summary.json").read_text()) == summary
    printed = [json.loads(line)["run"] for line in stdout.splitlines() if line.startswith('{"run"')]
    assert len(printed) == 4 and all(r["status"] == "done" for r in printed)


def test_a_time_budget_sizes_the_steps_and_every_run_reports():
    done = bench("--small", "--peers", "2", "--time-budget", "12", "--eval-every", "5", "--json")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["steps"] >= 1 and f"{summary['steps']} steps a run fit" in done.stdout
    for run in summary["runs"]:
        # on a busy machine the deadline may stop the runs early, but never before a last evaluation at equal steps
        assert run["status"] in ("done", "stopped") and run["curve"]
    assert len({run["steps_done"] for run in summary["runs"]}) == 1


@pytest.mark.parametrize("args, message", [
    (["--tokens-per-peer", "100"], "--tokens-per-peer (100) must be a positive multiple of --seq-len (64)"),
    (["--lr-for", "accumadam", "1e-3"], "--lr-for: 'accumadam' is not one of --methods (allreduce, dadam)"),
    (["--model", "huge"], "--model: unknown 'huge'"),
])
def test_bad_options_are_refused_by_name(args, message):
    done = bench("--small", *args)
    assert done.returncode == 2 and message in done.stderr


OTHERS = ["dadam-group", "dadam-window", "accumadam", "outer-10"]


@pytest.fixture(scope="module")
def others(tmp_path_factory, small) -> tuple[dict, Path]:
    """Every other method at 4 peers, on seed 1 (the `small` runs are seed 0), outer steps after 10 steps."""
    out = tmp_path_factory.mktemp("gossip-scale-others")
    done = bench("--small", "--peers", "4", "--seed", "1", "--outer-after", "10", "--methods", "allreduce", *OTHERS,
                 "--json", "--out", str(out))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), out


def test_the_other_methods_learn_and_outer_steps_leave_the_peers_together(others):
    summary, _ = others
    runs = {r["method"]: r for r in summary["runs"]}
    assert sorted(runs) == sorted(["allreduce", *OTHERS]) and summary["seed"] == 1
    for method in OTHERS:
        assert runs[method]["status"] == "done" and runs[method]["val_loss"] < runs[method]["initial_loss"]
    # evaluated at steps 10, 20, 30: right after outer steps 10 apart, every peer holds the anchor
    assert [c for _, c in runs["outer-10"]["consensus_curve"]] == [0.0, 0.0, 0.0]
    assert all(0 < c < 0.1 for method in OTHERS[:3] for _, c in runs[method]["consensus_curve"])
    # the second moments of a group are not plain decentralized Adam's (same seed and data: only the optimizer differs)
    assert len({runs[m]["val_loss"] for m in OTHERS}) == len(OTHERS)


def test_the_table_pairs_each_method_with_all_reduce_of_its_seed(small, others):
    (summary, first, _), (second_summary, second) = small, others
    done = bench(str(first), str(second), "--json", script="gossip_table.py")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = json.loads(done.stdout.strip().splitlines()[-1])
    cell = next(c for c in table["cells"] if c["peers"] == 4)
    assert (cell["model"], cell["tokens_per_peer"], cell["steps"]) == ("tiny", 256, 30)
    rows = {row["method"]: row for row in cell["rows"]}
    assert sorted(rows) == sorted(["allreduce", "dadam", *OTHERS])
    assert rows["allreduce"]["seeds"] == 2 and rows["allreduce"]["gap"] == 0  # seeds 0 and 1, each against itself
    by_seed = {(r["seed"], r["method"]): r["val_loss"] for s in (summary, second_summary) for r in s["runs"] if r["peers"] == 4}
    assert rows["dadam"]["seeds"] == 1  # seed 0 only, against seed 0's all-reduce
    assert rows["dadam"]["gap"] == pytest.approx(by_seed[(0, "dadam")] / by_seed[(0, "allreduce")] - 1)
    assert rows["outer-10"]["gap"] == pytest.approx(by_seed[(1, "outer-10")] / by_seed[(1, "allreduce")] - 1)
    assert set(table["parity"]["dadam"]) == {"2", "4"} and "parity (gap within 1%)" in done.stdout


def test_the_table_refuses_a_folder_without_runs(tmp_path):
    done = bench(str(tmp_path), script="gossip_table.py")
    assert done.returncode == 1 and f"{tmp_path}: no runs.jsonl" in done.stderr
