"""The peer behind `hetpeer join`: set up the transport and the stage worker, then run the plan's steps.

This version follows a static plan and address book given as files; announcing itself and following
the coordinator's plans through the DHT build on the same pieces.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from hetpeer.peer.data.source import DataCache, open_data
from hetpeer.peer.pipeline.schedule import in_flight
from hetpeer.peer.pipeline.worker import StageWorker, StepResult, WorkerConfig, model_for
from hetpeer.peer.probe import peak_resident_bytes, resident_bytes
from hetpeer.peer.transport.links import Link, P2PLink, TcpLink
from hetpeer.peer.transport.network import Emulation, NetworkTransport
from hetpeer.peer.transport.stream import LinkIdentity
from hetpeer.protocol.addresses import LINK_CHOICES, AddressBook
from hetpeer.protocol.identity import KeyFileError, load_or_create_link_key
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.workload import Workload

log = logging.getLogger("hetpeer.peer")


class PeerSetupError(ValueError):
    """The peer's own configuration does not fit the plan or the address book."""


@dataclass(frozen=True, slots=True)
class PeerSetup:
    device_id: str
    plan: Plan
    book: AddressBook
    worker: WorkerConfig
    steps: int
    links: str = "auto"  # auto: direct TCP, falling back to P2P
    listen: tuple[str, int] | None = None  # where to accept TCP; default: this peer's address in the book
    identity_path: str | None = None  # P2P private key; its peer id must be the book's
    link_key: Path | None = None  # the direct link's key (RSA, DER; made if missing); its SHA-256 must be the book's
    data: str | None = None  # corpus folder or file; default: the Python standard library's sources
    tokenizer: str | None = None  # tokenizer.json (or a folder with one); default: bytes
    data_cache: DataCache = DataCache()  # where a plan's dataset is downloaded to
    threads: int | None = None  # torch intra-op threads
    rejoin: bool = False  # download the stage's state from the group first
    save: Path | None = None  # folder to write the stage's checkpoint to (DEVICE.safetensors)
    save_every: int | None = None  # steps between checkpoints (and at the end); None: at the end only
    resume: Path | None = None  # folder of checkpoints to start from: this peer's own, DEVICE.safetensors
    emulation: Emulation = Emulation()  # slow or far links emulated on a fast network (tests, demos, testbeds)

    def __post_init__(self) -> None:
        if self.links not in LINK_CHOICES:
            raise PeerSetupError(f"links must be one of {', '.join(LINK_CHOICES)}, got {self.links!r}")
        if self.steps < 1:
            raise PeerSetupError(f"steps must be at least 1, got {self.steps}")
        try:
            self.plan.position(self.device_id)
            address = self.book.get(self.device_id)
        except KeyError as error:
            raise PeerSetupError(error.args[0]) from None
        if self.links in ("auto", "tcp") and address.direct is None and self.listen is None:
            raise PeerSetupError(f"{self.device_id} has no direct address in the book; give --listen or use --link p2p")
        if self.links in ("auto", "p2p") and address.p2p:
            if self.identity_path is None:
                raise PeerSetupError(f"the book gives {self.device_id} a P2P identity; give its key file (--identity)")
            own = p2p_peer_id(self.identity_path)
            if own != address.p2p_peer_id:
                raise PeerSetupError(
                    f"key {self.identity_path} is P2P peer {own}, the book says {self.device_id} is {address.p2p_peer_id}"
                )
        if self.links == "p2p" and not address.p2p:
            raise PeerSetupError(f"{self.device_id} has no P2P address in the book")
        if self.links in ("auto", "tcp"):
            self.link_identity()  # refused here, before anything starts, when the key is not the book's

    def link_identity(self) -> LinkIdentity:
        """What this peer proves itself with on direct links: its link key, which must be the one whose digest
        the book gives it; every other device of the book proves itself by its own."""
        wanted = self.book.get(self.device_id).key
        if wanted is None:
            raise PeerSetupError(f"the book gives {self.device_id} no link key (\"key\"): run `hetpeer key FILE` on its "
                                 "machine and write the SHA-256 it prints into the book, or use --link p2p")
        if self.link_key is None:
            raise PeerSetupError(f"give {self.device_id}'s link key file (--link-key), the key whose SHA-256 the book gives it")
        try:
            key = load_or_create_link_key(self.link_key)
        except KeyFileError as error:
            raise PeerSetupError(str(error)) from None
        own = key.digest
        if own != wanted:
            raise PeerSetupError(f"link key {self.link_key} has SHA-256 {own}; the book says {self.device_id}'s is {wanted} "
                                 "(give the key the book was written for, or write this one's digest into the book)")
        return LinkIdentity(self.device_id, key, book=self.book.keys())


