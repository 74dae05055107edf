"""GPT-2 and Llama from `transformers` configs: the planner's counts are the models' own, stages cut anywhere
compute what `transformers` computes from the same weights, each peer reads only its own tensors, and a
tied head stays tied through training.

`transformers` (in the test extra) builds the reference models from tiny random configs; nothing is
downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hetpeer.peer.model import FamilyStage, build_stage  # noqa: E402
from hetpeer.peer.model.folder import ModelFolder  # noqa: E402
from hetpeer.peer.pipeline.worker import StageWorker, WorkerConfig  # noqa: E402
from hetpeer.peer.transport import MemoryHub, MemoryTransport  # noqa: E402
from hetpeer.protocol.plan import Plan, StagePlan  # noqa: E402
from hetpeer.protocol.modelspec import ModelConfigError, ModelSpec
from hetpeer.protocol.modelspec import load_model  # noqa: E402
from hetpeer.protocol.recipe import Recipe  # noqa: E402
from hetpeer.protocol.workload import Workload  # noqa: E402
from in_threads import results  # noqa: E402

GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_head": 4, "n_layer": 3, "n_positions": 24, "vocab_size": 300,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 80, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 3, "max_position_embeddings": 24, "vocab_size": 300,
         "tie_word_embeddings": False, "rope_theta": 5000.0}
LLAMA_TIED_SCALED = LLAMA | {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True, "head_dim": 16,
                             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8}}
CONFIGS = {"gpt2": GPT2, "llama": LLAMA, "llama-tied-scaled": LLAMA_TIED_SCALED}


def hf_model(config: dict, seed: int = 0):
    torch.manual_seed(seed)
    kind = {"gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[config["model_type"]]
    fields = {k: v for k, v in config.items() if k != "model_type"}
    model = kind[1](kind[0](**fields)).eval()
    with torch.no_grad():  # norms and biases start at 1 and 0: move them too, so a misplaced one shows
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return model


@pytest.fixture(params=sorted(CONFIGS))
def saved(request, tmp_path) -> tuple[str, Path, object]:
    model = hf_model(CONFIGS[request.param])
    model.save_pretrained(tmp_path)
    return request.param, tmp_path, model


def test_counts_are_the_models_own(saved):
    name, folder, model = saved
    spec = load_model(str(folder))
    assert spec.family == CONFIGS[name]["model_type"]
    assert spec.params == model.num_parameters()  # a tied head once, as transformers counts it
    stage = build_stage(spec, 0, spec.layers)
    assert sum(p.numel() for p in stage.parameters()) == spec.stored_params
    for start, end in ((0, 1), (1, 2), (2, 3), (0, 3)):
        stage = build_stage(spec, start, end)
        low, high = spec.param_range(start, end)
        assert sum(p.numel() for p in stage.parameters()) == high - low  # a stage is its slice of the flat vector
    block = model.base_model.h[0] if spec.family == "gpt2" else model.base_model.layers[0]
    assert spec.layer_params == sum(p.numel() for p in block.parameters())


def test_llama_flops_by_hand():
    spec = ModelSpec.from_config(LLAMA)
    h, a, k, d, f, seq = 32, 4, 2, 8, 80, 24
    per_token = 2 * (h * a * d + 2 * h * k * d + a * d * h + 3 * h * f) + 4 * seq * a * d
    assert spec.layer_fwd_flops_per_token() == per_token
    assert Workload(spec, batch=2).layer_fwd_flops_per_seq == seq * per_token
    assert spec.name.startswith("llama-") and spec.name == ModelSpec.from_config(dict(LLAMA)).name
    assert ModelSpec.from_config(LLAMA, seq_len=16).name != spec.name  # another sequence length, another model


@pytest.mark.parametrize("cuts", [((0, 3),), ((0, 1), (1, 3)), ((0, 2), (2, 3)), ((0, 1), (1, 2), (2, 3))])
def test_stages_compute_what_transformers_computes(saved, cuts):
    _, folder, model = saved
    spec = load_model(str(folder))
    tokens = torch.randint(0, spec.vocab, (2, spec.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(tokens).logits
        x = tokens
        for start, end in cuts:
            stage = build_stage(spec, start, end, seed=5)
            ModelFolder.open(folder, spec).load_into(stage)
            x = stage(x)
    torch.testing.assert_close(x, expected, rtol=1e-4, atol=1e-5)


def test_a_stage_reads_only_its_own_tensors(saved):
    _, folder, _ = saved
    spec = load_model(str(folder))
    whole = sum(p.numel() for p in build_stage(spec, 0, spec.layers).parameters()) * 4
    middle = build_stage(spec, 1, 2)
    assert ModelFolder.open(folder, spec).load_into(middle) == spec.layer_params * 4 < whole / 2


def test_any_cut_starts_from_the_same_fresh_weights():
    spec = ModelSpec.from_config(LLAMA_TIED_SCALED)
    whole = dict(build_stage(spec, 0, 3, seed=3).named_parameters())
    for start, end in ((0, 1), (1, 2), (2, 3)):
        for name, value in build_stage(spec, start, end, seed=3).named_parameters():
            assert torch.equal(value, whole[name]), name
    assert torch.equal(whole["lm_head.weight"], whole["model.embed_tokens.weight"])  # a tied head starts tied


def test_weight_decay_spares_biases_norms_embeddings_and_a_tied_head():
    from hetpeer.peer.gossip.flat import FlatParams

    spec = ModelSpec.from_config(GPT2)
    stage = build_stage(spec, 0, spec.layers)
    flat = FlatParams(stage)
    decayed = torch.zeros(flat.size, dtype=torch.bool)
    for start, end in flat.decay_ranges:
        decayed[start:end] = True
    offset = 0
    for name, param in stage.named_parameters():
        part = decayed[offset : offset + param.numel()]
        matrix = param.dim() == 2 and not name.endswith(("wte.weight", "wpe.weight", "lm_head.weight"))
        assert bool(part.all()) if matrix else not bool(part.any()), name
        offset += param.numel()


@pytest.mark.parametrize(
    "change, words",
    [
        ({"model_type": "bert"}, "model_type 'bert' is not supported"),
        ({"n_embd": "32"}, "n_embd must be a non-negative integer"),
        ({"n_head": 5}, "not divisible by heads 5"),
        ({"activation_function": "relu"}, "activation_function 'relu'"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
    ],
)
def test_configs_it_cannot_train_are_refused_by_key(change, words):
    with pytest.raises(ModelConfigError, match=words):
        ModelSpec.from_config(GPT2 | change, "my/config.json")


def test_llama_configs_it_cannot_train_are_refused_by_key():
    with pytest.raises(ModelConfigError, match="rope_scaling of type 'yarn'"):
        ModelSpec.from_config(LLAMA | {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ModelConfigError, match="heads 4 is not a multiple of key/value heads 3"):
        ModelSpec.from_config(LLAMA | {"num_key_value_heads": 3})
    with pytest.raises(ModelConfigError, match="exceed its context of 24"):
        ModelSpec.from_config(LLAMA, seq_len=25)


def test_bad_folders_are_named(tmp_path):
    with pytest.raises(ModelConfigError, match="neither a preset .* nor a folder"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(ModelConfigError, match="has no config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="config.json is not valid JSON"):
        load_model(str(tmp_path))


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    hf_model(GPT2).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(GPT2 | {"n_embd": 48}))  # the weights are of n_embd 32
    spec = load_model(str(tmp_path))
    with pytest.raises(ModelConfigError, match=r"has shape \[300, 32\], the config says \[300, 48\] \(a checkpoint of another model"):
        ModelFolder.open(tmp_path, spec).load_into(build_stage(spec, 0, 1))
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ModelConfigError, match="not a safetensors file"):
        ModelFolder.open(tmp_path, spec)


def tied_plan(stages: int, spec: ModelSpec, recipe: Recipe = Recipe(lr=1e-2)) -> Plan:
    bounds = [round(s * spec.layers / stages) for s in range(stages + 1)]
    return Plan(cost_model="time", model=spec.name, layers=spec.layers, batch=2, micro_batch=1, micro_batches=2,
                dtype="fp32", stages=tuple(StagePlan(s, bounds[s], bounds[s + 1], (f"s{s}",), "none") for s in range(stages)),
                recipe=recipe)


def train(plan: Plan, spec: ModelSpec, folder: Path, steps: int) -> dict[str, StageWorker]:
    from hetpeer.peer.data.corpus import Corpus

    corpus = Corpus.default(min_tokens=spec.seq_len + 1)
    hub = MemoryHub()
    config = WorkerConfig(model=spec, weights=str(folder))
    workers = {}
    for device in plan.devices:
        transport = MemoryTransport(device, hub)
        transport.start()
        workers[device] = StageWorker(plan, device, transport, corpus if plan.position(device)[0] == 0 else None, config)
    for _ in range(steps):
        results([lambda w=w: w.train_step() for w in workers.values()], 60.0)
    return workers


def test_a_tied_head_stays_tied_in_one_stage_and_across_a_pipeline(tmp_path):
    hf_model(GPT2).save_pretrained(tmp_path)
    spec = load_model(str(tmp_path), seq_len=16)
    clipped = train(tied_plan(3, spec), spec, tmp_path, steps=3)  # each stage clips its own gradient, the tied matrix apart
    first, last = clipped["s0"].model, clipped["s2"].model
    torch.testing.assert_close(first.transformer.wte.weight, last.lm_head.weight, rtol=0, atol=1e-6)
    unclipped = Recipe(lr=1e-2, clip_norm=0.0)
    alone = train(tied_plan(1, spec, unclipped), spec, tmp_path, steps=3)["s0"].model
    assert torch.equal(alone.transformer.wte.weight, alone.lm_head.weight)
    piped = train(tied_plan(3, spec, unclipped), spec, tmp_path, steps=3)
    last = piped["s2"].model
    # unclipped (clipping is per stage), the pipeline trained the same model as the single stage: same data, same tied updates
    torch.testing.assert_close(last.lm_head.weight, alone.lm_head.weight, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(piped["s1"].model.transformer.h["1"].mlp.c_fc.weight,
                               alone.transformer.h["1"].mlp.c_fc.weight, rtol=1e-4, atol=1e-5)


def test_a_plan_of_another_model_is_refused():
    spec = ModelSpec.from_config(GPT2)
    other = ModelSpec.from_config(GPT2 | {"n_layer": 2})
    hub = MemoryHub()
    transport = MemoryTransport("s0", hub)
    with pytest.raises(ValueError, match=f"plan trains model {spec.name}, and this peer has model {other.name}"):
        StageWorker(tied_plan(1, spec), "s0", transport, None, WorkerConfig(model=other))
    assert isinstance(build_stage(spec, 0, 1), FamilyStage)
