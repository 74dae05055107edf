"""`hetpeer plan` as a user runs it: a real subprocess of the CLI, its stdout, stderr and exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetpeer import scenarios
from hetpeer.protocol.plan import Plan

ROOT = Path(__file__).resolve().parents[2]


def hetpeer(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "hetpeer.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def scenario_ids(name: str) -> list[str]:
    return [d["id"] for d in scenarios.load(name)["devices"]]


def topology_file(tmp_path: Path, devices: list[dict], name: str = "topology.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"devices": devices, "regions": {"r": {"latency_ms": 1.0, "bandwidth_gbps": 10.0}}}))
    return path


def device(i: int, **fields) -> dict:
    return {"id": f"d{i}", "region": "r", "tflops": 100.0, "memory_gb": 16.0} | fields


def test_json_plan_for_world_wide():
    done = hetpeer("plan", "--scenario", "world-wide", "--json", "--time-budget", "1")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "planning world-wide" in done.stderr  # progress goes to stderr; stdout is only the plan
    plan = Plan.from_wire(json.loads(done.stdout))
    assert plan.cost_model == "time"
    assert plan.model == "gpt3-xl" and plan.layers == 24 and plan.batch == 512
    placed = list(plan.devices) + list(plan.standby)
    assert len(placed) == 64
    assert sorted(placed) == sorted(scenario_ids("world-wide"))
    assert plan.total_s > 0


def test_workers_search_together_and_a_bad_count_is_refused():
    done = hetpeer("plan", "--scenario", "regional", "--json", "--time-budget", "1", "--workers", "2")
    assert done.returncode == 0, done.stderr
    assert "on 2 workers" in done.stderr and "epoch 1 of 1: best" in done.stderr
    assert Plan.from_wire(json.loads(done.stdout)).total_s > 0
    refused = hetpeer("plan", "--scenario", "regional", "--workers", "0")
    assert refused.returncode == 2 and "--workers" in refused.stderr and "Traceback" not in refused.stderr


def test_readable_plan_names_the_baselines(tmp_path):
    raw = scenarios.load("regional")
    path = tmp_path / "regional.json"
    path.write_text(json.dumps(raw))
    done = hetpeer("plan", str(path), "--time-budget", "0.5", "--random-samples", "10", "--quiet")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # --quiet
    out = done.stdout
    assert "blocks" in out and "random" in out
    assert "this plan" in out
    assert "lane 0:" in out
    # Every device of the file is named somewhere in the plan.
    assert all(device["id"] in out for device in raw["devices"])


def test_devices_that_cannot_matter_are_left_out_saying_why(tmp_path):
    fleet = [device(i) for i in range(6)] + [device(6, tflops=0.01), device(7, memory_gb=0.5)]  # a Pi, a 512 MB GPU
    path = topology_file(tmp_path, fleet)
    done = hetpeer("plan", str(path), "--model", "gpt3-xl", "--batch", "32", "--time-budget", "0.5", "--quiet")
    assert done.returncode == 0, done.stderr
    assert "1 too small: less usable memory than one layer's training state and activations (1.07 GB) (d7)" in done.stdout
    assert "1 too slow: one layer of its share of the batch takes longer than a whole step without it" in done.stdout
    assert "(d6)" in done.stdout
    plan = Plan.from_wire(json.loads(hetpeer("plan", str(path), "--model", "gpt3-xl", "--batch", "32", "--time-budget",
                                             "0.5", "--quiet", "--json").stdout))
    assert plan.reasons and {"d6", "d7"} <= set(plan.standby)
    unpruned = hetpeer("plan", str(path), "--model", "gpt3-xl", "--batch", "32", "--time-budget", "0.5", "--quiet",
                       "--no-prune", "--json")
    assert unpruned.returncode == 0 and Plan.from_wire(json.loads(unpruned.stdout)).standby_reasons == ()


def test_efficiency_terms_slow_the_prediction_and_bad_ones_are_refused(tmp_path):
    path = topology_file(tmp_path, [device(i, memory_gb=80.0) for i in range(4)])
    fixed = ("plan", str(path), "--stages", "2", "--group-size", "2", "--time-budget", "0.3", "--quiet", "--json")
    nominal = Plan.from_wire(json.loads(hetpeer(*fixed).stdout))
    slower = Plan.from_wire(json.loads(hetpeer(*fixed, "--efficiency", "compute=0.5,link=0.9").stdout))
    assert slower.cost["compute_s"] == pytest.approx(2 * nominal.cost["compute_s"], rel=1e-6)
    done = hetpeer(*fixed, "--efficiency", "compute=fast")
    assert done.returncode == 2 and "compute must be a number" in done.stderr


def test_dtfm_reaches_the_papers_best_on_datacenter_on_demand():
    done = hetpeer(
        "plan", "--scenario", "datacenter-on-demand", "--cost-model", "dtfm", "--stages", "8", "--group-size", "8",
        "--dp-bytes", "0.65e9", "--pp-bytes", "0.471248e9", "--json", "--quiet", "--time-budget", "2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    plan = Plan.from_wire(json.loads(done.stdout))
    assert plan.cost_model == "dtfm"
    assert len(plan.stages) == 8 and plan.group_size == 8 and plan.standby == ()
    assert plan.cost["total_s"] <= 3.441


def test_current_plan_is_read(tmp_path):
    topology = topology_file(tmp_path, [device(i) for i in range(6)])
    common = ["plan", str(topology), "--model", "tiny", "--batch", "16", "--json", "--quiet", "--time-budget", "0.3"]
    first = hetpeer(*common)
    assert first.returncode == 0, first.stderr
    current = tmp_path / "current.json"
    current.write_text(first.stdout)
    second = hetpeer(*common, "--current", str(current))
    assert second.returncode == 0, second.stderr
    plan = Plan.from_wire(json.loads(second.stdout))
    assert "move_s" in plan.cost
    assert sorted(plan.devices + plan.standby) == [f"d{i}" for i in range(6)]


@pytest.mark.parametrize("cost_model", ["dtfm", "time"])
def test_a_single_device_plan_prints(cost_model, tmp_path):
    topology = topology_file(tmp_path, [device(0)])
    done = hetpeer("plan", str(topology), "--model", "tiny", "--batch", "8", "--cost-model", cost_model,
                   "--quiet", "--time-budget", "0.3", "--random-samples", "5")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "lane 0: d0" in done.stdout and "this plan" in done.stdout


def test_a_model_folder_is_planned_with_its_own_counts(tmp_path):
    """A Llama config.json (no weights needed to plan): the plan names the model by its architecture's digest,
    and a model that does not fit one device is cut into stages."""
    folder = tmp_path / "llama"
    folder.mkdir()
    config = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
              "num_key_value_heads": 8, "num_hidden_layers": 16, "max_position_embeddings": 2048, "vocab_size": 128256,
              "tie_word_embeddings": True}
    (folder / "config.json").write_text(json.dumps(config))
    topology = topology_file(tmp_path, [device(i, memory_gb=16.0) for i in range(8)])
    done = hetpeer("plan", str(topology), "--model", str(folder), "--seq-len", "1024", "--batch", "32", "--json", "--quiet",
                   "--time-budget", "0.5")
    assert done.returncode == 0, done.stderr
    plan = Plan.from_wire(json.loads(done.stdout))
    assert plan.model.startswith("llama-") and plan.layers == 16
    assert len(plan.stages) > 1  # 1.2B parameters x 16 bytes of training state do not fit 16 GB
    again = hetpeer("plan", str(topology), "--model", str(folder), "--seq-len", "1024", "--batch", "32", "--json", "--quiet",
                    "--time-budget", "0.5")
    assert json.loads(again.stdout)["model"] == plan.model


def test_a_plan_can_ask_for_validation(tmp_path):
    topology = topology_file(tmp_path, [device(i) for i in range(2)])
    done = hetpeer("plan", str(topology), "--model", "tiny", "--batch", "8", "--eval-every", "10", "--eval-batch", "3",
                   "--json", "--quiet", "--time-budget", "0.3")
    assert done.returncode == 0, done.stderr
    plan = Plan.from_wire(json.loads(done.stdout))
    assert (plan.eval_every, plan.eval_batch) == (10, 3)
    plain = hetpeer("plan", str(topology), "--model", "tiny", "--batch", "8", "--json", "--quiet", "--time-budget", "0.3")
    assert json.loads(plain.stdout)["recipe"]["eval_every"] == 0  # none unless asked


def test_a_plan_carries_the_recipe_it_was_given_and_a_bad_one_is_one_line(tmp_path):
    topology = topology_file(tmp_path, [device(i) for i in range(2)])
    (tmp_path / "recipe.json").write_text('{"lr": 1e-3, "warmup_steps": 20}')
    done = hetpeer("plan", str(topology), "--model", "tiny", "--batch", "8", "--recipe", str(tmp_path / "recipe.json"),
                   "--set", "seed=4", "--json", "--quiet", "--time-budget", "0.3")
    assert done.returncode == 0, done.stderr
    recipe = Plan.from_wire(json.loads(done.stdout)).recipe
    assert (recipe.lr, recipe.warmup_steps, recipe.seed) == (1e-3, 20, 4)
    (tmp_path / "recipe.json").write_text('{"lr": 1e-3, "lookahead": 2}')
    bad = hetpeer("plan", str(topology), "--model", "tiny", "--recipe", str(tmp_path / "recipe.json"), "--quiet")
    assert bad.returncode == 2 and "lookahead: is not a known field" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_stages_recompute_only_where_they_fit_no_other_way(tmp_path):
    # four 24 GB GPUs and GPT-3 XL in micro-batches of 4: the first stage holds its layers' activations only by
    # recomputing some of them
    path = topology_file(tmp_path, [device(i, memory_gb=24.0, tflops=80.0) for i in range(4)])
    args = [str(path), "--batch", "32", "--micro-batch", "4", "--time-budget", "1", "--quiet"]
    done = hetpeer("plan", *args, "--json")
    assert done.returncode == 0, done.stderr
    plan = Plan.from_wire(json.loads(done.stdout))
    assert any(stage.recompute for stage in plan.stages)
    assert all(0 <= stage.recompute <= stage.layers for stage in plan.stages)
    text = hetpeer("plan", *args)
    assert "recomputed in the backward pass" in text.stdout
    never = hetpeer("plan", *args, "--recompute", "never", "--json")
    assert never.returncode == 0, never.stderr
    assert not any(stage.recompute for stage in Plan.from_wire(json.loads(never.stdout)).stages)
    roomy = topology_file(tmp_path, [device(i, memory_gb=80.0, tflops=80.0) for i in range(4)], "roomy.json")
    done = hetpeer("plan", str(roomy), *args[1:], "--json")
    assert not any(stage.recompute for stage in Plan.from_wire(json.loads(done.stdout)).stages)


def test_help_lists_the_options():
    done = hetpeer("plan", "--help")
    assert done.returncode == 0
    assert "--scenario" in done.stdout and "--cost-model" in done.stdout


# -- bad input: exit 2, one line on stderr, no traceback -----------------------------------------


def bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], list[str]]]:
    """case -> (arguments, words the error line must contain)."""
    unparseable = tmp_path / "broken.json"
    unparseable.write_text('{"devices": [')
    no_region = device(1)
    del no_region["region"]
    missing_field = topology_file(tmp_path, [device(0), no_region], "a.json")
    negative_tflops = topology_file(tmp_path, [device(0, tflops=-3.0)], "b.json")
    unknown_region = topology_file(tmp_path, [device(0), device(1, region="mars")], "c.json")
    small_memory = topology_file(tmp_path, [device(i, memory_gb=2.0) for i in range(4)], "d.json")  # a layer each, not the model
    tiny_memory = topology_file(tmp_path, [device(i, memory_gb=0.5) for i in range(4)], "d2.json")
    no_tflops = topology_file(tmp_path, [device(0), {"id": "d1", "region": "r"}], "e.json")
    world = ["--scenario", "world-wide"]
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    return {
        "unparseable json": ([str(unparseable)], ["broken.json", "not valid JSON"]),
        "missing file": ([str(tmp_path / "absent.json")], ["absent.json", "No such file"]),
        "missing field": ([str(missing_field)], ["topology.devices[1].region", "missing"]),
        "negative tflops": ([str(negative_tflops)], ["topology.devices[0].tflops", "-3.0"]),
        "unknown region": ([str(unknown_region)], ["topology.devices[1].region", "mars"]),
        "no shape fits": ([*world, "--no-standby", "--stages", "5"], ["no shape fits 64 devices", "5 stages"]),
        "nothing fits in memory": ([str(small_memory), "--time-budget", "0.3"], ["nothing fits in memory", "gpt3-xl"]),
        "nothing fits without recomputing": ([str(small_memory), "--time-budget", "0.3", "--recompute", "never"],
                                             ["nothing fits in memory", "--recompute auto"]),
        "unknown recomputation": ([*world, "--recompute", "some"], ["--recompute", "'some'"]),
        "no device holds a layer": ([str(tiny_memory), "--time-budget", "0.3"], ["no device can hold a stage", "4 too small"]),
        "dp bytes with time model": ([*world, "--dp-bytes", "0.65e9"], ["--dp-bytes", "dtfm"]),
        "time model without tflops": ([str(no_tflops)], ["tflops"]),
        "micro-batch larger than batch": ([*world, "--batch", "4", "--micro-batch", "8"], ["micro-batch 8", "batch 4"]),
        "zero stages": ([*world, "--stages", "0"], ["--stages", "'0'"]),
        "negative seed": ([*world, "--seed=-1", "--time-budget", "0.2"], ["seed", "-1"]),
        "model folder without config": ([*world, "--model", str(no_config)], ["no-config", "has no config.json"]),
        "unsupported model": ([*world, "--model", str(bert)], ["bert/config.json", "model_type 'bert'"]),
        "unknown model": ([*world, "--model", "gpt9"], ["'gpt9'", "neither a preset"]),
        "sequence longer than the model": ([*world, "--model", "tiny", "--seq-len", "99"], ["preset tiny", "64 tokens"]),
    }


CASES = ["unparseable json", "missing file", "missing field", "negative tflops", "unknown region", "no shape fits",
         "nothing fits in memory", "no device holds a layer", "dp bytes with time model", "time model without tflops",
         "micro-batch larger than batch", "zero stages", "negative seed", "model folder without config",
         "unsupported model", "unknown model", "sequence longer than the model", "nothing fits without recomputing",
         "unknown recomputation"]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_exit_2(case, tmp_path):
    args, words = bad_inputs(tmp_path)[case]
    done = hetpeer("plan", *args, "--quiet")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("hetpeer plan: error: ")
    for word in words:
        assert word in lines[0]


def test_bad_input_without_quiet_still_ends_in_one_error_line():
    """Progress lines may come first, but the error is one line and there is no traceback."""
    done = hetpeer("plan", "--scenario", "world-wide", "--no-standby", "--stages", "5")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("hetpeer plan: error: no shape fits")
