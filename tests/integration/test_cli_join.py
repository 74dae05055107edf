"""`hetpeer launch` and `hetpeer join` as a user runs them: real processes, their output and exit codes.

Every command runs in a session of its own, so the fixture can find (and, at the end, kill) whatever it
left behind: the launcher's `hetpeer join` peers and their hivemind daemons share its process group.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from p2p_keys import make_keys
from processes import live_processes
from hetpeer.logline import unstamp
from hetpeer.peer.data.corpus import Corpus
from hetpeer.peer.launch import link_key_path
from hetpeer.peer.reach import free_port
from hetpeer.peer.model import build_stage
from hetpeer.protocol.addresses import AddressBook
from hetpeer.protocol.identity import load_or_create_link_key
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.modelspec import preset

ROOT = Path(__file__).resolve().parents[2]
SPEC = preset("tiny")
HANG_GUARD_S = 180  # generous: these commands take seconds; this only stops a hang


def make_plan(lanes: int, *, batch: int = 8, micro_batch: int = 2, dtype: str = "fp32") -> Plan:
    """Two stages of the tiny model, `lanes` lanes; stage s of lane l is device d{s * lanes + l}."""
    stages = tuple(
        StagePlan(index=s, layer_start=2 * s, layer_end=2 * s + 2,
                  devices=tuple(f"d{s * lanes + lane}" for lane in range(lanes)), sync="none")
        for s in range(2)
    )  # fmt: skip
    lane_batch = -(-batch // lanes)
    return Plan(
        cost_model="time", model="tiny", layers=SPEC.layers, batch=batch, micro_batch=micro_batch,
        micro_batches=-(-lane_batch // micro_batch), dtype=dtype, stages=stages,
    )  # fmt: skip


def fixed_book(folder: Path, devices=("d0", "d1")) -> tuple[dict, list[str]]:
    """A hand-written address book of peers on this machine, each with a link key made under `folder`, and the
    options that run d0 with its key."""
    keys = {d: load_or_create_link_key(link_key_path(folder, d)).digest for d in devices}
    book = {"version": 1, "peers": {d: {"direct": f"127.0.0.1:{free_port()}", "key": keys[d]} for d in devices}}
    return book, ["--link-key", str(link_key_path(folder, "d0"))]


def write_json(path: Path, wire) -> Path:
    path.write_text(json.dumps(wire))
    return path


def live_members(group: int) -> list[str]:
    """Command lines of the running processes of a process group."""
    return [f"{pid}: {cmdline}" for pid, pgrp, cmdline in live_processes() if pgrp == group]


class Cli:
    """Runs `python -m hetpeer ...`, each in a new session; kills what is left of them at the end."""

    def __init__(self) -> None:
        self.groups: list[int] = []

    def __call__(self, *args: str, timeout_s: float = HANG_GUARD_S, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        process = subprocess.Popen(
            [sys.executable, "-m", "hetpeer", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )  # fmt: skip
        self.groups.append(process.pid)  # a new session's leader: its pid is the group id
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill(process.pid)
            stdout, stderr = process.communicate()
            pytest.fail(f"hetpeer {' '.join(args)} hung for {timeout_s} s\n{stdout}\n{stderr}")
        return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)

    @staticmethod
    def kill(group: int) -> None:
        if live_members(group):
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def cleanup(self) -> None:
        for group in self.groups:
            self.kill(group)


@pytest.fixture
def cli():
    runner = Cli()
    yield runner
    runner.cleanup()


def lane_loss(plan: Plan, lane: int) -> float:
    """The untrained model's mean loss on a lane's batch of step 0: what that lane's first step reports."""
    model = build_stage(SPEC, 0, SPEC.layers)
    batch = Corpus.default().batch(plan.lane_offset(lane), plan.lane_sequences(lane), SPEC.seq_len, seed=0)  # its slice
    with torch.no_grad():
        return model.loss(model(torch.from_numpy(batch.tokens)), torch.from_numpy(batch.labels)).item()


