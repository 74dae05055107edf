"""What a stage's step costs beyond its blocks (`peer.pipeline.steptime`): the parts it times and how they compose
into what the time model counts, and the whole probe on this machine's CPU."""

from __future__ import annotations

import math

import pytest

from hetpeer.peer.pipeline import steptime
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.stepcosts import CODEC_FIELDS, FIELDS, MAX_VALUE_S, StepCosts


def test_the_parts_compose_the_one_stage_workers_step_and_the_rest_is_its_python(monkeypatch):
    # each timing answers a figure of its own, in the order they are taken: the block alone and recomputing its
    # activations, alternately, three rounds (the fastest of each counts), the first stage, the last stage, the
    # optimizer's step over its parameters, the one-stage worker's whole step, each codec's encoding and decoding
    timings = iter([1.2e-3, 2.0e-3, 1e-3, 2.4e-3, 1.1e-3, 1.8e-3, 1.5e-3, 2.5e-3, 2e-3, 20e-3, 1e-5, 2e-5, 4e-5, 8e-5, 6e-5])
    monkeypatch.setattr(steptime, "time_per_call", lambda *args, **kwargs: next(timings))
    spec = preset("tiny")
    costs = steptime.step_costs(spec, micro_batch=2)
    size = max(steptime.UPDATE_PARAMS, spec.layer_params)
    assert costs.embed_s_per_seq == pytest.approx(0.5e-3 / 2) and costs.head_s_per_seq == pytest.approx(1.5e-3 / 2)
    assert costs.update_s_per_param == pytest.approx(2e-3 / size)
    parts = steptime.MICRO_BATCHES * (1e-3 + 0.5e-3 + 1.5e-3) + 2e-3 / size * spec.with_layers(1).params  # its blocks and the rest
    assert costs.micro_s == pytest.approx((20e-3 - parts) / steptime.MICRO_BATCHES)
    assert costs.recompute_share == pytest.approx(0.8)  # recomputing added 0.8 of the block's forward and backward
    values = 2 * spec.seq_len * spec.hidden  # a micro-batch's activation
    assert [getattr(costs, CODEC_FIELDS[c]) for c in ("fp16", "bf16", "int8", "int4", "int6")] == pytest.approx(
        [1e-5 / values, 2e-5 / values, 4e-5 / values, 8e-5 / values, 6e-5 / values])


def test_parts_timed_faster_than_a_block_count_nothing_not_less(monkeypatch):
    # noise: more timed faster
    timings = iter([2e-3, 1.5e-3] * steptime.RECOMPUTE_ROUNDS + [1e-3, 1.5e-3, 1e-3, 1e-3] + [1e-5] * len(CODEC_FIELDS))
    monkeypatch.setattr(steptime, "time_per_call", lambda *args, **kwargs: next(timings))
    costs = steptime.step_costs(preset("tiny"), micro_batch=2)
    assert (costs.embed_s_per_seq, costs.head_s_per_seq, costs.micro_s) == (0.0, 0.0, 0.0)
    # recomputing timed faster than not: the least it costs, not a figure that reads as untimed (0)
    assert costs.recompute_share == steptime.RECOMPUTE_FLOOR


@pytest.mark.parametrize("slowdown", [1.0, 3.0])
def test_the_probe_runs_the_workers_own_step_on_this_machine(slowdown):
    costs = steptime.step_costs(preset("tiny"), micro_batch=2, seconds=0.05, slowdown=slowdown)
    assert isinstance(costs, StepCosts)  # within the bounds a record carries (StepCosts checks them)
    assert all(math.isfinite(getattr(costs, name)) for name in FIELDS)
    assert costs.update_s_per_param > 0  # an optimizer's step always takes time
    assert all(getattr(costs, name) > 0 for name in CODEC_FIELDS.values())  # and so does every codec


def test_codec_rates_are_what_encoding_and_decoding_an_activation_take_here():
    """Timed as a hop runs them (`as_received`), per value, within a record's bounds; the 4-bit codec does more
    work a value than a cast to 16 bits."""
    rates = steptime.codec_s_per_value(1 << 16, seconds=0.2)
    assert set(rates) == set(CODEC_FIELDS)
    assert all(0 < rate <= MAX_VALUE_S for rate in rates.values())
    assert rates["int4"] > rates["bf16"]


def test_a_block_already_timed_is_what_the_stages_are_reckoned_against(monkeypatch):
    # the join's probe has just timed the block (`probe.block_tflops`): the first and last stages are reckoned
    # against its figure; the block timed again, plain and recomputing, gives recomputation's share only
    from hetpeer.protocol.workload import Workload

    spec = preset("tiny")
    block_s = 1e-3
    tflops = 3 * 2 * Workload(spec, batch=2, micro_batch=2).layer_fwd_flops_per_seq / (block_s * 1e12)
    # block and recomputing, each round; then first stage, last stage, optimizer, worker, codecs
    timings = iter([0.8e-3, 1.2e-3] * steptime.RECOMPUTE_ROUNDS + [1.5e-3, 2.5e-3, 2e-3, 20e-3] + [1e-5] * len(CODEC_FIELDS))
    monkeypatch.setattr(steptime, "time_per_call", lambda *args, **kwargs: next(timings))
    costs = steptime.step_costs(spec, micro_batch=2, tflops=tflops)
    assert costs.embed_s_per_seq == pytest.approx(0.5e-3 / 2) and costs.head_s_per_seq == pytest.approx(1.5e-3 / 2)
    assert costs.recompute_share == pytest.approx(0.5)
    assert next(timings, None) is None  # every timing was taken, and no more
