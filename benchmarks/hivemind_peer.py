"""The baseline of benchmarks/vs_hivemind.py: one peer of hivemind's collaborative training, in a container.

    python3 hivemind_peer.py --bootstrap --announce-ip IP --peers-file PATH
    python3 hivemind_peer.py --peers-file PATH --announce-ip IP --peer I --target-batch B [...]

`--bootstrap` runs a DHT node that only introduces peers (as hivemind's `hivemind-dht` does) and writes
its addresses to `--peers-file`. A training peer waits for that file, joins the DHT and trains the whole
model with `hivemind.Optimizer` wrapping AdamW, set up as hivemind's own ALBERT example sets it up for
training over the internet: the optimizer offloaded to host memory, delayed optimizer steps and delayed
gradient averaging (together: delayed parameter updates, Ren et al. 2021), gradients and state averaged
in fp16, parameters averaged every epoch (the default), `bandwidth` given to all-reduce's load
balancing. It uses hetpeer's model, corpus and compute emulation, so that both systems train the same
weights from the same initialisation on batches drawn by the same rule (seed, lane, step), and a peer
`--slowdown` times slower computes as slowly as a hetpeer peer told the same.

Every local step prints one line, time-stamped like hetpeer's: `hivemind peer I step K loss L samples
S epoch E peak M MiB` (M: the process's peak resident memory). A peer that fails with an error prints it
and exits 1; one the kernel kills for memory (the benchmark's memory case) prints nothing more.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path


def say(text: str) -> None:
    from hetpeer import logline

    print(logline.stamp(text), flush=True)


def wait_for(path: Path, timeout_s: float = 300.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and (lines := path.read_text().split()):
            return lines
        time.sleep(0.5)
    raise SystemExit(f"no bootstrap addresses in {path} after {timeout_s:g} s")


def bootstrap(args: argparse.Namespace) -> None:
    import hivemind

    dht = hivemind.DHT(host_maddrs=[f"/ip4/0.0.0.0/tcp/{args.port}"], announce_maddrs=[f"/ip4/{args.announce_ip}/tcp/{args.port}"],
                       start=True)
    maddrs = [str(m) for m in dht.get_visible_maddrs() if args.announce_ip in str(m)]
    args.peers_file.write_text("\n".join(maddrs) + "\n")
    say(f"hivemind bootstrap at {' '.join(maddrs)}")
    while True:
        time.sleep(3600)


def train(args: argparse.Namespace) -> None:
    import hivemind
    import torch
    from hivemind.compression import Float16Compression

    from hetpeer.peer.data import Corpus
    from hetpeer.peer.gossip.flat import decays
    from hetpeer.peer.probe import Slowdown
    from hetpeer.peer.model import build_stage
    from hetpeer.protocol.modelspec import preset

    torch.set_num_threads(args.threads)
    spec = preset(args.model)
    corpus = Corpus.default(min_tokens=spec.seq_len + 1)
    initial = wait_for(args.peers_file)
    dht = hivemind.DHT(initial_peers=initial, host_maddrs=[f"/ip4/0.0.0.0/tcp/{args.port}"],
                       announce_maddrs=[f"/ip4/{args.announce_ip}/tcp/{args.port}"], start=True)
    say(f"hivemind peer {args.peer}: model {spec.name} ({spec.params / 1e6:.1f}M parameters), local batch {args.local_batch}, "
        f"target batch {args.target_batch}, slowed {args.slowdown:g}x")
    model = build_stage(spec, 0, spec.layers, seed=args.seed)
    decayed = decays(model)  # hetpeer's rule: matrices decay, biases, norm gains and embeddings do not
    groups = [{"params": [p for n, p in model.named_parameters() if decayed(n, p) == decay], "weight_decay": 0.1 if decay else 0.0}
              for decay in (True, False)]
    optimizer = hivemind.Optimizer(
        dht=dht, run_id=args.run_id, target_batch_size=args.target_batch, batch_size_per_step=args.local_batch,
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8),
        params=groups, matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout,
        offload_optimizer=True, delay_optimizer_step=True, delay_grad_averaging=True,
        grad_compression=Float16Compression(), state_averaging_compression=Float16Compression(),
        averager_opts={"bandwidth": args.bandwidth_mbit}, verbose=True,
    )
    slowdown = Slowdown(args.slowdown)
    step = 0
    while True:
        batch = corpus.batch(args.peer, step, args.local_batch, spec.seq_len, seed=args.seed)
        tokens, labels = torch.from_numpy(batch.tokens), torch.from_numpy(batch.labels)
        with slowdown.of("forward"):
            loss = model.loss(model(tokens), labels)
        with slowdown.of("backward"):
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        say(f"hivemind peer {args.peer} step {step} loss {loss.item():.4f} samples {args.local_batch} epoch {optimizer.local_epoch} "
            f"peak {peak_mib:.0f} MiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", action="store_true", help="run the DHT node that introduces peers")
    parser.add_argument("--peers-file", type=Path, required=True, help="the bootstrap's addresses (written or read)")
    parser.add_argument("--announce-ip", required=True, help="the address other containers reach this one at")
    parser.add_argument("--port", type=int, default=31340, help="the DHT's TCP port (default 31340)")
    parser.add_argument("--peer", type=int, default=0, help="this peer's index: its batches are lane I's")
    parser.add_argument("--run-id", default="vs-hetpeer")
    parser.add_argument("--model", default="small")
    parser.add_argument("--target-batch", type=int, default=64, help="sequences per collaborative step (epoch)")
    parser.add_argument("--local-batch", type=int, default=4, help="sequences per local step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slowdown", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bandwidth-mbit", type=float, default=100.0, help="this peer's uplink, for all-reduce's load balancing")
    parser.add_argument("--matchmaking-time", type=float, default=5.0, help="hivemind's ALBERT example's default: 5")
    parser.add_argument("--averaging-timeout", type=float, default=60.0, help="hivemind's default: 60")
    args = parser.parse_args()
    try:
        (bootstrap if args.bootstrap else train)(args)
    except (MemoryError, RuntimeError) as error:
        say(f"hivemind peer {args.peer} failed: {type(error).__name__}: {error}")
        os._exit(1)  # hivemind's own threads and processes would keep the interpreter alive
    return 0


if __name__ == "__main__":
    sys.exit(main())
