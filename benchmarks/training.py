"""Training as a user runs it: (a) one peer's step against a plain PyTorch loop, (b) a tiny Llama in a pipeline.

    python3 benchmarks/training.py [--case both|step|pipeline] [--steps 20] [--rounds 3] [--batch 16]
                                   [--micro-batch 4] [--threads N] [--pipeline-steps 200] [--json]

(a) step:
For each model, the `small` GPT preset and a Llama of about its size (hidden 256, 8 layers, grouped-query
attention, SwiGLU), both runs take the same batches (the corpus's windows of lane 0, step by step) in the
same micro-batches, and AdamW with the same settings and weight decay rule (matrices only):

- plain: the whole model, `loss.backward()` per micro-batch, torch's fused AdamW (`torch.optim.AdamW(fused=True)`);
- hetpeer: a `StageWorker` holding the whole model (a plan of one stage and one lane, on the in-memory
  transport): flat parameters, its own Adam, the frame checks; what one peer pays over plain PyTorch.

The two alternate in rounds of `--steps` steps (after 2 warm-up steps each), so the machine's load falls on
both alike; the figure is each one's median step over all rounds, and the ratio hetpeer / plain. Goal:
at most 1.10.

(b) pipeline: a tiny Llama (a config.json only: fresh weights from the seed, the same in both runs), planned
with `hetpeer plan --model FOLDER` as 2 stages x 2 lanes and as 1 stage x 1 lane, each run with `hetpeer
launch` for `--pipeline-steps` steps on the same global batch, the validation loss measured every 20 steps on
the same held-out sequences. Goal: the validation loss falls, and at equal tokens (the last measurement) the
2 x 2 run's is within 5% of the 1 x 1 run's.

`--json` prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hetpeer.peer.data.corpus import Corpus
from hetpeer.peer.gossip.adam import AdamConfig
from hetpeer.peer.gossip.flat import decays
from hetpeer.peer.model import build_stage
from hetpeer.peer.pipeline.steptime import one_stage_worker
from hetpeer.peer.pipeline.worker import StageWorker
from hetpeer.protocol.recipe import Recipe
from hetpeer.protocol.modelspec import ModelSpec, preset

GOAL = 1.10
PIPELINE_GOAL = 0.05  # the 2 x 2 run's validation loss within 5% of the 1 x 1 run's at equal tokens
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 172, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 4, "max_position_embeddings": 64, "vocab_size": 256,
              "tie_word_embeddings": False}
VAL_RE = re.compile(r"\bstep (\d+)/\d+\s+loss [\d.]+ .*\)\s+val ([\d.]+)\s*$")
LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8,
         "num_key_value_heads": 4, "num_hidden_layers": 8, "max_position_embeddings": 128, "vocab_size": 256,
         "tie_word_embeddings": False}
ADAM = AdamConfig(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class Plain:
    """The plain PyTorch loop: the same module, torch's fused AdamW, bf16 autocast when `dtype` says; a tied head's
    two copies add their gradients, as the model defines them (`FamilyStage.tied_parameters`)."""

    def __init__(self, spec: ModelSpec, corpus: Corpus, batch: int, micro_batch: int, device: str = "cpu",
                 dtype: str = "fp32") -> None:
        self.spec, self.corpus, self.batch, self.micro_batch, self.device = spec, corpus, batch, micro_batch, device
        self.model = build_stage(spec, 0, spec.layers, device=device)
        decayed = decays(self.model)
        groups = [{"params": [p for n, p in self.model.named_parameters() if decayed(n, p) == d],
                   "weight_decay": ADAM.weight_decay if d else 0.0} for d in (True, False)]
        self.optimizer = torch.optim.AdamW(groups, lr=ADAM.lr, betas=ADAM.betas, eps=ADAM.eps, fused=True)
        self.autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=dtype == "bf16")
        self.step = 0

    def train_step(self) -> float:
        data = self.corpus.batch(self.step * self.batch, self.batch, self.spec.seq_len)
        sizes = [self.micro_batch] * (self.batch // self.micro_batch)
        total = torch.zeros((), device=self.device)
        self.optimizer.zero_grad()
        for part in data.split(sizes):
            tokens, labels = torch.from_numpy(part.tokens).to(self.device), torch.from_numpy(part.labels).to(self.device)
            with self.autocast:
                loss = self.model.loss(self.model(tokens), labels) * (len(part.tokens) / self.batch)
            loss.backward()
            total += loss.detach()
        if self.spec.tied:
            embedding, head = self.model.tied_parameters()
            embedding.grad.add_(head.grad)
            head.grad.copy_(embedding.grad)
        self.optimizer.step()
        self.step += 1
        return float(total)


def hetpeer_worker(spec: ModelSpec, corpus: Corpus, batch: int, micro_batch: int, device: str = "cpu",
                   dtype: str = "fp32") -> StageWorker:
    return one_stage_worker(spec, corpus, batch, micro_batch, device, dtype,
                            Recipe(lr=ADAM.lr, betas=ADAM.betas, eps=ADAM.eps, weight_decay=ADAM.weight_decay, clip_norm=0.0))


def timed(step, count: int) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return times


def hetpeer(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "hetpeer", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"hetpeer {' '.join(args[:2])} failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


def pipeline_run(folder: Path, topology: Path, out: Path, stages: int, lanes: int, args: argparse.Namespace) -> dict[int, float]:
    """Plan and launch one shape; the validation loss at each measured step (the mean over the lanes)."""
    plan_text = hetpeer("plan", str(topology), "--model", str(folder), "--batch", "16", "--micro-batch", "2", "--dtype", "fp32",
                        "--stages", str(stages), "--group-size", str(lanes), "--eval-every", "20", "--eval-batch", "32", "--json", "--quiet", "--time-budget", "0.5")
    plan_path = out / f"plan-{stages}x{lanes}.json"
    plan_path.write_text(plan_text)
    last_stage = json.loads(plan_text)["stages"][-1]["devices"]
    run = out / f"run-{stages}x{lanes}"
    started = time.perf_counter()
    hetpeer("launch", str(plan_path), "--model", str(folder), "--steps", str(args.pipeline_steps), "--set", "lr=3e-3",
            "--out", str(run), "--link", "tcp")
    seconds = time.perf_counter() - started
    found: dict[int, list[float]] = {}
    for device in last_stage:
        for line in (run / f"{device}.log").read_text().splitlines():
            if (m := VAL_RE.search(line)) is not None:
                found.setdefault(int(m.group(1)) - 1, []).append(float(m.group(2)))
    print(f"  {stages} stage(s) x {lanes} lane(s): {args.pipeline_steps} steps in {seconds:.1f} s; validation loss "
          + ", ".join(f"step {k}: {statistics.mean(v):.4f}" for k, v in sorted(found.items())))
    return {k: statistics.mean(v) for k, v in found.items()}


def pipeline_case(args: argparse.Namespace) -> dict:
    out = Path(tempfile.mkdtemp(prefix="hetpeer-training-"))
    folder = out / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    topology = out / "four.json"
    topology.write_text(json.dumps({"devices": [{"id": f"p{i}", "region": "r", "tflops": 1.0} for i in range(4)],
                                    "regions": {"r": {"latency_ms": 0.1, "bandwidth_gbps": 10}}}))
    print(f"(b) pipeline: a tiny Llama ({ModelSpec.from_config(TINY_LLAMA).params / 1e6:.2f}M parameters), batch 16 "
          f"sequences a step, validation on 32 held-out sequences every 20 steps; files in {out}")
    curves = {shape: pipeline_run(folder, topology, out, *shape, args) for shape in ((2, 2), (1, 1))}
    last = max(set(curves[(2, 2)]) & set(curves[(1, 1)]))
    first = min(curves[(2, 2)])
    piped, single = curves[(2, 2)][last], curves[(1, 1)][last]
    gap = piped / single - 1
    print(f"  at step {last} (equal tokens): 2x2 {piped:.4f}, 1x1 {single:.4f}, {gap:+.1%} (goal within "
          f"{PIPELINE_GOAL:.0%}); the 2x2 run's validation loss fell from {curves[(2, 2)][first]:.4f} to {piped:.4f}")
    return {"step": last, "val_loss_2x2": piped, "val_loss_1x1": single, "gap": gap,
            "val_loss_2x2_first": curves[(2, 2)][first], "curves": {f"{s}x{l}": c for (s, l), c in curves.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per round and system (default 20)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, alternating the two (default 3)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch (default 4)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--case", choices=("both", "step", "pipeline"), default="both", help="(a) step, (b) pipeline, or both")
    parser.add_argument("--pipeline-steps", type=int, default=200, help="(b): steps of each run (default 200)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    if args.pipeline_steps < 20:
        parser.error("--pipeline-steps must be at least 20 (the validation loss is measured every 20 steps)")
    if min(args.steps, args.rounds, args.batch, args.micro_batch) < 1 or args.batch % args.micro_batch:
        parser.error("--steps, --rounds, --batch and --micro-batch must be positive, the batch a multiple of the micro-batch")
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict = {}
    if args.case in ("both", "step"):
        result["step"] = step_case(args)
    if args.case in ("both", "pipeline"):
        result["pipeline"] = pipeline_case(args)
    if args.json:
        print(json.dumps({"goal": GOAL, "pipeline_goal": PIPELINE_GOAL, **result}))
    return 0


def step_case(args: argparse.Namespace) -> dict:
    corpus = Corpus.default()
    models = {"small GPT": preset("small"), "Llama of its size": ModelSpec.from_config(LLAMA, "the Llama config")}
    print(f"(a) step: {args.batch} sequences a step in micro-batches of {args.micro_batch}, {torch.get_num_threads()} thread(s); "
          f"{args.rounds} rounds of {args.steps} steps each, alternating")
    result = {}
    for label, spec in models.items():
        plain, worker = Plain(spec, corpus, args.batch, args.micro_batch), hetpeer_worker(spec, corpus, args.batch, args.micro_batch)
        times: dict[str, list[float]] = {"plain": [], "hetpeer": []}
        timed(plain.train_step, 2)
        timed(worker.train_step, 2)
        for _ in range(args.rounds):
            times["plain"] += timed(plain.train_step, args.steps)
            times["hetpeer"] += timed(worker.train_step, args.steps)
        median = {name: statistics.median(values) for name, values in times.items()}
        ratio = median["hetpeer"] / median["plain"]
        result[label] = {"params": spec.params, "plain_s": median["plain"], "hetpeer_s": median["hetpeer"], "ratio": ratio}
        print(f"  {label:<18} {spec.params / 1e6:5.2f}M parameters: plain {median['plain'] * 1e3:7.1f} ms/step, "
              f"hetpeer {median['hetpeer'] * 1e3:7.1f} ms/step, hetpeer / plain {ratio:.3f} (goal <= {GOAL:.2f})")
    return result


if __name__ == "__main__":
    sys.exit(main())
