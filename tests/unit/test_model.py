"""GPT stages: they hold and compute exactly what the workload counts, and any cut trains the same model."""

from __future__ import annotations

import math

import pytest

import torch

from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count  # noqa: E402

from hetpeer.peer.model import Block, Stage, build_stage  # noqa: E402
from hetpeer.peer.model.families import rotary_frequencies  # noqa: E402
from hetpeer.peer.model.gpt import head_logits  # noqa: E402
from hetpeer.protocol.modelspec import ModelSpec
from hetpeer.protocol.modelspec import preset  # noqa: E402
from hetpeer.protocol.workload import Workload  # noqa: E402

SMALL = ModelSpec("small", hidden=48, heads=3, seq_len=32, vocab=97, layers=3)
SPECS = [
    preset("tiny"),
    ModelSpec("tiny-rotary", hidden=64, heads=4, seq_len=64, vocab=256, layers=4, positions="rotary"),
    SMALL,
    ModelSpec("small-rotary", hidden=48, heads=3, seq_len=32, vocab=97, layers=3, positions="rotary"),
]
SPEC_IDS = [spec.name for spec in SPECS]


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _tokens(spec: ModelSpec, batch: int, seq: int | None = None, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.vocab, (batch, seq or spec.seq_len), generator=generator)


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_parameter_counts_match_the_workload(spec):
    model = build_stage(spec, 0, spec.layers)
    for block in model.blocks.values():
        assert _count(block) == spec.layer_params
    embeddings = _count(model.tokens) + (_count(model.positions) if hasattr(model, "positions") else 0)
    assert embeddings == spec.embedding_params
    assert _count(model.norm) + _count(model.head) == spec.head_params
    assert _count(model) == spec.params


def _flops(fn, *args) -> int:
    # torch's counter has the attention formula for the CUDA kernels (flash, efficient, cudnn) but none for
    # the CPU flash kernel, which it would count as 0; give that kernel the same formula. Like the workload,
    # the formula counts the full seq x seq score matrix: causal masking is not discounted.
    cpu_attention = {}
    if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        cpu_attention[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = (
            lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)
        )
    with FlopCounterMode(display=False, custom_mapping=cpu_attention) as counter:
        fn(*args)
    return counter.get_total_flops()


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_forward_flops_match_the_workload_exactly(spec):
    batch = 3
    workload = Workload(spec, batch=batch)
    model = build_stage(spec, 0, spec.layers)
    hidden = torch.randn(batch, spec.seq_len, spec.hidden)
    assert _flops(model.blocks["0"], hidden) == workload.layer_fwd_flops_per_seq * batch
    assert _flops(model.head, hidden) == workload.head_fwd_flops_per_seq * batch


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_boundary_activation_bytes(dtype):
    spec, batch = preset("tiny"), 3
    out = build_stage(spec, 0, 2)(_tokens(spec, batch))
    assert out.shape == (batch, spec.seq_len, spec.hidden)
    sent = out.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype])
    assert sent.numel() * sent.element_size() == batch * Workload(spec, batch, dtype=dtype).boundary_bytes_per_seq


GPT2 = ModelSpec.from_config({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 64,
                              "vocab_size": 256})
LLAMA = ModelSpec.from_config({"model_type": "llama", "hidden_size": 64, "intermediate_size": 172, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "num_hidden_layers": 2, "max_position_embeddings": 64,
                               "vocab_size": 256})


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("spec", [preset("tiny"), SPECS[1], GPT2, LLAMA], ids=["learned", "rotary", "gpt2", "llama"])
def test_saved_activation_bytes_near_the_workload(spec, dtype):
    """A block as the runtime runs it (fp32 weights and residual stream, bf16 under autocast) keeps for its backward
    pass what `Workload.layer_activation_bytes` counts, weight copies included: measured 0.94 to 1.07 of it on CPU
    (torch 2.13)."""
    batch = 2
    block = build_stage(spec, 0, 1).blocks["0"]
    param_storages = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved_bytes: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved_bytes[storage.data_ptr()] = storage.nbytes()
        return tensor

    x = torch.randn(batch, spec.seq_len, spec.hidden, requires_grad=True)
    args = ()
    if spec.family == "llama":
        angles = torch.outer(torch.arange(spec.seq_len, dtype=torch.float32), rotary_frequencies(spec))
        args = (torch.cat((angles, angles), dim=-1).cos(), torch.cat((angles, angles), dim=-1).sin())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        block(x, *args)
    expected = Workload(spec, batch, dtype=dtype).layer_activation_bytes(batch)
    ratio = sum(saved_bytes.values()) / expected
    assert 0.85 <= ratio <= 1.1, f"saved {sum(saved_bytes.values())} bytes, workload says {expected}: ratio {ratio:.3f}"


