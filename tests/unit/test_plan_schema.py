"""The plan's wire form: a plan that parses is one a peer can run; anything else names where it breaks."""

from __future__ import annotations

import copy
from dataclasses import replace
import math

import pytest

from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.recipe import Recipe
from hetpeer.protocol.wire import SchemaError


def wire() -> dict:
    """2 stages x 2 lanes over 6 layers, one device on standby."""
    return {
        "version": 1,
        "epoch": 3,
        "start_step": 100,
        "cost_model": "time",
        "model": "tiny",
        "layers": 6,
        "batch": 8,
        "micro_batch": 1,
        "micro_batches": 4,
        "dtype": "fp16",
        "stages": [
            {"index": 0, "layer_start": 0, "layer_end": 4, "devices": ["a", "b"], "sync": "allreduce"},
            {"index": 1, "layer_start": 4, "layer_end": 6, "devices": ["c", "d"], "sync": "gossip"},
        ],
        "lanes": [["a", "c"], ["b", "d"]],
        "standby": ["e"],
        "cost": {"total_s": 1.5, "sync_s": 0.25},
        "recipe": Recipe().to_wire(),
    }


def test_round_trip_and_derived_views():
    plan = Plan.from_wire(wire())
    assert plan.to_wire() == wire()
    assert plan.lanes == (("a", "c"), ("b", "d"))
    assert plan.group_size == 2
    assert plan.devices == ("a", "b", "c", "d")
    assert plan.total_s == 1.5
    assert [s.layers for s in plan.stages] == [4, 2]
    assert plan.neighbours("a") == ["c", "b"] and plan.neighbours("d") == ["b", "c"]  # lane first, then group
    assert plan.neighbours("e") == [] and plan.neighbours("stranger") == []  # standby and unknown: none


def test_the_recipe_round_trips_with_its_validation_settings_and_a_plan_without_one_has_the_defaults():
    raw = wire()
    raw["recipe"] |= {"eval_every": 50, "eval_batch": 3, "lr": 1e-3}
    plan = Plan.from_wire(raw)
    assert plan.to_wire() == raw and plan.recipe.lr == 1e-3
    assert plan.eval_sizes == (1, 1, 1) and plan.evaluates(100) and not plan.evaluates(101)
    assert not Plan.from_wire(wire()).evaluates(0)  # none unless asked
    bare = {k: v for k, v in wire().items() if k != "recipe"}
    assert Plan.from_wire(bare).recipe == Recipe()
    partial = wire() | {"recipe": {"lr": 2e-3}}  # fields left out: the defaults
    assert Plan.from_wire(partial).recipe == Recipe(lr=2e-3)


def test_a_recipe_field_this_peer_does_not_know_refuses_the_plan_naming_it():
    raw = wire()
    raw["recipe"]["lookahead_steps"] = 5  # a newer coordinator's recipe
    with pytest.raises(SchemaError, match=r"plan\.recipe\.lookahead_steps: is not a known field"):
        Plan.from_wire(raw)


def test_the_sequence_length_round_trips_and_a_plan_without_it_reads_as_before():
    raw = wire() | {"seq_len": 128}
    assert Plan.from_wire(raw).seq_len == 128 and Plan.from_wire(raw).to_wire() == raw
    assert Plan.from_wire(wire()).seq_len == 0 and "seq_len" not in Plan.from_wire(wire()).to_wire()
    for bad in (-1, 1.5, "128"):
        with pytest.raises(SchemaError, match="plan.seq_len"):
            Plan.from_wire(wire() | {"seq_len": bad})


def test_recomputation_round_trips_and_is_left_out_where_none():
    raw = copy.deepcopy(wire())
    raw["stages"][0]["recompute"] = 3
    plan = Plan.from_wire(raw)
    assert [s.recompute for s in plan.stages] == [3, 0]
    assert plan.to_wire() == raw
    assert "recompute" not in plan.to_wire()["stages"][1]  # a plan without it reads as before