# -- hetpeer launch ----------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("shares", [(), (6, 2)], ids=["even", "lanes-of-unlike-shares"])
def test_launch_runs_every_peer_to_the_end(tmp_path, cli, shares):
    plan = make_plan(lanes=2)  # stage 0: d0 d1, stage 1: d2 d3
    if shares:  # lane 0 takes 6 of the 8 sequences in 3 micro-batches, lane 1 the other 2 in one
        plan = dataclasses.replace(plan, lane_batches=shares, micro_batches=3)
    plan_path = write_json(tmp_path / "plan.json", plan.to_wire())
    out = tmp_path / "run"
    done = cli("launch", str(plan_path), "--steps", "3", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    lines = [unstamp(line) for line in done.stdout.splitlines()]
    assert re.search(r"\b(all 4 peers|4 peer\(s\)) finished 3 step", lines[-1]), lines[-1]

    for lane, device in enumerate(("d2", "d3")):  # the last stage reports the loss of its lane
        losses = []
        for step in (1, 2, 3):
            found = [re.match(rf"\[{device}\] step {step}/3\s+loss (\d+\.\d+)", line) for line in lines]
            found = [m for m in found if m]
            assert len(found) == 1, (device, step, done.stdout)
            losses.append(float(found[0].group(1)))
        assert all(math.isfinite(loss) for loss in losses)
        # step 1 runs the untrained model on the lane's own data: the printed loss is that loss, to 4 places
        assert losses[0] == pytest.approx(lane_loss(plan, lane), abs=1e-4)
    for device in ("d0", "d1"):
        for step in (1, 2, 3):
            assert any(re.match(rf"\[{device}\] step {step}/3\s+loss -", line) for line in lines), (device, step, done.stdout)

    book = AddressBook.load(out / "addresses.json")
    assert sorted(book.peers) == ["d0", "d1", "d2", "d3"]
    for device in plan.devices:
        log = (out / f"{device}.log").read_text()
        assert "step 3/3" in log, (device, log)
    assert live_members(cli.groups[-1]) == []


@pytest.mark.slow
def test_launch_runs_groups_with_outer_steps_that_end_each_window_on_equal_weights(tmp_path, cli):
    from dataclasses import replace

    from hetpeer.peer.checkpoint import StageCheckpoint

    plan = make_plan(lanes=2)
    plan = replace(plan, stages=tuple(replace(s, sync="outer", outer_every=3) for s in plan.stages))
    plan_path = write_json(tmp_path / "plan.json", plan.to_wire())
    done = cli("launch", str(plan_path), "--steps", "6", "--out", str(tmp_path / "run"), "--link", "tcp",
               "--save", str(tmp_path / "saved"), "--set", "outer_lr=0.5", "--set", "outer_momentum=0.5", "--set", "outer_after=0")
    assert done.returncode == 0, done.stdout + done.stderr
    saved = {d: StageCheckpoint.read(tmp_path / "saved" / f"{d}.safetensors").tensors() for d in plan.devices}
    for a, b in (("d0", "d1"), ("d2", "d3")):  # each group's members, after their second outer step
        weights = [name for name in saved[a] if not name.startswith("optimizer.")]
        assert all(torch.equal(saved[a][name], saved[b][name]) for name in weights), (a, b)
        assert torch.equal(saved[a]["optimizer.anchor"], saved[b]["optimizer.anchor"])
        assert torch.count_nonzero(saved[a]["optimizer.outer_momentum"]) > 0
        assert not torch.equal(saved[a]["optimizer.m"], saved[b]["optimizer.m"])  # Adam's moments stay each peer's own


# Imports of these packages fail: what a machine without hivemind (a GPU image, say) gives `hetpeer launch --link tcp`.
WITHOUT_HIVEMIND = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("hivemind", "pydantic", "grpc", "multiaddr"):
            raise ImportError(f"{name} is not installed here")
sys.meta_path.insert(0, Refuse())
"""


@pytest.mark.slow
def test_launch_over_tcp_needs_no_hivemind_and_says_where_each_peer_trains(tmp_path, cli):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(WITHOUT_HIVEMIND)
    plan_path = write_json(tmp_path / "plan.json", make_plan(lanes=2, dtype="bf16").to_wire())
    out = tmp_path / "run"
    done = cli("launch", str(plan_path), "--steps", "2", "--out", str(out), "--link", "tcp", "--recompute",
               "--compress", "int4/int8", env={"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)])})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "activations travel in int4, their gradients in int8" in done.stdout
    ran = Plan.from_wire(json.loads((out / "plan.json").read_text()))  # what the peers ran: the plan with its codecs
    assert [(s.forward, s.backward) for s in ran.stages] == [(("int4", "int4"), ("int8", "int8")), ((), ())]
    for device in ("d0", "d1", "d2", "d3"):
        lines = [unstamp(line) for line in (out / f"{device}.log").read_text().splitlines()]
        cuda = torch.cuda.is_available()
        chosen = next(line for line in lines if line.startswith("device: "))
        assert chosen.startswith("device: cuda:" if cuda else "device: cpu ("), chosen
        assert any(re.search(r"on (cuda:\d|cpu), .*recomputing 2 of its 2 layers", line) for line in lines), lines
        sent = next(line for line in lines if line.startswith("routes: "))
        assert re.search(r"frames sent: \d+ encoded on " + ("cuda" if cuda else "cpu"), sent), sent
    assert live_members(cli.groups[-1]) == []


@pytest.mark.slow
def test_launch_stops_everyone_when_a_peer_fails(tmp_path, cli):
    plan_path = write_json(tmp_path / "plan.json", make_plan(lanes=1).to_wire())  # d0 -> d1
    empty = tmp_path / "no-text"
    empty.mkdir()
    out = tmp_path / "run"
    done = cli("launch", str(plan_path), "--steps", "3", "--out", str(out), "--data", str(empty))
    assert done.returncode not in (0, None), done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert re.search(r"peer d0 failed \(exit 2\)", done.stdout), done.stdout
    assert re.search(r"\[d0\] hetpeer join: error: corpus path .*no-text.* holds no UTF-8 text files", done.stdout)
    assert "holds no UTF-8 text files" in (out / "d0.log").read_text()
    assert live_members(cli.groups[-1]) == []  # d1 and the hivemind daemons are gone too


# -- hetpeer join: bad input is one line and exit code 2 ------------------------------------------------------


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Two P2P keys and their peer ids."""
    return make_keys(tmp_path_factory.mktemp("keys"), ("mine", "other"))


def join_case(case: str, tmp_path: Path, keys) -> tuple[list[str], list[str]]:
    """(arguments of `hetpeer join`, words its error line must hold)."""
    plan = make_plan(lanes=1, batch=4, micro_batch=2)
    book, extra = fixed_book(tmp_path)
    plan_path = tmp_path / "plan.json"
    book_path = tmp_path / "addresses.json"
    device, words = "d0", []
    if case == "device not in the plan":
        device, words = "d7", ["'d7'", "holds no stage"]
    elif case == "device not in the address book":
        del book["peers"]["d0"]
        words = ["no address for peer 'd0'"]
    elif case == "key of another peer":
        (mine, mine_id), (_, other_id) = keys["mine"], keys["other"]
        book["peers"]["d0"]["p2p"] = [f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{other_id}"]
        extra, words = [*extra, "--identity", mine], [mine, mine_id, other_id]
    elif case == "plan is not JSON":
        plan_path.write_text('{"version": 1, "stages": [')
        words = [str(plan_path), "not valid JSON"]
    elif case == "fp16 plan":
        plan = make_plan(lanes=1, batch=4, micro_batch=2, dtype="fp16")
        words = ["fp16", "bf16 or fp32"]
    elif case == "bad --listen":
        extra, words = [*extra, "--listen", "localhost"], ["--listen", "HOST:PORT", "'localhost'"]
    elif case == "bad address book entry":
        book["peers"]["d1"]["direct"] = "127.0.0.1"
        words = ["addresses.peers.d1.direct", "HOST:PORT", "'127.0.0.1'"]
    elif case == "not a device":
        extra, words = [*extra, "--device", "gpu"], ["--device", "auto, cpu, cuda or cuda:N", "'gpu'"]
    elif case == "a training option, which is the plan's":
        extra, words = [*extra, "--lr", "1e-3"], ["--lr is the organizer's", "--set lr=VALUE"]
    elif case == "a codec this peer does not know":  # a plan from a newer hetpeer
        raw = plan.to_wire()
        raw["stages"][0]["forward"] = ["int3"]
        plan_path.write_text(json.dumps(raw))
        words = ["plan.stages[0].forward[0]", "'int3' is not one this peer knows", "newer hetpeer"]
    elif case == "a GPU this machine lacks":  # no CUDA at all, or fewer than 100 GPUs: both say so
        extra, words = [*extra, "--device", "cuda:99"], ["--device cuda:99"]
    elif case == "a book without link keys":
        del book["peers"]["d1"]["key"]
        words = ["addresses.peers.d1.key", "missing", "hetpeer key FILE"]
    elif case == "a link key that is not hex":
        book["peers"]["d1"]["key"] = "sha256:" + "0" * 57
        words = ["addresses.peers.d1.key", "64 lowercase hex digits"]
    elif case == "another peer's link key":
        extra, words = ["--link-key", str(link_key_path(tmp_path, "d1"))], [
            str(link_key_path(tmp_path, "d1")), book["peers"]["d1"]["key"], book["peers"]["d0"]["key"], "the book says d0's"]
    elif case == "a link key file that is not a key":
        (tmp_path / "not-a-key").write_text("hello")
        extra, words = ["--link-key", str(tmp_path / "not-a-key")], ["not-a-key", "not an RSA private key"]
    else:
        raise AssertionError(case)
    if not plan_path.exists():
        write_json(plan_path, plan.to_wire())
    write_json(book_path, book)
    args = ["join", "--plan", str(plan_path), "--as", device, "--peers", str(book_path), "--steps", "1", *extra]
    return args, words


JOIN_CASES = ["device not in the plan", "device not in the address book", "key of another peer", "plan is not JSON",
              "fp16 plan", "bad --listen", "bad address book entry", "not a device", "a GPU this machine lacks",
              "a training option, which is the plan's", "a codec this peer does not know", "a book without link keys",
              "a link key that is not hex", "another peer's link key", "a link key file that is not a key"]  # fmt: skip


@pytest.mark.parametrize("case", JOIN_CASES)
def test_join_bad_input_is_one_line_and_exit_2(case, tmp_path, cli, keys):
    args, words = join_case(case, tmp_path, keys)
    done = cli(*args, timeout_s=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("hetpeer join: error: "), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert live_members(cli.groups[-1]) == []


# -- a GPT-2 model folder --------------------------------------------------------------------------------


@pytest.fixture
def gpt2_folder(tmp_path) -> Path:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=2, n_positions=32, vocab_size=320,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    folder = tmp_path / "tiny-gpt2"
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizers = pytest.importorskip("tokenizers")  # a BPE tokenizer of 300 tokens, trained here, in the folder
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(DOCUMENTS, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


DOCUMENTS = [f"def step_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200)]


@pytest.mark.slow
def test_launch_trains_a_model_folder_across_two_stages(tmp_path, cli, gpt2_folder):
    """`hetpeer plan --model FOLDER --seq-len 16` then `hetpeer launch --model FOLDER` (the plan's sequence
    length taken from the plan): each peer reads its stage's tensors, the tied head's two copies train across
    the lane, the first loss is the folder's model's own."""
    topology = write_json(tmp_path / "two.json", {"devices": [{"id": f"p{i}", "region": "r", "tflops": 1.0} for i in range(2)],
                                                   "regions": {"r": {"latency_ms": 0.1, "bandwidth_gbps": 10}}})
    planned = cli("plan", str(topology), "--model", str(gpt2_folder), "--seq-len", "16", "--batch", "4", "--micro-batch", "2",
                  "--dtype", "fp32", "--stages", "2", "--group-size", "1", "--json", "--quiet")
    assert planned.returncode == 0, planned.stderr
    plan_path = write_json(tmp_path / "plan.json", json.loads(planned.stdout))
    assert json.loads(planned.stdout)["seq_len"] == 16
    other = cli("launch", str(plan_path), "--model", str(gpt2_folder), "--seq-len", "32", "--steps", "1", timeout_s=60)
    assert other.returncode == 2 and "was made for sequences of 16 tokens, not --seq-len 32" in other.stderr, other.stderr
    saved = tmp_path / "checkpoints"
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS))
    done = cli("launch", str(plan_path), "--model", str(gpt2_folder), "--steps", "3", "--set", "lr=1e-2", "--out", str(tmp_path / "run"),
               "--save", str(saved), "--data", str(data))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [unstamp(line) for line in done.stdout.splitlines()]
    assert sum(bool(re.match(r"\[p\d\] weights: 0\.\d MiB of this stage's tensors read from ", line)) for line in lines) == 2
    assert any(re.match(r"\[p0\] data: \d+ tokens \(vocabulary 300\) from 1 files under ", line) for line in lines), lines
    losses = [float(m.group(1)) for line in lines if (m := re.match(r"\[p1\] step \d/3\s+loss (\d+\.\d+)", line))]
    assert len(losses) == 3 and losses[-1] < losses[0]
    # step 1 is the saved model's own loss on lane 0's batch (transformers computes it from the same weights)
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(gpt2_folder).eval()
    from hetpeer.peer.data.corpus import load_tokenizer  # the folder's tokenizer, taken by default

    corpus = Corpus.from_folder(data, tokenizer=load_tokenizer(gpt2_folder / "tokenizer.json"))
    batch = corpus.batch(position=0, sequences=4, seq_len=16, seed=0)  # lane 0 of step 0: the first windows
    with torch.no_grad():
        logits = model(torch.from_numpy(batch.tokens)).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.from_numpy(batch.labels).flatten()).item()
    assert losses[0] == pytest.approx(expected, abs=1e-4)

    # the two stage checkpoints join into one model that transformers loads, trained 3 steps on from the folder's
    exported = cli("export", str(saved), "--out", str(tmp_path / "trained"))
    assert exported.returncode == 0, exported.stderr
    assert re.match(r"exported gpt2-[0-9a-f]{12}: \d+ tensors from 2 checkpoint\(s\) \(steps 3\) to ", exported.stdout)
    trained = GPT2LMHeadModel.from_pretrained(tmp_path / "trained").eval()
    with torch.no_grad():
        moved = [(a - b).abs().max().item() for a, b in zip(trained.parameters(), model.parameters())]
    assert min(moved) > 0  # every tensor trained, none left at the folder's values
    lonely = cli("export", str(saved / "p0.safetensors"), "--out", str(tmp_path / "half"), timeout_s=60)
    assert lonely.returncode == 2 and lonely.stderr.startswith("hetpeer export: error: no checkpoint holds layer 1, the head")


def test_launch_refuses_a_model_folder_plan_without_its_folder(tmp_path, cli, gpt2_folder):
    plan = make_plan(lanes=1)
    wire = plan.to_wire() | {"model": "gpt2-0123456789ab", "layers": 2}
    wire["stages"] = [dict(wire["stages"][0], layer_end=1), dict(wire["stages"][1], layer_start=1, layer_end=2)]
    plan_path = write_json(tmp_path / "plan.json", wire)
    for extra, words in (([], ["gpt2-0123456789ab", "give --model"]),
                         (["--model", str(gpt2_folder)], ["gpt2-0123456789ab", "another config"])):
        done = cli("launch", str(plan_path), "--steps", "1", *extra, timeout_s=60)
        assert done.returncode == 2, (done.stdout, done.stderr)
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("hetpeer launch: error: "), done.stderr
        assert all(word in lines[0] for word in words), lines[0]


def test_join_refuses_a_tokenizer_or_data_that_does_not_fit(tmp_path, cli, gpt2_folder):
    plan_path = write_json(tmp_path / "plan.json", make_plan(lanes=1, batch=4).to_wire())
    book, key = fixed_book(tmp_path)
    book_path = write_json(tmp_path / "book.json", book)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\nnot json\n')
    common = ["join", "--plan", str(plan_path), "--as", "d0", "--peers", str(book_path), "--link", "tcp", "--steps", "1", *key]
    for extra, words in ((["--tokenizer", str(gpt2_folder / "tokenizer.json")], ["has 300 tokens", "model tiny (256)"]),
                         (["--data", str(broken)], ["broken.jsonl:2", "not a JSON object"])):
        done = cli(*common, *extra, timeout_s=60)
        assert done.returncode == 2, (done.stdout, done.stderr)
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("hetpeer join: error: "), done.stderr
        assert all(word in lines[0] for word in words), lines[0]


def test_join_refuses_to_resume_from_a_checkpoint_of_another_model(tmp_path, cli):
    from hetpeer.peer.checkpoint import save_stage

    other = preset("tiny", layers=6)
    stage = build_stage(other, 0, 3)
    moments = {name: torch.zeros(sum(p.numel() for p in stage.parameters())) for name in ("m", "v", "window")}
    save_stage(tmp_path / "saved" / "d0.safetensors", stage, moments, spec=other, layers=(0, 3), step=5, epoch=1, adam_step=5)
    plan_path = write_json(tmp_path / "plan.json", make_plan(lanes=1, batch=4).to_wire())
    book, key = fixed_book(tmp_path)
    done = cli("join", "--plan", str(plan_path), "--as", "d0", "--peers", str(write_json(tmp_path / "book.json", book)),
               "--link", "tcp", "--steps", "1", "--resume", str(tmp_path / "saved"), *key, timeout_s=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetpeer join: error: "), done.stderr
    assert "is a checkpoint of model tiny (6 layers" in lines[0] and "this peer trains tiny (4 layers" in lines[0], lines[0]
    assert live_members(cli.groups[-1]) == []


def test_key_makes_a_link_key_once_and_prints_its_digest(tmp_path, cli):
    path = tmp_path / "keys" / "link.key"
    made = cli("key", str(path), timeout_s=60)
    assert made.returncode == 0, made.stderr
    assert made.stderr.strip() == f"made a new link key in {path}"
    assert made.stdout == f"{load_or_create_link_key(path).digest}  {path}\n"
    assert path.stat().st_mode & 0o777 == 0o600
    again = cli("key", str(path), timeout_s=60)
    assert (again.returncode, again.stdout, again.stderr) == (0, made.stdout, ""), "the same key, not a new one"
    (tmp_path / "not-a-key").write_bytes(b"\x00" * 64)
    refused = cli("key", str(tmp_path / "not-a-key"), timeout_s=60)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.startswith("hetpeer key: error: ") and "is not an RSA private key in DER form" in refused.stderr