CUTS = [(0, 1), (1, 3), (3, 4)]


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_stages_built_alone_hold_the_whole_models_values(positions):
    spec = ModelSpec("m", hidden=32, heads=2, seq_len=16, vocab=50, layers=4, positions=positions)
    whole = dict(build_stage(spec, 0, 4, seed=7).named_parameters())
    names = []
    for start, end in CUTS:
        for name, value in build_stage(spec, start, end, seed=7).named_parameters():
            assert torch.equal(value, whole[name]), name
            names.append(name)
    assert sorted(names) == sorted(whole)
    other = dict(build_stage(spec, 0, 4, seed=8).named_parameters())
    assert not torch.equal(other["blocks.2.qkv.weight"], whole["blocks.2.qkv.weight"])


def test_building_leaves_the_global_random_state_alone():
    before = torch.random.get_rng_state()
    build_stage(preset("tiny"), 0, 4)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_initial_values_follow_gpt2():
    spec = preset("tiny")
    model = build_stage(spec, 0, spec.layers)
    block = model.blocks["1"]
    assert torch.equal(block.ln1.weight, torch.ones(spec.hidden)) and not block.ln1.bias.any()
    assert not block.qkv.bias.any() and not block.fc2.bias.any()
    assert block.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.fc2.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * spec.layers), rel=0.05)
    assert model.head.weight.std().item() == pytest.approx(0.02, rel=0.05)


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_pipeline_of_stages_gives_the_whole_models_loss_and_gradients(positions):
    spec = ModelSpec("m", hidden=32, heads=2, seq_len=16, vocab=50, layers=4, positions=positions)
    tokens, labels = _tokens(spec, 3, seed=1), _tokens(spec, 3, seed=2)

    whole = build_stage(spec, 0, 4)
    whole_loss = whole.loss(whole(tokens), labels)
    whole_loss.backward()

    # As in the pipeline: each stage's input is a leaf, and its gradient is sent back to the stage before.
    stages = [build_stage(spec, start, end) for start, end in CUTS]
    inputs, outputs = [], []
    x = tokens
    for stage in stages:
        inputs.append(x)
        outputs.append(stage(x))
        x = outputs[-1].detach().requires_grad_()
    loss = stages[-1].loss(outputs[-1], labels)
    loss.backward()
    for i in (1, 0):
        outputs[i].backward(inputs[i + 1].grad)

    torch.testing.assert_close(loss, whole_loss, rtol=1e-5, atol=0)
    grads = {name: p.grad for stage in stages for name, p in stage.named_parameters()}
    assert sorted(grads) == sorted(name for name, _ in whole.named_parameters())
    for name, p in whole.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-8, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_outputs_are_causal_and_depend_on_order(positions):
    spec = ModelSpec("m", hidden=32, heads=2, seq_len=16, vocab=50, layers=2, positions=positions)
    model = build_stage(spec, 0, 2)
    tokens = _tokens(spec, 2)
    with torch.no_grad():
        logits = model(tokens)
        assert logits.shape == (2, spec.seq_len, spec.vocab) and torch.isfinite(logits).all()
        t = 7
        changed = tokens.clone()
        changed[:, t + 1:] = (changed[:, t + 1:] + 1) % spec.vocab
        later = model(changed)
        torch.testing.assert_close(later[:, : t + 1], logits[:, : t + 1], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(later[:, t + 1:], logits[:, t + 1:])
        # Without position information the last output would not see the order of the tokens before it.
        swapped = tokens.clone()
        swapped[:, [0, 1]] = tokens[:, [1, 0]]
        assert not torch.allclose(model(swapped)[:, -1], logits[:, -1])
        # A shorter sequence is a prefix of the longer one.
        torch.testing.assert_close(model(tokens[:, :5]), logits[:, :5], rtol=1e-5, atol=1e-6)


def test_stage_properties():
    spec = preset("tiny")
    middle = build_stage(spec, 1, 3)
    assert (middle.first, middle.last, middle.layer_start, middle.layer_end, middle.spec) == (False, False, 1, 3, spec)
    assert sorted(middle.blocks) == ["1", "2"] and not hasattr(middle, "tokens") and not hasattr(middle, "head")
    whole = build_stage(spec, 0, 4)
    assert whole.first and whole.last
    assert isinstance(whole, Stage) and isinstance(whole.blocks["3"], Block)


@pytest.mark.parametrize("start, end", [(2, 2), (3, 1), (-1, 2), (0, 5)])
def test_bad_layer_ranges(start, end):
    with pytest.raises(ValueError, match=rf"\[{start}, {end}\)"):
        build_stage(preset("tiny"), start, end)


def test_bad_inputs_name_the_value():
    spec = preset("tiny")
    first, last = build_stage(spec, 0, 2), build_stage(spec, 2, 4)
    with pytest.raises(ValueError, match="torch.float32"):
        first(torch.zeros(2, 8))
    with pytest.raises(ValueError, match=r"\(2, 8, 3\)"):
        first(torch.zeros(2, 8, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="65"):
        first(torch.zeros(2, 65, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(2, 8, 32\)"):
        last(torch.zeros(2, 8, 32))
    with pytest.raises(ValueError, match="torch.int64"):
        last(torch.zeros(2, 8, 64, dtype=torch.long))
    with pytest.raises(ValueError, match="65"):
        last(torch.zeros(2, 65, 64))
    logits = last(torch.zeros(2, 8, 64))
    with pytest.raises(ValueError, match="torch.int32"):
        last.loss(logits, torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\(2, 7\)"):
        last.loss(logits, torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="seed"):
        build_stage(spec, 0, 1, seed=-1)
    with pytest.raises(ValueError, match="even head size"):
        build_stage(ModelSpec("odd", hidden=6, heads=2, seq_len=8, vocab=10, layers=1, positions="rotary"), 0, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_stage_matches_cpu():
    spec = preset("tiny")
    cpu, cuda = build_stage(spec, 0, 4), build_stage(spec, 0, 4, device="cuda")
    for (name, a), (_, b) in zip(cpu.named_parameters(), cuda.named_parameters()):
        assert torch.equal(a, b.cpu()), name
    tokens, labels = _tokens(spec, 2, seed=1), _tokens(spec, 2, seed=2)
    cpu_loss = cpu.loss(cpu(tokens), labels)
    cuda_loss = cuda.loss(cuda(tokens.cuda()), labels.cuda())
    cuda_loss.backward()
    torch.testing.assert_close(cuda_loss.cpu(), cpu_loss, rtol=1e-3, atol=1e-4)
    assert all(torch.isfinite(p.grad).all() for p in cuda.parameters())


@pytest.mark.parametrize("vocab", [2001, 2048])
@pytest.mark.parametrize("autocast", [False, True])
def test_the_padded_head_gives_the_logits_and_gradients_of_the_plain_product(vocab, autocast):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, 32, generator=generator, requires_grad=True)
    hidden = torch.randn(2, 5, 32, generator=generator, requires_grad=True)
    grad = torch.randn(2, 5, vocab, generator=generator)
    results = []
    for product in (head_logits, torch.nn.functional.linear):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = product(hidden, weight)
        assert logits.shape == (2, 5, vocab)
        weight.grad = hidden.grad = None
        logits.backward(grad.to(logits.dtype))
        results.append((logits.detach().float(), weight.grad.clone(), hidden.grad.clone()))
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if autocast else {"rtol": 1e-5, "atol": 1e-5}
    for padded, plain in zip(*results):
        torch.testing.assert_close(padded, plain, **tolerance)