def test_codecs_round_trip_per_lane_and_are_left_out_where_raw():
    raw = copy.deepcopy(wire())
    raw["stages"][0].update(forward=["int4", "int8"], backward=["int8", "raw"])
    plan = Plan.from_wire(raw)
    assert plan.to_wire() == raw
    assert plan.stages[0].codecs(0) == ("int4", "int8") and plan.stages[0].codecs(1) == ("int8", "raw")
    assert plan.stages[1].codecs(0) == ("raw", "raw")  # the last stage sends to no next stage
    assert plan.stages[0].hop_codecs == "int4/int8, int8/raw" and plan.stages[1].hop_codecs == ""  # as logs show them
    plain = Plan.from_wire(wire())
    assert "forward" not in plain.to_wire()["stages"][0] and plain.stages[0].codecs(1) == ("raw", "raw")


def test_with_codecs_names_every_hop_but_the_last_stage():
    plan = Plan.from_wire(wire()).with_codecs("int4", "int8")
    assert [s.forward for s in plan.stages] == [("int4", "int4"), ()]
    assert [s.backward for s in plan.stages] == [("int8", "int8"), ()]
    assert plan.with_codecs("raw", "raw") == Plan.from_wire(wire())  # raw is the plan without codecs
    assert plan.with_codecs("bf16", "raw").stages[0].backward == ()


def test_a_codec_this_peer_does_not_know_is_refused_with_a_clear_line():
    with pytest.raises(SchemaError, match=r"plan.stages\[0\].forward\[1\]: codec 'int3' is not one this peer knows "
                                          r"\(raw, fp16, bf16, int8, int4, int6\): a newer hetpeer made this plan"):
        Plan.from_wire(_with(lambda r: r["stages"][0].update(forward=["int4", "int3"])))


def test_the_data_position_and_dataset_round_trip_and_are_left_out_where_none():
    raw = wire()
    plain = Plan.from_wire(raw)
    assert plain.data_position == 0 and plain.dataset is None and "dataset" not in plain.to_wire()
    raw.update(data_position=4096, dataset={"manifest": "ab" * 32, "url": "https://example.org/corpus/"})
    plan = Plan.from_wire(raw)
    assert plan.to_wire()["dataset"] == raw["dataset"] and Plan.from_wire(plan.to_wire()) == plan
    assert plan.rows_per_step == plan.group_size * plan.lane_sequences(0)
    assert plan.data_position_at(plan.start_step + 3) == 4096 + 3 * plan.rows_per_step


def test_lanes_may_be_left_out():
    raw = wire()
    del raw["lanes"]
    assert Plan.from_wire(raw).lanes == (("a", "c"), ("b", "d"))


def test_lanes_of_unlike_shares_round_trip_and_tile_the_step():
    """Lane a takes 6 of the 8 sequences in micro-batches of 4 (one partial), lane b 2: the most micro-batches any
    lane runs is 2; a step's windows are a's 6 then b's 2."""
    raw = _with(lambda r: r.update(lane_batches=[6, 2], micro_batch=4, micro_batches=2))
    plan = Plan.from_wire(raw)
    assert plan.to_wire() == raw
    assert [plan.lane_sequences(lane) for lane in range(2)] == [6, 2]
    assert plan.micro_batch_sizes(0) == (4, 2) and plan.micro_batch_sizes(1) == (2,)
    assert (plan.lane_offset(0), plan.lane_offset(1), plan.rows_per_step) == (0, 6, 8)
    even = Plan.from_wire(wire())  # without them: each lane ceil(batch / lanes), in the order of the lanes
    assert even.micro_batch_sizes(1) == (1,) * 4 and (even.lane_offset(1), even.rows_per_step) == (4, 8)


def test_a_learned_overhead_may_take_time_off_the_step():
    # the coordinator learned that its model over-predicts this swarm's steps (coordinator/calibration.py)
    raw = wire()
    raw["cost"].update(overhead_s=-0.0013)
    plan = Plan.from_wire(raw)
    assert plan.cost["overhead_s"] == -0.0013
    assert plan.predicted == "1.500 s/step, -1 ms overhead included"
    assert Plan.from_wire(plan.to_wire()) == plan