def p2p_peer_id(identity_path: str) -> str:
    from hivemind.p2p import PeerID

    try:
        return PeerID.from_identity(Path(identity_path).read_bytes()).to_base58()
    except OSError as error:
        raise PeerSetupError(f"cannot read P2P key {identity_path}: {error.strerror or error}") from None


def build_transport(setup: PeerSetup) -> NetworkTransport:
    address = setup.book.get(setup.device_id)
    links: list[Link] = []
    if setup.links in ("auto", "tcp"):
        host, port = setup.listen or address.direct
        links.append(TcpLink(host, port, advertise_host=address.direct[0] if address.direct else None,
                             identity=setup.link_identity()))
    if setup.links in ("auto", "p2p") and address.p2p:
        host_maddrs = [maddr.rsplit("/p2p/", 1)[0] for maddr in address.p2p]
        links.append(P2PLink(identity_path=setup.identity_path, host_maddrs=host_maddrs))
    return NetworkTransport(setup.device_id, setup.book, links, connect_timeout_s=setup.worker.timeout_s, emulation=setup.emulation)


def run(setup: PeerSetup, report: Callable[[str], None]) -> list[StepResult]:
    """Run `setup.steps` steps of the plan; raises TransportTimeout/PeerUnreachable when a neighbour fails."""
    if setup.threads is not None:
        torch.set_num_threads(setup.threads)
    stage, lane = setup.plan.position(setup.device_id)
    corpus = None
    if stage == 0:
        spec = model_for(setup.plan, setup.worker.model)
        corpus = open_data(setup.data, setup.tokenizer, spec.vocab, spec.seq_len, dataset=setup.plan.dataset,
                           cache=setup.data_cache, say=report)
        report(f"data: {corpus.description}")
    start_bytes = resident_bytes()
    results = []
    with build_transport(setup) as transport:
        worker = StageWorker(setup.plan, setup.device_id, transport, corpus, setup.worker)
        params = sum(p.numel() for p in worker.model.parameters())
        stage_layers = worker.model.layer_end - worker.model.layer_start
        report(
            f"stage {stage + 1}/{len(setup.plan.stages)} (layers {worker.model.layer_start}-"
            f"{worker.model.layer_end - 1}, {params:,} parameters), lane {lane + 1}/{setup.plan.group_size}, "
            f"on {setup.worker.device}, group of {len(worker.sync.members)} ({worker.sync.mode}"
            + (f", {worker.sync.config.topology})" if worker.sync.mode == "gossip" else ")")
            + (f", recomputing {worker.recompute} of its {stage_layers} layers' activations in backward"
               if worker.recompute else "")
        )
        report(f"recipe: {setup.plan.recipe.words}")
        if setup.resume is not None:
            checkpoint = worker.restore(setup.resume / f"{setup.device_id}.safetensors")
            report(f"resumed from {checkpoint.path}: step {checkpoint.step}, plan epoch {checkpoint.epoch}")
            if changed := worker.recipe_changes(checkpoint):
                report(f"the plan's recipe is not the one the checkpoint trained by: {changed}")
        elif worker.loaded_bytes:
            report(f"weights: {worker.loaded_bytes / 2**20:.1f} MiB of this stage's tensors read from {setup.worker.weights}")
        if setup.rejoin:
            download = worker.fetch_state()
            report(
                f"rejoined at step {download.step + 1}: {download.bytes / 2**20:.1f} MiB of state in {download.chunks} "
                f"chunk(s) from {', '.join(download.donors)} in {download.seconds:.2f} s"
            )
        last_step = worker.step + setup.steps
        for i in range(setup.steps):
            started = time.perf_counter()
            result = worker.train_step(last=i + 1 == setup.steps)
            results.append(result)
            report(format_step(result, time.perf_counter() - started, last_step))
            if setup.save is not None and (i + 1 == setup.steps or (setup.save_every and worker.step % setup.save_every == 0)):
                report(f"saved {worker.save(setup.save)} at step {worker.step}")
        report(f"routes: {', '.join(f'{d} over {link}' for d, link in sorted(transport.routes.items())) or 'none'}; frames "
               f"sent: {', '.join(f'{n} encoded on {where}' for where, n in sorted(transport.encoded_on.items())) or 'none'}")
        report(format_memory(worker, peak_resident_bytes() - start_bytes))
        if worker.sync.left_out:
            report(f"left out of mixing: {', '.join(f'{d} {n}x' for d, n in sorted(worker.sync.left_out.items()))}")
    return results


