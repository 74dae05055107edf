"""The baseline of benchmarks/vs_hivemind.py: one peer of hivemind's collaborative training, in a container.

    python3 hivemind_peer.py --bootstrap --announce-ip IP --peers-file PATH
    python3 hivemind_peer.py --peers-file PATH --announce-ip IP --peer I --target-batch B [...]
    python3 hivemind_peer.py --peers-file PATH --announce-ip IP --peer I --diloco H --peers N [...]

`--bootstrap` runs a DHT node that only introduces peers (as hivemind's `hivemind-dht` does) and writes
its addresses to `--peers-file`. A training peer waits for that file, joins the DHT and trains the whole
model with `hivemind.Optimizer` wrapping AdamW, set up as hivemind's own ALBERT example sets it up for
training over the internet: the optimizer offloaded to host memory, delayed optimizer steps and delayed
gradient averaging (together: delayed parameter updates, Ren et al. 2021), gradients and state averaged
in fp16, parameters averaged every epoch (the default), `bandwidth` given to all-reduce's load
balancing. It uses hetpeer's model, corpus and compute emulation, so that both systems train the same
weights from the same initialisation on batches drawn by the same rule (seed, lane, step), and a peer
`--slowdown` times slower computes as slowly as a hetpeer peer told the same.

`--diloco H` trains with DiLoCo instead, as OpenDiLoCo (Jaghouar et al. 2024) runs it on hivemind (its
open_diloco/hivemind_diloco.py and train_fsdp.py): every peer takes H local AdamW steps on its own batches
(gradients clipped at norm 1), then the peers average the pseudo-gradient (the fp32 anchor on the host
minus the trained parameters) with hivemind's DecentralizedAverager, equal weights, in fp16 (the paper's
setting; the released configs send fp32), and every peer takes an outer step on the anchor with SGD, lr 0.7,
momentum 0.9, Nesterov, and trains on from it. Like OpenDiLoCo's WAIT_FOR_ALL it waits (at most 600 s) for
every peer to finish its H steps before matchmaking (15 s, OpenDiLoCo's default), here through a DHT key
each peer sets; a round that fails leaves each peer with its own change. Its AdamW state stays local.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_PEERS = 64  # the order's slices a step: peer I reads the I-th


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


@dataclass
class Peer:
    """What both kinds of training peer start from: hetpeer's model, corpus and compute emulation, and a DHT node."""

    spec: Any
    corpus: Any
    dht: Any
    model: Any
    groups: list  # AdamW's parameter groups: hetpeer's rule, matrices decay and biases, norm gains and embeddings do not
    slowdown: Any

    def backward(self, args: argparse.Namespace, step: int) -> float:
        """The loss of this peer's batch of local step `step` (lane `--peer`'s), its gradient accumulated."""
        import torch

        # the peers step apart, so each reads its own slice of every step's MAX_PEERS slices of the order
        position = (step * MAX_PEERS + args.peer) * args.local_batch
        batch = self.corpus.batch(position, args.local_batch, self.spec.seq_len, seed=args.seed)
        tokens, labels = torch.from_numpy(batch.tokens), torch.from_numpy(batch.labels)
        with self.slowdown.of("forward"):
            loss = self.model.loss(self.model(tokens), labels)
        with self.slowdown.of("backward"):
            loss.backward()
        return loss.item()


def start_peer(args: argparse.Namespace, setting: str) -> Peer:
    import hivemind
    import torch

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
    say(f"hivemind peer {args.peer}: {setting}model {spec.name} ({spec.params / 1e6:.1f}M parameters), local batch "
        f"{args.local_batch}, slowed {args.slowdown:g}x")
    model = build_stage(spec, 0, spec.layers, seed=args.seed)
    decayed = decays(model)
    groups = [{"params": [p for n, p in model.named_parameters() if decayed(n, p) == decay], "weight_decay": 0.1 if decay else 0.0}
              for decay in (True, False)]
    return Peer(spec, corpus, dht, model, groups, Slowdown(args.slowdown))


def say_step(args: argparse.Namespace, step: int, loss: float, epoch: int) -> None:
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    say(f"hivemind peer {args.peer} step {step} loss {loss:.4f} samples {args.local_batch} epoch {epoch} peak {peak_mib:.0f} MiB")