def test_the_predicted_relay_load_round_trips_and_is_left_out_where_nothing_is_relayed():
    raw = _with(lambda r: r.update(relay_load=[["r", 2, 3145728.0]]))
    plan = Plan.from_wire(raw)
    assert plan.relay_load == (("r", 2, 3145728.0),) and plan.to_wire() == raw
    assert "relay_load" not in Plan.from_wire(wire()).to_wire()


def _with(edit) -> dict:
    raw = copy.deepcopy(wire())
    edit(raw)
    return raw


BAD = [
    ("gap between stages", lambda r: r["stages"][1].update(layer_start=5), "plan.stages[1]"),
    ("overlapping stages", lambda r: r["stages"][1].update(layer_start=3), "plan.stages[1]"),
    ("empty stage", lambda r: r["stages"][1].update(layer_end=4), "plan.stages[1]"),
    ("layers not all covered", lambda r: r.update(layers=7), "plan.stages"),
    ("not starting at layer 0", lambda r: r["stages"][0].update(layer_start=1), "plan.stages[0]"),
    ("stage index out of order", lambda r: r["stages"][1].update(index=2), "plan.stages[1].index"),
    ("unequal groups", lambda r: r["stages"][1].update(devices=["c", "d", "f"]), "plan.stages[1].devices"),
    ("device twice", lambda r: r["stages"][1].update(devices=["c", "a"]), "plan.stages[1].devices"),
    ("standby device also placed", lambda r: r.update(standby=["b"]), "plan.standby"),
    ("unknown sync", lambda r: r["stages"][0].update(sync="psum"), "plan.stages[0].sync"),
    ("lanes not the stage columns", lambda r: r.update(lanes=[["a", "d"], ["b", "c"]]), "plan.lanes"),
    ("newer version", lambda r: r.update(version=2), "plan.version"),
    ("unknown cost model", lambda r: r.update(cost_model="flops"), "plan.cost_model"),
    ("negative cost", lambda r: r["cost"].update(total_s=-1.0), "plan.cost.total_s"),
    ("cost as string", lambda r: r["cost"].update(total_s="1.5"), "plan.cost.total_s"),
    ("cost past a float's range", lambda r: r["cost"].update(total_s=10**400), "plan.cost.total_s"),  # found by fuzzing
    ("an overhead taking more than half the step", lambda r: r["cost"].update(overhead_s=-1.6), "plan.cost.overhead_s"),
    ("an infinite overhead", lambda r: r["cost"].update(overhead_s=-math.inf), "plan.cost.overhead_s"),
    ("no stages", lambda r: r.update(stages=[], lanes=[]), "plan.stages"),
    ("unknown field", lambda r: r.update(owner="me"), "plan.owner"),
    ("missing field", lambda r: r.pop("epoch"), "plan.epoch"),
    ("bool as int", lambda r: r.update(batch=True), "plan.batch"),
    ("unknown dtype", lambda r: r.update(dtype="fp8"), "plan.dtype"),
    ("micro-batch above the batch", lambda r: r.update(micro_batch=r["batch"] + 1), "plan.micro_batch"),
    ("lane shares short of the batch", lambda r: r.update(lane_batches=[5, 2]), "plan.lane_batches"),
    ("a share per lane, one short", lambda r: r.update(lane_batches=[8]), "plan.lane_batches"),
    ("a lane with nothing to do", lambda r: r.update(lane_batches=[8, 0]), "plan.lane_batches[1]"),
    ("a share as a string", lambda r: r.update(lane_batches=["4", 4]), "plan.lane_batches[0]"),
    ("micro-batches short of the largest share", lambda r: r.update(lane_batches=[6, 2]), "plan.micro_batches"),
    ("validation without a batch", lambda r: r["recipe"].update(eval_batch=0), "plan.recipe.eval_batch"),
    ("negative validation interval", lambda r: r["recipe"].update(eval_every=-1), "plan.recipe.eval_every"),
    ("a negative learning rate", lambda r: r["recipe"].update(lr=-1.0), "plan.recipe.lr"),
    ("an unknown topology", lambda r: r["recipe"].update(topology="star"), "plan.recipe.topology"),
    ("more layers recomputed than held", lambda r: r["stages"][1].update(recompute=3), "plan.stages[1].recompute"),
    ("negative recomputation", lambda r: r["stages"][0].update(recompute=-1), "plan.stages[0].recompute"),
    ("recomputation as a flag", lambda r: r["stages"][0].update(recompute=True), "plan.stages[0].recompute"),
    ("a codec per lane, short", lambda r: r["stages"][0].update(forward=["int8"]), "plan.stages[0].forward"),
    ("codecs on the last stage", lambda r: r["stages"][1].update(backward=["int8", "int8"]), "plan.stages[1].backward"),
    ("a codec that is no string", lambda r: r["stages"][0].update(backward=["int8", 8]), "plan.stages[0].backward[1]"),
    ("codecs as a string", lambda r: r["stages"][0].update(forward="int8"), "plan.stages[0].forward"),
    ("negative data position", lambda r: r.update(data_position=-1), "plan.data_position"),
    ("a dataset named by no sha256", lambda r: r.update(dataset={"manifest": "abc"}), "plan.dataset.manifest"),
    ("a dataset at no http url", lambda r: r.update(dataset={"manifest": "a" * 64, "url": "file:///etc/"}), "plan.dataset.url"),
    ("a relay load without its bytes", lambda r: r.update(relay_load=[["r", 2]]), "plan.relay_load[0]"),
    ("a relay carrying no pair", lambda r: r.update(relay_load=[["r", 0, 1.0]]), "plan.relay_load[0][1]"),
    ("a relay carrying negative bytes", lambda r: r.update(relay_load=[["r", 1, -1.0]]), "plan.relay_load[0][2]"),
    ("a dataset with more", lambda r: r.update(dataset={"manifest": "a" * 64, "mirror": "x"}), "plan.dataset.mirror"),
]