def format_memory(worker: StageWorker, peak_bytes: int) -> str:
    """Peak memory of the peer beside what the planner counts for its stage (`Workload.stage_memory`): on a GPU
    what torch allocated (the CUDA libraries' workspaces, 64 MiB on an H200, included), on the CPU how much the
    process grew (the interpreter and torch's own included)."""
    device = worker.config.device
    if torch.device(device).type == "cuda":
        peak_bytes = torch.cuda.max_memory_allocated(device)
        peak = f"{peak_bytes / 2**20:.0f} MiB allocated on {device}"
    else:
        peak = f"{peak_bytes / 2**20:.0f} MiB of the process above its start"
    expected = stage_memory(worker)
    mib = 2**20
    return (
        f"memory: peak {peak}; the planner counts {sum(expected.values()) / mib:.0f} MiB "
        f"for this stage: {expected['state_bytes'] / mib:.0f} MiB of weights, gradients and Adam moments, "
        f"{expected['activation_bytes'] / mib:.0f} MiB of activations in flight"
        + f", {expected['ends_bytes'] / mib:.0f} MiB at the model's ends (logits, embedding gradient)"
        + (f", {expected['sync_bytes'] / mib:.0f} MiB for the group's exchange" if expected["sync_bytes"] else "")
        + f" ({peak_bytes / max(1, sum(expected.values())):.2f}x)"
    )


def stage_memory(worker: StageWorker) -> dict[str, float]:
    """The planner's count of this peer's stage at its peak, by part (`Workload.stage_memory`)."""
    plan, model = worker.plan, worker.model
    workload = Workload(worker.spec, batch=plan.batch, micro_batch=plan.micro_batch, dtype=plan.dtype)
    return workload.stage_memory(
        model.layer_end - model.layer_start, first=model.first, last=model.last, in_flight=in_flight(worker.schedule),
        micro_batch=plan.micro_batch, group_size=len(worker.sync.members), recompute=worker.recompute,
        outer=worker.sync.mode == "outer",
    )


def format_step(result: StepResult, seconds: float, last_step: int) -> str:
    loss = f"loss {result.loss:.4f}" if result.loss is not None else "loss -"
    sync = ""
    if result.sync is not None and result.sync.mode != "none":
        sync = f", sync {result.sync.wait_s:.2f}"
        if result.sync.left_out:
            sync += f" without {', '.join(result.sync.left_out)}"
        if result.sync.clipped:  # robust averaging clipped or refused what some member sent
            sync += f", {result.sync.clipped} clipped"
    val = f"  val {result.val_loss:.4f}" if result.val_loss is not None else ""
    judged, failed = result.checks
    if judged:  # outputs of another lane's holder of this stage it recomputed (`pipeline/checks.py`)
        val += f"  checked {judged}" + (f", {failed} FAILED" if failed else " ok")
    windows = f"windows {result.windows[0]}-{result.windows[1] - 1}  " if result.windows is not None else ""
    return (
        f"step {result.step + 1}/{last_step}  {loss}  {result.tokens / seconds:,.0f} tok/s  {windows}"
        f"{seconds:.2f} s (compute {result.compute_s:.2f}, wait {result.wait_s:.2f}{sync}){val}"
    )
