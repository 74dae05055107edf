"""Workload: the GPT shapes and the per-layer counts the planner and the peers share."""

from __future__ import annotations

import pytest

from hetpeer.protocol.modelspec import PRESETS, ModelSpec, preset

from hetpeer.protocol.workload import Workload


def test_gpt3_xl_preset_shape():
    spec = PRESETS["gpt3-xl"]
    assert (spec.hidden, spec.heads, spec.seq_len, spec.vocab, spec.layers) == (2048, 16, 2048, 50257, 24)


def test_layer_params_formula():
    h = 2048
    # QKV (3 h^2 + 3 h) + output projection (h^2 + h) + MLP (8 h^2 + 5 h) + two LayerNorms (4 h) = 12 h^2 + 13 h
    assert preset("gpt3-xl").layer_params == 12 * h * h + 13 * h == 50_358_272


def test_gpt3_xl_total_params_by_hand():
    h, vocab, seq, layers = 2048, 50257, 2048, 24
    blocks = layers * (12 * h * h + 13 * h)  # 1_208_598_528
    embeddings = vocab * h + seq * h  # token + learned positions: 107_120_640
    head = vocab * h + 2 * h  # untied output head + final LayerNorm: 102_930_432
    total = preset("gpt3-xl").params
    assert total == blocks + embeddings + head == 1_418_649_600
    assert 1.3e9 <= total <= 1.5e9


def test_rotary_positions_have_no_position_embedding():
    learned = ModelSpec("m", hidden=64, heads=4, seq_len=128, vocab=256, layers=2)
    rotary = ModelSpec("m", hidden=64, heads=4, seq_len=128, vocab=256, layers=2, positions="rotary")
    assert learned.embedding_params - rotary.embedding_params == 128 * 64


def test_preset_with_layers_keeps_the_rest():
    spec = preset("gpt3-xl", layers=4)
    assert spec.layers == 4
    assert spec.hidden == 2048 and spec.vocab == 50257
    assert PRESETS["gpt3-xl"].layers == 24  # the preset itself is untouched


def test_derived_per_sequence_counts_for_tiny():
    w = Workload(preset("tiny"), batch=8, micro_batch=2, dtype="fp16")
    h, seq, vocab = 64, 64, 256
    assert w.dtype_bytes == 2
    assert w.layer_fwd_flops_per_seq == seq * (24 * h * h + 4 * seq * h) == 7_340_032
    assert w.head_fwd_flops_per_seq == seq * 2 * h * vocab
    assert w.boundary_bytes_per_seq == seq * h * 2 == 8192
    assert w.stored_activation_bytes_per_layer_per_seq == 38 * seq * h  # 8 h norms, 4 h their copies, 10 h attention, 16 h MLP
    assert w.logits_bytes_per_seq == 12 * seq * vocab
    assert Workload(preset("tiny"), batch=8, dtype="fp32").boundary_bytes_per_seq == seq * h * 4


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"batch": 0}, "batch"),
        ({"batch": -3}, "batch"),
        ({"batch": 4, "micro_batch": 0}, "micro-batch"),
        ({"batch": 4, "micro_batch": 5}, "larger than the batch"),
        ({"batch": 4, "dtype": "int8"}, "int8"),
    ],
)
def test_bad_workloads(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Workload(preset("tiny"), **kwargs)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"heads": 3}, "not divisible by heads 3"),
        ({"heads": 0}, "heads"),
        ({"hidden": 0}, "hidden"),
        ({"layers": 0}, "layers"),
        ({"positions": "alibi"}, "alibi"),
    ],
)
def test_bad_model_specs(kwargs, words):
    shape = {"hidden": 64, "heads": 4, "seq_len": 64, "vocab": 256, "layers": 2} | kwargs
    with pytest.raises(ValueError, match=words):
        ModelSpec("m", **shape)


def test_bad_presets():
    with pytest.raises(ValueError, match="gpt5"):
        preset("gpt5")
    with pytest.raises(ValueError, match="layers"):
        preset("tiny", layers=0)


def test_medium_preset_size_by_hand():
    # the memory case of benchmarks/vs_hivemind.py: 38.2M parameters, as docs/vs_hivemind.md says
    h, vocab, seq, layers = 512, 256, 128, 12
    blocks = layers * (12 * h * h + 13 * h)
    embeddings = vocab * h + seq * h
    head = vocab * h + 2 * h
    assert preset("medium").params == blocks + embeddings + head == 38_157_312
