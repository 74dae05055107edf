"""One peer of a pipeline for the integration tests: one step of `StageWorker.compute`, results to files.

Not a test module: `test_pipeline_processes.py` starts it once per peer, each in its own process.

    python pipeline_peer.py PLAN.json DEVICE ADDRESSES.json OUT_DIR {tcp,p2p,auto}
        [--identity KEY] [--listen HOST:PORT] [--timeout SECONDS] [--die-after-first-activation]

It builds the transport as `hetpeer join` does (`node.PeerSetup` and `node.build_transport`; its link key is
OUT_DIR/DEVICE.link.key, as `launch.link_key_path` names it), runs the
forward and backward passes of step 0 (no optimizer step), and writes into OUT_DIR:

    DEVICE.ready written once the transport listens
    DEVICE.npz   the gradient of every parameter of its stage, by global parameter name
    DEVICE.json  {"loss": float or null, "routes": {device: link}, "error": null}

and then keeps its transport up until its lane neighbours have written theirs (`_linger`).

When the transport fails (a dead or unreachable neighbour) DEVICE.json holds
{"error": {"type": exception class name, "message": str}} and the exit code is 3.
`--die-after-first-activation` kills this process (SIGKILL) as soon as the first activation arrived:
a peer that dies mid-step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

from hetpeer.peer import node
from hetpeer.peer.launch import link_key_path
from hetpeer.peer.data.corpus import Corpus
from hetpeer.peer.pipeline.worker import StageWorker, WorkerConfig
from hetpeer.peer.transport import TransportError
from hetpeer.protocol.addresses import AddressBook
from hetpeer.protocol.plan import Plan

EXIT_TRANSPORT = 3


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("plan", type=Path)
    parser.add_argument("device")
    parser.add_argument("book", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("link", choices=node.LINK_CHOICES)
    parser.add_argument("--identity")
    parser.add_argument("--listen")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--die-after-first-activation", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    listen = None
    if args.listen:
        host, _, port = args.listen.rpartition(":")
        listen = (host, int(port))
    setup = node.PeerSetup(
        device_id=args.device,
        plan=Plan.from_wire(json.loads(args.plan.read_text())),
        book=AddressBook.load(args.book),
        worker=WorkerConfig(timeout_s=args.timeout),
        steps=1,
        links=args.link,
        listen=listen,
        identity_path=args.identity,
        link_key=link_key_path(args.out, args.device),
    )
    stage, _ = setup.plan.position(args.device)
    corpus = Corpus.default() if stage == 0 else None
    report = args.out / f"{args.device}.json"
    with node.build_transport(setup) as transport:
        (args.out / f"{args.device}.ready").touch()  # listening: neighbours can connect now
        if args.die_after_first_activation:
            _die_after_first_activation(transport)
        worker = StageWorker(setup.plan, args.device, transport, corpus, setup.worker)
        try:
            result = worker.compute()
        except TransportError as error:
            report.write_text(json.dumps({"error": {"type": type(error).__name__, "message": str(error)}}))
            return EXIT_TRANSPORT
        grads = {name: p.grad.detach().numpy() for name, p in worker.model.named_parameters()}
        np.savez(args.out / f"{args.device}.npz", **grads)
        report.write_text(json.dumps({"loss": result.loss, "routes": dict(transport.routes), "error": None}))
        _linger(args.out, [d for d in (worker.previous, worker.next) if d is not None], args.timeout)
    return 0


def _linger(out: Path, neighbours: list[str], timeout_s: float) -> None:
    """Keep the transport up until the lane's neighbours have written their results too (or `timeout_s`).
    `flush` returns once the last frames left this process, but over P2P they may still sit in this peer's
    p2pd, which stops with the transport: a peer that left at once dropped its last gradients to a busy
    neighbour (seen in CI: "no gradient for step 0 micro-batch 2 from d1 within 30 s", d1 done)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all((out / f"{d}.json").exists() for d in neighbours):
        time.sleep(0.05)


def _die_after_first_activation(transport) -> None:
    take = transport.take

    def take_then_die(kind, sender, step, micro, timeout_s):
        frame = take(kind, sender, step, micro, timeout_s)
        if kind == "activation":
            os.kill(os.getpid(), signal.SIGKILL)
        return frame

    transport.take = take_then_die


if __name__ == "__main__":
    sys.exit(main())