def train(args: argparse.Namespace) -> None:
    import hivemind
    import torch
    from hivemind.compression import Float16Compression

    peer = start_peer(args, f"target batch {args.target_batch}, ")
    optimizer = hivemind.Optimizer(
        dht=peer.dht, run_id=args.run_id, target_batch_size=args.target_batch, batch_size_per_step=args.local_batch,
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8),
        params=peer.groups, matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout,
        offload_optimizer=True, delay_optimizer_step=True, delay_grad_averaging=True,
        grad_compression=Float16Compression(), state_averaging_compression=Float16Compression(),
        averager_opts={"bandwidth": args.bandwidth_mbit}, verbose=True,
    )
    step = 0
    while True:
        loss = peer.backward(args, step)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        say_step(args, step, loss, optimizer.local_epoch)


def diloco(args: argparse.Namespace) -> None:
    import hivemind
    import torch
    from hivemind.compression import Float16Compression
    from hivemind.utils import get_dht_time

    peer = start_peer(args, f"DiLoCo, H = {args.diloco}, {args.peers} peers, ")
    dht, model = peer.dht, peer.model
    inner = torch.optim.AdamW(peer.groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    params = list(model.parameters())
    anchor = [p.detach().clone().float() for p in params]  # the host's fp32 copy the outer optimizer steps
    for a in anchor:
        a.grad = torch.zeros_like(a)
    outer = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True)
    averager = hivemind.averaging.DecentralizedAverager(
        [torch.zeros_like(a) for a in anchor], dht, start=True, prefix=f"{args.run_id}_diloco", min_group_size=2,
        min_matchmaking_time=args.diloco_matchmaking_time, allreduce_timeout=args.averaging_timeout,
        next_chunk_timeout=args.diloco_matchmaking_time, compression=Float16Compression(), bandwidth=args.bandwidth_mbit,
    )
    ready_key = f"{args.run_id}_diloco_ready"
    step = epoch = 0
    while True:
        loss = peer.backward(args, step)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        inner.step()
        inner.zero_grad()
        step += 1
        if step % args.diloco == 0:
            epoch += 1
            dht.store(ready_key, subkey=str(args.peer), value=epoch, expiration_time=get_dht_time() + 3600)
            waited = time.monotonic()
            while time.monotonic() - waited < 600:  # WAIT_FOR_ALL: every peer has finished this epoch's local steps
                found = dht.get(ready_key, latest=True)
                done = [v.value for v in found.value.values()] if found is not None and isinstance(found.value, dict) else []
                if sum(1 for e in done if e >= epoch) >= args.peers:
                    break
                time.sleep(0.5)
            with averager.get_tensors() as shared:
                for buffer, a, p in zip(shared, anchor, params):
                    buffer.copy_(a - p.detach().float())
            try:
                group = averager.step(timeout=args.averaging_timeout + args.diloco_matchmaking_time)
            except Exception as error:  # hivemind raises its own types; the round is lost, the peer trains on
                say(f"hivemind peer {args.peer} averaging failed: {type(error).__name__}: {error}")
                group = None
            with averager.get_tensors() as shared:  # averaged in place, or this peer's own change when the round failed
                for buffer, a in zip(shared, anchor):
                    a.grad.copy_(buffer)
            outer.step()
            with torch.no_grad():
                for a, p in zip(anchor, params):
                    p.copy_(a)
            say(f"hivemind peer {args.peer} outer step {epoch}: averaged with {len(group) if group else 1} peer(s) after "
                f"{time.monotonic() - waited:.1f} s")
        say_step(args, step, loss, epoch)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", action="store_true", help="run the DHT node that introduces peers")
    parser.add_argument("--peers-file", type=Path, required=True, help="the bootstrap's addresses (written or read)")
    parser.add_argument("--announce-ip", required=True, help="the address other containers reach this one at")
    parser.add_argument("--port", type=int, default=31340, help="the DHT's TCP port (default 31340)")
    parser.add_argument("--peer", type=int, default=0, help=f"this peer's index, below {MAX_PEERS}: its batches are lane I's")
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
    parser.add_argument("--diloco", type=int, metavar="H", help="train with DiLoCo, an outer step every H local steps")
    parser.add_argument("--peers", type=int, default=1, help="DiLoCo: how many peers every round waits for")
    parser.add_argument("--diloco-matchmaking-time", type=float, default=15.0, help="OpenDiLoCo's default: 15")
    args = parser.parse_args()
    try:
        (bootstrap if args.bootstrap else diloco if args.diloco else train)(args)
    except (MemoryError, RuntimeError) as error:
        say(f"hivemind peer {args.peer} failed: {type(error).__name__}: {error}")
        os._exit(1)  # hivemind's own threads and processes would keep the interpreter alive
    return 0


if __name__ == "__main__":
    sys.exit(main())
