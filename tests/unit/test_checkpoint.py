"""Stage checkpoints: a restored stage trains on exactly as the saved one would, a crash mid-write leaves the
previous checkpoint whole, a checkpoint of another stage or model is refused, and `export` joins stages
into one model (for GPT-2, one that `transformers` loads and that computes what the stages computed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetpeer.peer.checkpoint import CheckpointError, StageCheckpoint, export
from hetpeer.peer.data.corpus import Corpus
from hetpeer.peer.model import build_stage
from hetpeer.peer.pipeline.worker import StageWorker, WorkerConfig
from hetpeer.peer.transport import MemoryHub, MemoryTransport
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.modelspec import ModelSpec, load_model, preset
from hetpeer.protocol.recipe import Recipe
from in_threads import results

SPEC = preset("tiny")
CONFIG = WorkerConfig()
RECIPE = Recipe(lr=1e-2)


def plan_of(stages: int, spec: ModelSpec = SPEC, recipe: Recipe = RECIPE) -> Plan:
    bounds = [round(s * spec.layers / stages) for s in range(stages + 1)]
    return Plan(cost_model="time", model=spec.name, layers=spec.layers, batch=2, micro_batch=1, micro_batches=2, dtype="fp32",
                stages=tuple(StagePlan(s, bounds[s], bounds[s + 1], (f"s{s}",), "none") for s in range(stages)), recipe=recipe)


def workers(plan: Plan, config: WorkerConfig = CONFIG) -> dict[str, StageWorker]:
    hub, corpus, built = MemoryHub(), Corpus.default(), {}
    for device in plan.devices:
        transport = MemoryTransport(device, hub)
        transport.start()
        built[device] = StageWorker(plan, device, transport, corpus if plan.position(device)[0] == 0 else None, config)
    return built


def train(built: dict[str, StageWorker], steps: int) -> None:
    for _ in range(steps):
        results([lambda w=w: w.train_step() for w in built.values()], 60.0)


def test_a_restored_stage_trains_on_as_the_saved_one(tmp_path):
    first = workers(plan_of(2))
    train(first, 3)
    for worker in first.values():
        worker.save(tmp_path)
    second = workers(plan_of(2))
    for device, worker in second.items():
        restored = worker.restore(tmp_path / f"{device}.safetensors")
        assert (restored.step, restored.layers, worker.step, worker.sync.state.step) == (3, worker.layers, 3, 3)
        assert torch.equal(worker.flat.data, first[device].flat.data)
        for mine, theirs in zip(worker.sync.state.tensors(), first[device].sync.state.tensors()):
            assert torch.equal(mine, theirs)
    train(first, 2)
    train(second, 2)
    for device in first:
        assert torch.equal(second[device].flat.data, first[device].flat.data), device


def test_a_checkpoint_records_its_recipe_and_a_resume_under_another_says_what_changed(tmp_path):
    saved = workers(plan_of(1))["s0"]
    saved.save(tmp_path)
    assert StageCheckpoint.read(tmp_path / "s0.safetensors").recipe == RECIPE
    same = workers(plan_of(1))["s0"]
    assert same.recipe_changes(same.restore(tmp_path / "s0.safetensors")) == ""
    other = workers(plan_of(1, recipe=Recipe(lr=2e-3, warmup_steps=10)))["s0"]
    assert other.recipe_changes(other.restore(tmp_path / "s0.safetensors")) == "lr 0.01 -> 0.002; warmup_steps 0 -> 10"


def test_a_plain_adam_checkpoint_resumes_under_accumadam_with_an_empty_window(tmp_path):
    plain = workers(plan_of(1))
    train(plain, 2)
    assert len(plain["s0"].sync.state.tensors()) == 2  # plain Adam keeps no window
    plain["s0"].save(tmp_path)
    accumulating = workers(plan_of(1, recipe=Recipe(lr=1e-2, accumulate=4)))["s0"]
    accumulating.sync.state.window.fill_(7.0)
    accumulating.restore(tmp_path / "s0.safetensors")
    assert torch.equal(accumulating.flat.data, plain["s0"].flat.data)
    assert torch.equal(accumulating.sync.state.window, torch.zeros_like(accumulating.sync.state.window))


def test_a_crash_mid_write_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    worker = workers(plan_of(1))["s0"]
    saved = worker.save(tmp_path)
    before = saved.read_bytes()
    train({"s0": worker}, 1)

    def torn(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise OSError("disk full")

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", torn)
    with pytest.raises(OSError, match="disk full"):
        worker.save(tmp_path)
    assert saved.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [saved.name]  # no temporary file left behind
    assert StageCheckpoint.read(saved).step == 0


def test_a_checkpoint_of_another_stage_or_model_is_refused(tmp_path):
    two = workers(plan_of(2))
    two["s0"].save(tmp_path)
    with pytest.raises(CheckpointError, match="holds layers 0-1, this peer's stage is 2-3"):
        two["s1"].restore(tmp_path / "s0.safetensors")
    other = workers(plan_of(2, preset("tiny", layers=6)))["s0"]
    with pytest.raises(CheckpointError, match=r"a checkpoint of model tiny \(4 layers, .*\), this peer trains tiny \(6 layers"):
        other.restore(tmp_path / "s0.safetensors")  # the same name at another depth: the architecture differs
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match="junk.safetensors is not a safetensors file"):
        StageCheckpoint.read(tmp_path / "junk.safetensors")
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        StageCheckpoint.read(tmp_path / "absent.safetensors")


def test_export_of_our_gpt_loads_back_as_the_preset(tmp_path):
    built = workers(plan_of(2))
    train(built, 2)
    for worker in built.values():
        worker.save(tmp_path / "run")
    done = export(sorted((tmp_path / "run").glob("*.safetensors")), tmp_path / "model")
    assert done["model"] == "tiny" and done["steps"] == [2]
    spec = load_model(str(tmp_path / "model"))
    assert spec == SPEC
    whole = build_stage(spec, 0, spec.layers)
    from hetpeer.peer.model.folder import ModelFolder

    ModelFolder.open(tmp_path / "model", spec).load_into(whole)
    tokens = torch.randint(0, 256, (2, SPEC.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = built["s1"].model(built["s0"].model(tokens))
        torch.testing.assert_close(whole(tokens), expected, rtol=1e-5, atol=1e-6)


def test_export_names_the_parts_no_checkpoint_holds(tmp_path):
    built = workers(plan_of(2))
    built["s0"].save(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint holds layer 2, layer 3, the head of tiny"):
        export([tmp_path / "s0.safetensors"], tmp_path / "model")
    other = workers(plan_of(1, preset("tiny", layers=2)))["s0"]
    other.save(tmp_path / "other")
    with pytest.raises(CheckpointError, match="one model at a time"):
        export([tmp_path / "s0.safetensors", tmp_path / "other" / "s0.safetensors"], tmp_path / "model")


def test_an_exported_gpt2_loads_in_transformers_and_computes_what_the_stages_did(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=3, n_positions=24, vocab_size=256,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "start")
    spec = load_model(str(tmp_path / "start"), seq_len=16)
    built = workers(plan_of(3, spec), WorkerConfig(model=spec, weights=str(tmp_path / "start")))
    train(built, 2)
    for worker in built.values():
        worker.save(tmp_path / "run")
    export(sorted((tmp_path / "run").glob("*.safetensors")), tmp_path / "model")
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "model").eval()
    assert load_model(str(tmp_path / "model")).name == spec.name  # the export is the same model, read back
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        x = tokens
        for device in ("s0", "s1", "s2"):
            x = built[device].model(x)
        torch.testing.assert_close(model(tokens).logits, x, rtol=1e-4, atol=1e-5)
