"""One peer's training step against a plain PyTorch loop over the same model, batch and AdamW.

    python3 benchmarks/training.py [--steps 20] [--rounds 3] [--batch 16] [--micro-batch 4] [--threads N] [--json]

For each model, the `small` GPT preset and a Llama of about its size (hidden 256, 8 layers, grouped-query
attention, SwiGLU), both runs take the same batches (the corpus's windows of lane 0, step by step) in the
same micro-batches, and AdamW with the same settings and weight decay rule (matrices only):

- plain: the whole model, `loss.backward()` per micro-batch, `torch.optim.AdamW.step()`;
- hetpeer: a `StageWorker` holding the whole model (a plan of one stage and one lane, on the in-memory
  transport): flat parameters, its own Adam, the frame checks; what one peer pays over plain PyTorch.

The two alternate in rounds of `--steps` steps (after 2 warm-up steps each), so the machine's load falls on
both alike; the figure is each one's median step over all rounds, and the ratio hetpeer / plain. Goal:
at most 1.10. `--json` prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from hetpeer.peer.data.corpus import Corpus
from hetpeer.peer.gossip.adam import AdamConfig
from hetpeer.peer.gossip.flat import decays
from hetpeer.peer.model import build_stage
from hetpeer.peer.pipeline.worker import StageWorker, WorkerConfig
from hetpeer.peer.transport import MemoryHub, MemoryTransport
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.workload import ModelSpec, preset

GOAL = 1.10
LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8,
         "num_key_value_heads": 4, "num_hidden_layers": 8, "max_position_embeddings": 128, "vocab_size": 256,
         "tie_word_embeddings": False}
ADAM = AdamConfig(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class Plain:
    def __init__(self, spec: ModelSpec, corpus: Corpus, batch: int, micro_batch: int) -> None:
        self.spec, self.corpus, self.batch, self.micro_batch = spec, corpus, batch, micro_batch
        self.model = build_stage(spec, 0, spec.layers)
        decayed = decays(self.model)
        groups = [{"params": [p for n, p in self.model.named_parameters() if decayed(n, p) == d],
                   "weight_decay": ADAM.weight_decay if d else 0.0} for d in (True, False)]
        self.optimizer = torch.optim.AdamW(groups, lr=ADAM.lr, betas=ADAM.betas, eps=ADAM.eps)
        self.step = 0

    def train_step(self) -> float:
        data = self.corpus.batch(0, self.step, self.batch, self.spec.seq_len)
        sizes = [self.micro_batch] * (self.batch // self.micro_batch)
        total = 0.0
        self.optimizer.zero_grad()
        for part in data.split(sizes):
            tokens, labels = torch.from_numpy(part.tokens), torch.from_numpy(part.labels)
            loss = self.model.loss(self.model(tokens), labels) * (len(part.tokens) / self.batch)
            loss.backward()
            total += loss.item()
        self.optimizer.step()
        self.step += 1
        return total


def hetpeer_worker(spec: ModelSpec, corpus: Corpus, batch: int, micro_batch: int) -> StageWorker:
    plan = Plan(cost_model="time", model=spec.name, layers=spec.layers, batch=batch, micro_batch=micro_batch,
                micro_batches=batch // micro_batch, dtype="fp32", stages=(StagePlan(0, 0, spec.layers, ("peer",), "none"),))
    transport = MemoryTransport("peer", MemoryHub())
    transport.start()
    return StageWorker(plan, "peer", transport, corpus, WorkerConfig(model=spec, adam=ADAM))


def timed(step, count: int) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per round and system (default 20)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, alternating the two (default 3)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch (default 4)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    if min(args.steps, args.rounds, args.batch, args.micro_batch) < 1 or args.batch % args.micro_batch:
        parser.error("--steps, --rounds, --batch and --micro-batch must be positive, the batch a multiple of the micro-batch")
    if args.threads:
        torch.set_num_threads(args.threads)
    corpus = Corpus.default()
    models = {"small GPT": preset("small"), "Llama of its size": ModelSpec.from_config(LLAMA, "the Llama config")}
    print(f"{args.batch} sequences a step in micro-batches of {args.micro_batch}, {torch.get_num_threads()} thread(s); "
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
        print(f"{label:<18} {spec.params / 1e6:5.2f}M parameters: plain {median['plain'] * 1e3:7.1f} ms/step, "
              f"hetpeer {median['hetpeer'] * 1e3:7.1f} ms/step, hetpeer / plain {ratio:.3f} (goal <= {GOAL:.2f})")
    if args.json:
        print(json.dumps({"goal": GOAL, "models": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
