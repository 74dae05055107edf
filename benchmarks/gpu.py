"""On a GPU: the CUDA paths as a peer runs them, in one short run. Without one: its CPU parts, at small sizes.

    python3 benchmarks/gpu.py [--json] [--parts abcd] [--small] [--out DIR]

Run from a checkout (hetpeer is imported from it; no hivemind needed). With CUDA it takes about 4 minutes
on one H100; `--small` takes the CPU's sizes on any device (a smoke run). Parts:

(a) step: one peer's training step against a plain PyTorch loop (`training.Plain`: the same module and
    batches, torch's fused AdamW, bf16 autocast) for GPT-2 124M (from a config folder) and a Llama of about
    300M: ms/step, tokens/s, model FLOPs utilisation (the planner's FLOPs over the chip's dense bf16 peak).
    The two alternate in rounds; each figure is the median round. Goal: hetpeer within 5% of the plain loop.
(b) launch: `hetpeer launch` of a 2-stage x 2-lane bf16 plan of a small GPT-2 (4 processes on 127.0.0.1,
    `--link tcp`), on the GPU (`--device auto`) and on the CPU, and the same plan in fp32 on the CPU. Goals:
    it trains, every peer encodes its frames on the GPU, and the GPU's losses differ from the CPU's no more
    than three times as much as bf16's own rounding moves them (the CPU's bf16 run against its fp32 run), or
    bf16's relative precision (2^-8) of the loss.
(c) for each model of (a): the compute probe a joining peer announces (one block, forward and backward, in
    bf16) against the TFLOPS the step then achieves (goal: within 15%), and with the rest of the step it times
    (`peer/pipeline/steptime.py`: embedding, head and loss, Python, Adam) composed as the planner's time model
    composes the step, against the step measured (goal: within 15%); the free memory it announces and the
    planner's count of the stage (`Workload.stage_memory`) against `torch.cuda.max_memory_allocated` (goal:
    count >= measured, within 15%); the same with every block recomputed: memory saved and time added (goal:
    at most 35% slower for a stage that then fits in half the memory).
(d) codecs on the GPU: encode (on the GPU, out through pinned memory) and decode (on the receiving CPU, then
    onto the GPU) of 64 MB of fp32 activations in each codec, GB/s, beside the same on the CPU.

It prints a short table and, with --json, one JSON object as its last line. A part that fails is reported
and the rest still run. On a machine without CUDA it says so in one line, runs (a), (c) and (d) on the CPU
at small sizes and (b)'s CPU runs, and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: the plain loop of training.py
from training import Plain, hetpeer_worker  # noqa: E402

from hetpeer.logline import unstamp  # noqa: E402
from hetpeer.peer.data.corpus import Corpus  # noqa: E402
from hetpeer.peer.node import stage_memory  # noqa: E402
from hetpeer.peer.pipeline.steptime import step_costs  # noqa: E402
from hetpeer.peer.probe import TensorPeak, time_per_call, block_tflops, free_memory_bytes  # noqa: E402
from hetpeer.peer.transport.codec import checksum, decode, encode  # noqa: E402
from hetpeer.protocol.frame import CODECS, FrameHeader  # noqa: E402
from hetpeer.protocol.modelspec import ModelSpec
from hetpeer.protocol.modelspec import load_model  # noqa: E402
from hetpeer.protocol.workload import Workload  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEP_GOAL = 1.05  # hetpeer's step at most this many times the plain loop's
PROBE_GOAL = 0.15  # announced TFLOPS within this share of what the step achieves
MEMORY_GOAL = 0.15  # the planner's count at least what was measured, and within this share above it
RECOMPUTE_GOAL = 1.35  # with every block recomputed: at most this many times slower ...
RECOMPUTE_FITS = 0.5  # ... for a stage that then fits in this share of the memory
LAUNCH_GAP = 3  # the GPU's losses as far from the CPU's as this many times bf16's own rounding moves them, at most
# Dense bf16 tensor-core peaks from NVIDIA's datasheets (without sparsity), by a word of the device name.
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100 PCIe": 756.5, "H100 NVL": 835.5, "H100": 989.4, "A100": 312.0,
                    "L40S": 362.1, "L4": 121.0, "RTX 4090": 165.2, "RTX 3090": 71.0}
GPT2_124M = {"model_type": "gpt2"}  # transformers' defaults: 768 wide, 12 layers, 12 heads, 1024 positions, 50257 tokens
LLAMA_300M = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
              "num_key_value_heads": 8, "num_hidden_layers": 20, "max_position_embeddings": 1024, "vocab_size": 32000,
              "tie_word_embeddings": False}
LAUNCH_MODEL = {"model_type": "gpt2", "n_embd": 256, "n_head": 4, "n_layer": 4, "n_positions": 256, "vocab_size": 8192}
SMALL_GPT2 = {"model_type": "gpt2", "n_embd": 128, "n_head": 4, "n_layer": 2, "n_positions": 64, "vocab_size": 2048}
SMALL_LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 4,
               "num_key_value_heads": 2, "num_hidden_layers": 2, "max_position_embeddings": 64, "vocab_size": 2048,
               "tie_word_embeddings": False}
LOSS_RE = re.compile(r"^step (\d+)/\d+\s+loss (\d+\.\d+)")
ENCODED_RE = re.compile(r"frames sent: (.*)$")


@dataclass(frozen=True, slots=True)
class Sizes:
    models: dict[str, dict]
    batch: int  # sequences a step
    micro_batch: int
    warmup: int  # steps before timing
    steps: int  # timed steps a round
    rounds: int
    launch_steps: int
    launch_model: dict
    codec_mb: int  # megabytes of fp32 activations the codecs move
    probe_s: float


# micro-batches of 16 sequences: large enough that recomputation can halve a stage's memory (a Llama's activations
# outweigh its training state and logits there)
GPU_SIZES = Sizes({"GPT-2 124M": GPT2_124M, "Llama 300M": LLAMA_300M}, batch=32, micro_batch=16, warmup=3, steps=8, rounds=3,
                  launch_steps=30, launch_model=LAUNCH_MODEL, codec_mb=64, probe_s=1.5)
SMALL_SIZES = Sizes({"GPT-2 (small)": SMALL_GPT2, "Llama (small)": SMALL_LLAMA}, batch=4, micro_batch=2, warmup=1, steps=2,
                    rounds=2, launch_steps=4, launch_model=SMALL_GPT2, codec_mb=4, probe_s=0.2)


def say(line: str) -> None:
    print(line, flush=True)


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def peak_tflops(name: str | None) -> tuple[float | None, str]:
    """The dense bf16 peak of the GPU `name` and where it comes from: the datasheet, else None (the CPU, a GPU not in
    the table)."""
    if name is None:
        return None, "no bf16 peak for a CPU"
    for word, tflops in PEAK_BF16_TFLOPS.items():
        if word in name:
            return tflops, f"{name}: {tflops:g} TFLOPS dense bf16 (datasheet)"
    return None, f"{name}: bf16 peak unknown"


def workspace_bytes(device: str) -> int:
    """What a process holds on the GPU once it has run a bf16 product forward and backward, beyond its tensors:
    the CUDA libraries' workspaces, which the allocator counts in `max_memory_allocated` (0 on the CPU)."""
    if torch.device(device).type != "cuda":
        return 0
    a = torch.randn(256, 256, device=device, requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        (a @ a).float().sum().backward()
    sync(device)
    tensors = sum(t.numel() * t.element_size() for t in (a, a.grad))
    held = torch.cuda.memory_allocated(device) - tensors
    del a
    return held


def spec_of(folder: Path, config: dict) -> ModelSpec:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return load_model(str(folder))


def timed_rounds(systems: dict, sizes: Sizes, device: str) -> dict[str, float]:
    """Median seconds per step of each system, over rounds that alternate between them (after warm-up)."""
    for step in systems.values():
        for _ in range(sizes.warmup):
            step()
    sync(device)
    per_round: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(sizes.rounds):
        for name, step in systems.items():
            sync(device)
            started = time.perf_counter()
            for _ in range(sizes.steps):
                step()
            sync(device)
            per_round[name].append((time.perf_counter() - started) / sizes.steps)
    return {name: statistics.median(times) for name, times in per_round.items()}


def measured_peak(worker, steps: int, device: str) -> tuple[int, float]:
    """(peak bytes of `steps` steps, seconds a step): `torch.cuda.max_memory_allocated` on a GPU, the worker's
    state and `TensorPeak` on the CPU."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        started = time.perf_counter()
        for _ in range(steps):
            worker.train_step()
        sync(device)
        return torch.cuda.max_memory_allocated(device), (time.perf_counter() - started) / steps
    held = sum(t.numel() * t.element_size() for t in worker.sync.state_tensors()) + worker.flat.grad.numel() * 4
    with TensorPeak() as peak:
        started = time.perf_counter()
        for _ in range(steps):
            worker.train_step()
        seconds = (time.perf_counter() - started) / steps
    return held + peak.peak_bytes, seconds


def goals(found: dict, announced: int) -> dict[str, bool | None]:
    """Each goal of (a) and (c): met (True), missed (False), or not applicable (None)."""
    memory = found["memory"]
    halved = memory["recompute_memory_share"] <= RECOMPUTE_FITS
    return {
        "step": found["step"]["ratio"] <= STEP_GOAL,
        "probe": abs(found["probe"]["ratio"] - 1) <= PROBE_GOAL,
        "whole_step": abs(found["probe"]["measured_over_composed"] - 1) <= PROBE_GOAL,
        "memory": all(1 <= memory[k]["ratio"] <= 1 + MEMORY_GOAL for k in ("kept", "recomputed")),
        "fits_announced": memory["kept"]["measured_bytes"] <= announced,
        "recompute": memory["recompute_slowdown"] <= RECOMPUTE_GOAL if halved else None,
    }


def model_part(label: str, spec: ModelSpec, sizes: Sizes, device: str, corpus: Corpus, peak: float | None,
               announced: int) -> dict:
    """(a) and (c) for one model."""
    tokens = sizes.batch * spec.seq_len
    flops = Workload(spec, batch=sizes.batch).stage_flops(spec.layers, last=True, sequences=sizes.batch)  # the whole model
    found: dict = {"params": spec.params, "seq_len": spec.seq_len, "batch": sizes.batch, "micro_batch": sizes.micro_batch}
    plain = Plain(spec, corpus, sizes.batch, sizes.micro_batch, device=device, dtype="bf16")
    worker = hetpeer_worker(spec, corpus, sizes.batch, sizes.micro_batch, device=device, dtype="bf16")
    median = timed_rounds({"plain": plain.train_step, "hetpeer": worker.train_step}, sizes, device)
    step = {name: {"ms": s * 1e3, "tokens_per_s": tokens / s, "tflops": flops / s / 1e12,
                   "mfu": flops / s / 1e12 / peak if peak else None} for name, s in median.items()}
    found["step"] = {**step, "ratio": median["hetpeer"] / median["plain"], "goal": STEP_GOAL}
    say(f"  (a) {label}: plain {step['plain']['ms']:.1f} ms/step, hetpeer {step['hetpeer']['ms']:.1f} ms/step "
        f"({median['hetpeer'] / median['plain']:.3f}x, goal <= {STEP_GOAL}); {step['hetpeer']['tokens_per_s']:,.0f} tokens/s"
        + (f", MFU {step['hetpeer']['mfu']:.1%}" if peak else ""))
    del plain
    # (c) memory, kept and recomputed, against the planner's count
    memory = {}
    for recompute in (0, spec.layers):
        worker.model.recompute = worker.recompute = recompute
        measured, seconds = measured_peak(worker, max(2, sizes.steps // 2), device)
        counted = stage_memory(worker)
        memory["recomputed" if recompute else "kept"] = {
            "measured_bytes": measured, "counted_bytes": sum(counted.values()), "ratio": sum(counted.values()) / measured,
            "parts": counted, "step_s": seconds}
    worker.model.recompute = worker.recompute = 0
    kept, recomputed = memory["kept"], memory["recomputed"]
    memory["recompute_slowdown"] = recomputed["step_s"] / kept["step_s"]
    memory["recompute_memory_share"] = recomputed["measured_bytes"] / kept["measured_bytes"]
    found["memory"] = memory
    say(f"  (c) {label}: memory measured {kept['measured_bytes'] / 2**30:.2f} GiB, counted {kept['counted_bytes'] / 2**30:.2f} "
        f"({kept['ratio']:.3f}); recomputed: measured {recomputed['measured_bytes'] / 2**30:.2f}, counted "
        f"{recomputed['counted_bytes'] / 2**30:.2f} ({recomputed['ratio']:.3f}), {memory['recompute_memory_share']:.2f} of "
        f"the memory for {memory['recompute_slowdown']:.2f}x the time")
    # (c) the probe a peer announces, against what the step achieves; and the parts of a step, timed alone
    probe = block_tflops(spec, sizes.micro_batch, device, sizes.probe_s, dtype="bf16", best=True)
    achieved = flops / median["hetpeer"] / 1e12
    found["probe"] = {"announced_tflops": probe, "achieved_tflops": achieved, "ratio": probe / achieved,
                      "goal": PROBE_GOAL, **step_parts(spec, sizes, device, probe)}
    found["probe"]["measured_over_composed"] = median["hetpeer"] * 1e3 / found["probe"]["composed_ms"]
    say(f"  (c) {label}: probe {probe:.1f} TFLOPS announced, the step achieves {achieved:.1f} ({probe / achieved:.3f}x); "
        f"a peer's step probe: block {found['probe']['block_ms']:.2f} ms, embedding {found['probe']['embed_ms']:.2f}, head "
        f"and loss {found['probe']['head_ms']:.2f}, Python {found['probe']['python_ms']:.2f} a micro-batch, Adam "
        f"{found['probe']['adam_ms']:.2f} ms: {found['probe']['composed_ms']:.1f} ms composed, {median['hetpeer'] * 1e3:.1f} ms "
        f"measured ({found['probe']['measured_over_composed']:.3f}x, goal within {PROBE_GOAL:.0%})")
    found["goals"] = goals(found, announced)
    del worker
    gc.collect()
    return found


def step_parts(spec: ModelSpec, sizes: Sizes, device: str, probe_tflops: float) -> dict:
    """A step's parts as a joining peer times them (`peer/pipeline/steptime.py`): a block's forward and backward
    for a micro-batch (from the probe), the embedding, the head and loss, the worker's Python per micro-batch and
    the optimizer; and the whole model's one-stage step they compose, as the planner's time model composes it."""
    w = Workload(spec, batch=sizes.batch, micro_batch=sizes.micro_batch)
    block = 3 * sizes.micro_batch * w.layer_fwd_flops_per_seq / (probe_tflops * 1e12)
    costs = step_costs(spec, sizes.micro_batch, device, sizes.probe_s / 4, dtype="bf16")
    embed, head = sizes.micro_batch * costs.embed_s_per_seq, sizes.micro_batch * costs.head_s_per_seq
    adam = costs.update_s_per_param * spec.params
    composed = sizes.batch // sizes.micro_batch * (spec.layers * block + embed + head + costs.micro_s) + adam
    return {"block_ms": block * 1e3, "embed_ms": embed * 1e3, "head_ms": head * 1e3, "python_ms": costs.micro_s * 1e3,
            "adam_ms": adam * 1e3, "composed_ms": composed * 1e3}


def launch_part(out: Path, sizes: Sizes, cuda: bool) -> dict:
    """(b): the same 2 x 2 plan launched on the GPU and on the CPU in bf16, and on the CPU in fp32."""
    folder = out / "launch-model"
    spec = spec_of(folder, sizes.launch_model)
    topology = out / "four.json"
    topology.write_text(json.dumps({"devices": [{"id": f"p{i}", "region": "r", "tflops": 1.0} for i in range(4)],
                                    "regions": {"r": {"latency_ms": 0.1, "bandwidth_gbps": 10}}}))
    runs = {"gpu bf16": ("bf16", "auto"), "cpu bf16": ("bf16", "cpu"), "cpu fp32": ("fp32", "cpu")}
    if not cuda:
        del runs["gpu bf16"]
    found: dict = {"model_params": spec.params, "steps": sizes.launch_steps}
    for name, (dtype, device) in runs.items():
        plan = out / f"plan-{dtype}.json"
        if not plan.exists():
            plan.write_text(hetpeer("plan", str(topology), "--model", str(folder), "--batch", "16", "--micro-batch", "2",
                                    "--dtype", dtype, "--stages", "2", "--group-size", "2", "--sync", "allreduce", "--json",
                                    "--quiet", "--time-budget", "0.5"))
        run = out / f"run-{name.replace(' ', '-')}"
        started = time.perf_counter()
        hetpeer("launch", str(plan), "--model", str(folder), "--steps", str(sizes.launch_steps), "--set", "lr=1e-3",
                "--link", "tcp", "--device", device, "--out", str(run))
        found[name] = {"seconds": time.perf_counter() - started, **read_run(run, json.loads(plan.read_text()))}
        say(f"  (b) {name}: {sizes.launch_steps} steps in {found[name]['seconds']:.1f} s, loss {found[name]['losses'][0]:.4f} "
            f"-> {found[name]['losses'][-1]:.4f}; devices: {', '.join(sorted(set(found[name]['devices'])))}; "
            f"frames encoded on {found[name]['encoded_on']}")
    # what bf16 explains: three times the gap its rounding alone opens (the CPU's bf16 run against its fp32 run), and
    # at least bf16's relative precision (2^-8) of the loss
    bf16_rounding = mean_gap(found["cpu bf16"]["losses"], found["cpu fp32"]["losses"])
    allowed = max(LAUNCH_GAP * bf16_rounding, 2**-8 * statistics.mean(found["cpu bf16"]["losses"]))
    found.update(bf16_vs_fp32_cpu=bf16_rounding, allowed_gap=allowed)
    if cuda:
        gap = mean_gap(found["gpu bf16"]["losses"], found["cpu bf16"]["losses"])
        gpu = found["gpu bf16"]
        found["gpu_vs_cpu"] = gap
        found["ok"] = (gap <= allowed and gpu["losses"][-1] < gpu["losses"][0]
                       and set(gpu["encoded_on"]) == {"cuda"} and all(d.startswith("cuda") for d in gpu["devices"]))
        say(f"  (b) mean |loss gap| GPU bf16 vs CPU bf16 {gap:.5f}, CPU bf16 vs CPU fp32 {bf16_rounding:.5f} (allowed "
            f"{allowed:.5f}): " + ("agree" if gap <= allowed else "DISAGREE beyond what bf16 explains"))
    return found


def read_run(run: Path, plan: dict) -> dict:
    """Per step, the mean loss over the lanes; each peer's device and where its frames were encoded."""
    losses: dict[int, list[float]] = {}
    devices, encoded = [], {}
    for stage in plan["stages"]:
        for device in stage["devices"]:
            lines = [unstamp(line) for line in (run / f"{device}.log").read_text().splitlines()]
            devices.append(next(line for line in lines if line.startswith("device: ")).split(" ")[1])
            for line in lines:
                if (m := LOSS_RE.match(line)) is not None:
                    losses.setdefault(int(m.group(1)), []).append(float(m.group(2)))
                if (m := ENCODED_RE.search(line)) is not None:
                    for part in m.group(1).split(", "):
                        count, _, _, where = part.split(" ")
                        encoded[where] = encoded.get(where, 0) + int(count)
    return {"losses": [statistics.mean(v) for _, v in sorted(losses.items())], "devices": devices, "encoded_on": encoded}


def mean_gap(a: list[float], b: list[float]) -> float:
    return statistics.mean(abs(x - y) for x, y in zip(a, b))


def hetpeer(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "hetpeer", *args], capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"hetpeer {' '.join(args[:2])} failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def codec_part(sizes: Sizes, device: str) -> dict:
    """(d): GB/s of fp32 input through each codec: encoded where the tensor lies, decoded on the CPU and moved
    onto the device, as a receiving peer does; the same with the tensor on the CPU beside it."""
    found: dict = {}
    values = sizes.codec_mb * 2**20 // 4
    source = torch.randn(values // 1024, 1024, generator=torch.Generator().manual_seed(0))
    for where in dict.fromkeys([device, "cpu"]):
        tensor = source.to(where)
        for codec in CODECS:
            header = None

            def encoded():
                nonlocal header
                dtype, payload = encode(tensor, codec)
                header = FrameHeader(kind="activation", dtype=dtype, shape=tuple(tensor.shape), sender="a", step=0, micro=0,
                                     epoch=0, codec=codec, checksum=checksum(payload))
                return payload

            payload = bytearray(encoded())  # as a receiver holds it
            encode_s = time_per_call(encoded, where, 0.5, best=True)
            decode_s = time_per_call(lambda: decode(header, payload).to(where), where, 0.5, best=True)
            error = float((decode(header, payload) - source).abs().max())
            found[f"{where.split(':')[0]} {codec}"] = {
                "encode_gbps": tensor.numel() * 4 / encode_s / 1e9, "decode_gbps": tensor.numel() * 4 / decode_s / 1e9,
                "wire_share": len(payload) / (tensor.numel() * 4), "max_error": error}
    for key, row in found.items():
        say(f"  (d) {key:<10} encode {row['encode_gbps']:6.2f} GB/s, decode {row['decode_gbps']:6.2f} GB/s, "
            f"{row['wire_share']:.3f} of the bytes, max error {row['max_error']:.2e}")
    return found


def guarded(name: str, run, results: dict) -> None:
    try:
        results[name] = run()
    except Exception as error:  # a part that fails is reported; the others still run
        results[name] = {"error": f"{type(error).__name__}: {error}"}
        say(f"  {name} FAILED: {type(error).__name__}: {error}")
        traceback.print_exc(limit=6)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--parts", default="abcd", help="which parts to run: any of a, b, c, d (a and c run together)")
    parser.add_argument("--small", action="store_true", help="the CPU's small sizes on any device (a smoke run)")
    parser.add_argument("--out", type=Path, help="folder for the launches' plans and logs (default: a new temporary one)")
    args = parser.parse_args()
    if not set(args.parts) <= set("abcd") or not args.parts:
        parser.error(f"--parts takes letters of abcd, got {args.parts!r}")
    cuda = torch.cuda.is_available()
    device = "cuda:0" if cuda else "cpu"
    sizes = SMALL_SIZES if args.small or not cuda else GPU_SIZES
    out = args.out or Path(tempfile.mkdtemp(prefix="hetpeer-gpu-"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if not cuda:
        say(f"no CUDA GPU (torch {torch.__version__}, CUDA {torch.version.cuda}): the CPU parts only, at small sizes")
    announced = free_memory_bytes(device)  # what a joining peer announces, before anything is built
    name = torch.cuda.get_device_name(0) if cuda else None
    peak, peak_source = peak_tflops(name)
    say(f"device {device}: {name or 'cpu'}, {announced / 2**30:.1f} GiB free; {peak_source}; torch {torch.__version__}; "
        f"files in {out}")
    workspace = workspace_bytes(device)
    if cuda:
        say(f"  the CUDA libraries' workspaces: {workspace / 2**20:.1f} MiB a process")
    results: dict = {"device": name or "cpu", "torch": torch.__version__, "cuda": cuda, "workspace_bytes": workspace,
                     "announced_free_bytes": announced, "peak_bf16_tflops": peak, "sizes": asdict(sizes)}
    corpus = Corpus.default()
    if set(args.parts) & set("ac"):
        for label, config in sizes.models.items():
            spec = spec_of(out / re.sub(r"\W+", "-", label.lower()), config)
            guarded(label, lambda: model_part(label, spec, sizes, device, corpus, peak, announced), results.setdefault("models", {}))
    if "b" in args.parts:
        guarded("launch", lambda: launch_part(out, sizes, cuda), results)
    if "d" in args.parts:
        guarded("codecs", lambda: codec_part(sizes, device), results)
    results["seconds"] = time.perf_counter() - started
    print_table(results)
    if args.json:
        print(json.dumps(results, default=float))
    return 0


def print_table(results: dict) -> None:
    say(f"\n{results['device']}, torch {results['torch']}, {results['seconds']:.0f} s")
    if results.get("models"):
        say(f"{'model':<16} {'plain ms':>9} {'hetpeer ms':>10} {'ratio':>6} {'tokens/s':>10} {'MFU':>6} {'probe/achieved':>15} "
            f"{'counted/measured':>17} {'recomputed: mem, time':>22}  goals")
    for label, found in results.get("models", {}).items():
        if "error" in found:
            say(f"{label:<16} failed: {found['error']}")
            continue
        step, probe, memory = found["step"], found["probe"], found["memory"]
        mfu = step["hetpeer"]["mfu"]
        say(f"{label:<16} {step['plain']['ms']:9.1f} {step['hetpeer']['ms']:10.1f} {step['ratio']:6.3f} "
            f"{step['hetpeer']['tokens_per_s']:10,.0f} {f'{mfu:.1%}' if mfu else '-':>6} {probe['ratio']:15.3f} "
            f"{memory['kept']['ratio']:17.3f} {memory['recompute_memory_share']:10.2f}, {memory['recompute_slowdown']:.2f}x  "
            + ", ".join(f"{name} {'met' if ok else 'n/a' if ok is None else 'MISSED'}" for name, ok in found["goals"].items()))
    launch = results.get("launch", {})
    if "gpu_vs_cpu" in launch:
        say(f"launch 2x2: GPU vs CPU mean |loss gap| {launch['gpu_vs_cpu']:.5f}, bf16 vs fp32 {launch['bf16_vs_fp32_cpu']:.5f}: "
            + ("agree" if launch["ok"] else "NOT OK"))


if __name__ == "__main__":
    sys.exit(main())