@pytest.mark.parametrize("edit, path", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_broken_plans_are_refused_with_their_path(edit, path):
    with pytest.raises(SchemaError) as caught:
        Plan.from_wire(_with(edit))
    assert caught.value.path == path
    assert str(caught.value).startswith(f"{path}: ")


def test_a_plan_says_which_stages_work_is_unchecked():
    recipe_plan = lambda holders, check=0.02: Plan(
        cost_model="time", model="tiny", layers=2 * len(holders), batch=4, micro_batch=1, micro_batches=4 // len(holders[0]),
        dtype="fp32", recipe=Recipe(check=check),
        stages=tuple(StagePlan(s, 2 * s, 2 * s + 2, devices, "allreduce") for s, devices in enumerate(holders)))
    three = recipe_plan((("a", "b", "c", "d"), ("e", "f", "g", "h")))
    assert [three.checked(s) for s in (0, 1)] == ["checked", "checked"] and three.check_lines() == []
    assert recipe_plan((("a", "b"), ("c", "d"))).check_lines() == [
        f"stage {s}: checked in a pair: a failed check is a dispute, which the next plan's partners decide" for s in (0, 1)]
    alone = recipe_plan((("a",), ("b",)))
    assert alone.checked(0) == "unchecked" and alone.check_lines()[0] == "stage 0: unchecked: its one holder's work is believed"
    assert recipe_plan((("a", "b", "c", "d"), ("e", "f", "g", "h")), check=0).check_lines() == [
        "no stage's work is checked: the recipe's check is 0"]
    assert recipe_plan((("a", "b", "c", "d"),)).checked(0) == ""  # one stage hands nothing along a lane
    pair = recipe_plan((("a", "b"), ("c", "d")))  # lanes a-c, b-d: a checks b with d's help, and so on
    assert pair.check_links == (("a", "d"), ("b", "c"))
    gossip = replace(three, stages=tuple(replace(stage, sync="gossip") for stage in three.stages))
    assert [gossip.checked(s) for s in (0, 1)] == ["unchecked", "unchecked"]
    assert gossip.check_lines() == [f"stage {s}: unchecked: its gossip group's members hold weights too far apart to judge "
                                    "each other's work" for s in (0, 1)]
