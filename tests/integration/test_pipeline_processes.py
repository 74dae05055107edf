"""A pipeline of real peer processes on 127.0.0.1 computes what the whole model computes in one process.

Each peer is `pipeline_peer.py` in a process of its own (the real transport, worker and model); the test
compares the loss and every parameter's gradient of one step with those of the uncut model on the same
lane batch. Then the failures: a neighbour that never starts or dies mid-step, and a neighbour that
sends bad frames over a real socket.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from p2p_keys import make_keys
from hetpeer.peer.data.corpus import Corpus
from hetpeer.peer.launch import free_port, link_key_path
from hetpeer.peer.model import build_stage
from hetpeer.peer.pipeline.worker import StageWorker, WorkerConfig
from hetpeer.peer.transport.codec import checksum, decode, encode
from hetpeer.peer.transport.links import TcpLink
from hetpeer.peer.transport.network import NetworkTransport
from hetpeer.protocol.addresses import AddressBook, PeerAddress
from hetpeer.protocol.frame import PREFIX, FrameHeader, decode_header, header_length
from hetpeer.protocol.identity import load_or_create_link_key
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.modelspec import preset

ROOT = Path(__file__).resolve().parents[2]
PEER = Path(__file__).with_name("pipeline_peer.py")
SPEC = preset("tiny")
BATCH = 4  # one lane: the lane batch is the batch
RTOL = 1e-5
HANG_GUARD_S = 120  # generous: a run takes seconds; this only stops a hang


def make_plan(layers_per_stage: list[int], micro_batch: int, batch: int = BATCH) -> Plan:
    bounds = np.cumsum([0, *layers_per_stage])
    stages = tuple(
        StagePlan(index=s, layer_start=int(a), layer_end=int(b), devices=(f"d{s}",), sync="none")
        for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))
    )
    return Plan(
        cost_model="time", model="tiny", layers=SPEC.layers, batch=batch, micro_batch=micro_batch,
        micro_batches=-(-batch // micro_batch), dtype="fp32", stages=stages,
    )  # fmt: skip


def link_keys(devices, out: Path) -> dict[str, str]:
    """Each device's link key, made where `pipeline_peer.py` reads it: device -> the digest its book entry carries."""
    return {d: load_or_create_link_key(link_key_path(out, d)).digest for d in devices}


def tcp_book(devices, out: Path) -> AddressBook:
    keys = link_keys(devices, out)
    return AddressBook({d: PeerAddress(direct=("127.0.0.1", free_port()), key=keys[d]) for d in devices})


def write(path: Path, wire: dict) -> Path:
    path.write_text(json.dumps(wire))
    return path


class Peers:
    """The peer processes of one test; whatever is still running at the end is killed."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self, plan: Path, device: str, book: Path, link: str, *extra: str) -> subprocess.Popen:
        with open(self.out / f"{device}.log", "w") as log:
            process = subprocess.Popen(
                [sys.executable, str(PEER), str(plan), device, str(book), str(self.out), link, *extra],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
            )  # fmt: skip
        self.processes[device] = process
        return process

    def wait(self, device: str) -> int:
        try:
            return self.processes[device].wait(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"peer {device} hung for {HANG_GUARD_S} s\n{self.logs()}")

    def wait_ready(self, device: str) -> None:
        deadline = time.monotonic() + HANG_GUARD_S
        while not (self.out / f"{device}.ready").exists():
            if self.processes[device].poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"peer {device} never listened\n{self.logs()}")
            time.sleep(0.05)

    def result(self, device: str) -> dict:
        return json.loads((self.out / f"{device}.json").read_text())

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(self.out.glob("*.log")))

    def kill_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)


@pytest.fixture
def peers(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    group = Peers(out)
    yield group
    group.kill_all()


@pytest.fixture(scope="module")
def reference():
    """Loss and gradients of the whole model on lane 0's batch of step 0, in this process."""
    model = build_stage(SPEC, 0, SPEC.layers)
    batch = Corpus.default().batch(position=0, sequences=BATCH, seq_len=SPEC.seq_len, seed=0)
    loss = model.loss(model(torch.from_numpy(batch.tokens)), torch.from_numpy(batch.labels))
    loss.backward()
    return loss.item(), {name: p.grad.numpy().copy() for name, p in model.named_parameters()}


def run_pipeline(tmp_path: Path, peers: Peers, plan: Plan, book: AddressBook, link: str, extra=lambda d: ()):
    """Start every peer, wait for all; (loss of the last stage, gradients by name, routes by device)."""
    plan_path = write(tmp_path / "plan.json", plan.to_wire())
    book_path = write(tmp_path / "addresses.json", book.to_wire())
    for device in plan.devices:
        peers.start(plan_path, device, book_path, link, *extra(device))
    for device in plan.devices:
        assert peers.wait(device) == 0, peers.logs()
    grads: dict[str, np.ndarray] = {}
    routes = {}
    for device in plan.devices:
        with np.load(peers.out / f"{device}.npz") as stage:
            assert not set(stage.files) & set(grads), f"{device} holds parameters of another stage"
            grads |= {name: stage[name] for name in stage.files}
        routes[device] = peers.result(device)["routes"]
    return peers.result(plan.devices[-1])["loss"], grads, routes


def assert_matches_reference(loss: float, grads: dict[str, np.ndarray], reference) -> None:
    ref_loss, ref_grads = reference
    assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), (loss, ref_loss)
    assert sorted(grads) == sorted(ref_grads)
    for name, ref in ref_grads.items():
        assert grads[name].shape == ref.shape, name
        error = np.linalg.norm(grads[name] - ref) / np.linalg.norm(ref)
        assert error < RTOL, f"{name}: relative difference {error:.2e}"


def neighbours(plan: Plan) -> dict[str, set[str]]:
    lane = plan.lanes[0]
    return {d: {n for n in (lane[s - 1] if s else None, lane[s + 1] if s + 1 < len(lane) else None) if n}
            for s, d in enumerate(lane)}  # fmt: skip


# -- the pipeline computes the whole model's gradients ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "layers_per_stage, micro_batch",
    [
        ([4], 1),  # one stage: no transport; the micro-batch split alone
        ([1, 3], 4), ([1, 3], 1), ([2, 2], 3),  # micro-batch 3 of 4: sizes 3 and 1
        ([1, 1, 1, 1], 4), ([1, 1, 1, 1], 1),
    ],
    ids=["1stage-M4", "2stages-M1", "2stages-M4", "2stages-M2-uneven", "4stages-M1", "4stages-M4"],
)  # fmt: skip
def test_tcp_pipeline_matches_the_whole_model(layers_per_stage, micro_batch, tmp_path, peers, reference):
    plan = make_plan(layers_per_stage, micro_batch)
    loss, grads, routes = run_pipeline(tmp_path, peers, plan, tcp_book(plan.devices, peers.out), "tcp")
    assert_matches_reference(loss, grads, reference)
    assert routes == {d: {n: "tcp" for n in ns} for d, ns in neighbours(plan).items()}


@pytest.fixture(scope="module")
def p2p_keys(tmp_path_factory):
    """P2P keys of d0 and d1 and their peer ids."""
    return make_keys(tmp_path_factory.mktemp("keys"), ("d0", "d1"))


def p2p_maddr(peer_id: str) -> str:
    return f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{peer_id}"


@pytest.mark.slow
def test_p2p_pipeline_matches_the_whole_model(tmp_path, peers, reference, p2p_keys):
    plan = make_plan([2, 2], 1)
    book = AddressBook({d: PeerAddress(p2p=(p2p_maddr(p2p_keys[d][1]),)) for d in plan.devices})
    loss, grads, routes = run_pipeline(
        tmp_path, peers, plan, book, "p2p", extra=lambda d: ("--identity", p2p_keys[d][0])
    )
    assert_matches_reference(loss, grads, reference)
    assert routes == {"d0": {"d1": "p2p"}, "d1": {"d0": "p2p"}}


@pytest.mark.slow
def test_refused_direct_address_falls_back_to_p2p(tmp_path, peers, reference, p2p_keys):
    """The book's direct addresses are closed ports (each peer listens elsewhere): every frame goes over P2P."""
    plan = make_plan([2, 2], 1)
    closed = {d: free_port() for d in plan.devices}  # nobody listens there
    keys = link_keys(plan.devices, peers.out)
    book = AddressBook({d: PeerAddress(direct=("127.0.0.1", closed[d]), p2p=(p2p_maddr(p2p_keys[d][1]),), key=keys[d])
                        for d in plan.devices})
    extra = lambda d: ("--identity", p2p_keys[d][0], "--listen", f"127.0.0.1:{free_port()}")  # noqa: E731
    loss, grads, routes = run_pipeline(tmp_path, peers, plan, book, "auto", extra=extra)
    assert_matches_reference(loss, grads, reference)
    assert routes == {"d0": {"d1": "p2p"}, "d1": {"d0": "p2p"}}


# -- a neighbour that is not there ---------------------------------------------------------------------------


def assert_failed_naming(peers: Peers, device: str, culprit: str) -> dict:
    assert peers.wait(device) == 3, peers.logs()  # pipeline_peer's exit code for a TransportError
    error = peers.result(device)["error"]
    assert error["type"] in ("TransportTimeout", "PeerUnreachable"), error
    assert culprit in error["message"], error
    return error


@pytest.mark.slow
def test_stage0_fails_when_the_next_peer_never_starts(tmp_path, peers):
    plan = make_plan([2, 2], 1)
    plan_path = write(tmp_path / "plan.json", plan.to_wire())
    book_path = write(tmp_path / "addresses.json", tcp_book(plan.devices, peers.out).to_wire())
    peers.start(plan_path, "d0", book_path, "tcp", "--timeout", "2")
    assert_failed_naming(peers, "d0", "d1")
    assert not (peers.out / "d0.npz").exists()


@pytest.mark.slow
def test_stage0_fails_when_the_next_peer_dies_mid_step(tmp_path, peers):
    plan = make_plan([2, 2], 1)  # four micro-batches: d1 dies after the first
    plan_path = write(tmp_path / "plan.json", plan.to_wire())
    book_path = write(tmp_path / "addresses.json", tcp_book(plan.devices, peers.out).to_wire())
    peers.start(plan_path, "d1", book_path, "tcp", "--die-after-first-activation")
    peers.wait_ready("d1")  # so d0 reaches it: the failure is the death, not a refused connection
    peers.start(plan_path, "d0", book_path, "tcp", "--timeout", "2")
    assert peers.wait("d1") == -signal.SIGKILL, peers.logs()  # it got an activation, then died
    error = assert_failed_naming(peers, "d0", "d1")
    assert "gradient" in error["message"] or "sending to d1" in error["message"], error


# -- bad frames over a real socket ---------------------------------------------------------------------------


def frame(kind: str, tensor: torch.Tensor, *, sender: str = "d0", step: int = 0, micro: int = 0,
          corrupt: bool = False) -> bytes:  # fmt: skip
    dtype, payload = encode(tensor, "raw")
    payload = bytes(payload)
    header = FrameHeader(
        kind=kind, dtype=dtype, shape=tuple(tensor.shape), sender=sender, step=step, micro=micro,
        checksum=checksum(payload),
    )  # fmt: skip
    if corrupt:
        payload = bytes(len(payload))  # the bytes change in flight; the checksum is the original's
    return header.encode() + payload


def closed_by_peer(sock: socket.socket) -> bool:
    """True when the other end closed the connection (without us sending more) before the socket's timeout."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def wait_for(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_bad_frames_are_refused_and_the_worker_goes_on(tmp_path):
    """The test plays stage 0 with raw sockets against a real stage-1 peer (transport and worker)."""
    plan = make_plan([2, 2], BATCH)  # one micro-batch of 4 sequences
    max_frame_bytes = 100_000  # above the activation's 65,536 bytes, below the oversize frame's 131,072
    batch = Corpus.default().batch(position=0, sequences=BATCH, seq_len=SPEC.seq_len, seed=0)
    tokens, labels = torch.from_numpy(batch.tokens), torch.from_numpy(batch.labels)
    with torch.no_grad():
        activation = build_stage(SPEC, 0, 2)(tokens)
    # what stage 1 must compute from that activation
    stage1 = build_stage(SPEC, 2, 4)
    x = activation.clone().requires_grad_()
    expected_loss = stage1.loss(stage1(x), labels)
    expected_loss.backward()

    fake_stage0 = socket.create_server(("127.0.0.1", 0))  # where stage 1 sends its gradient
    fake_stage0.settimeout(30)
    d1_port = free_port()
    book = AddressBook({
        "d0": PeerAddress(direct=fake_stage0.getsockname()),
        "d1": PeerAddress(direct=("127.0.0.1", d1_port)),
    })  # fmt: skip
    transport = NetworkTransport("d1", book, [TcpLink("127.0.0.1", d1_port)], max_frame_bytes=max_frame_bytes)
    transport.start()
    inbox = transport.inbox
    outcome: dict = {}
    try:
        worker = StageWorker(plan, "d1", transport, None, WorkerConfig(timeout_s=30))

        def run() -> None:
            try:
                outcome["result"] = worker.compute()
            except BaseException as error:  # reported by the assertions below
                outcome["error"] = error

        thread = threading.Thread(target=run, daemon=True)
        thread.start()

        def send(data: bytes) -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", d1_port), timeout=20)
            sock.sendall(data)
            return sock

        def refused(data: bytes, sender: str) -> tuple[socket.socket, str]:
            """Send on a new connection; the reason the peer gave for refusing it."""
            seen = len(inbox.rejections)
            sock = send(data)
            wait_for(lambda: len(inbox.rejections) > seen, "a rejection")
            assert len(inbox.rejections) == seen + 1
            claimed, reason = inbox.rejections[-1]
            assert claimed == sender
            return sock, reason

        # (a) garbage: the stream is closed and counted against the connection it came on
        with send(b"GET / HTTP/1.1\r\nHost: d1\r\n\r\n") as sock:
            wait_for(lambda: len(inbox.rejections) == 1, "the garbage to be refused")
            assert closed_by_peer(sock)
        claimed, reason = inbox.rejections[-1]
        assert claimed.startswith("tcp 127.0.0.1:") and "garbage" in reason and "not a hetpeer frame" in reason
        assert inbox.misbehaving[claimed] == 1

        # (b) a header announcing a payload far over the frame limit: refused, connection closed
        oversize = FrameHeader(kind="activation", dtype="fp32", shape=(BATCH, SPEC.seq_len, 8 * 2**20 // 4 // 256),
                               sender="d0", step=0)  # fmt: skip
        assert oversize.payload_bytes > max(max_frame_bytes, 2**20)
        sock, reason = refused(oversize.encode(), "d0")  # the payload is never sent
        with sock:
            assert closed_by_peer(sock)  # it did not wait for the payload
        assert "frame limit" in reason and str(oversize.payload_bytes) in reason

        cases = {
            "checksum": (frame("activation", activation, corrupt=True), "d0", "checksum"),
            "shape": (frame("activation", activation[..., :32].contiguous()), "d0",
                      "activation is fp32[4, 64, 32], expected fp32[4, 64, 64]"),
            "dtype": (frame("activation", activation.to(torch.bfloat16)), "d0",
                      "activation is bf16[4, 64, 64], expected fp32[4, 64, 64]"),
            "step": (frame("activation", activation, step=7), "d0", "step 7 is not 0 or the next"),
            "labels dtype": (frame("labels", labels.to(torch.int32)), "d0", "labels is int32[4, 64], expected int64"),
            "sender": (frame("activation", activation, sender="mallory"), "mallory",
                       "mallory is not a neighbour of d1"),
        }  # fmt: skip
        for case, (data, sender, words) in cases.items():
            sock, reason = refused(data, sender)
            sock.close()
            assert words in reason, (case, reason)
        assert inbox.misbehaving["d0"] == 6
        assert inbox.misbehaving["mallory"] == 1
        assert thread.is_alive() and not outcome, outcome  # the worker still waits for its input

        # the right frames: the worker finishes the step and sends the gradient of its input back
        with send(frame("activation", activation) + frame("labels", labels)):
            gradient_stream, _ = fake_stage0.accept()
        with gradient_stream:
            gradient_stream.settimeout(30)
            prefix = recv_exactly(gradient_stream, PREFIX.size)
            header = decode_header(recv_exactly(gradient_stream, header_length(prefix)))
            gradient = decode(header, bytearray(recv_exactly(gradient_stream, header.payload_bytes)))
        thread.join(timeout=HANG_GUARD_S)
        assert not thread.is_alive(), "the worker hung"
        assert "error" not in outcome, outcome.get("error")
        result = outcome["result"]
    finally:
        transport.shutdown()
        fake_stage0.close()

    assert (header.kind, header.sender, header.step, header.micro) == ("gradient", "d1", 0, 0)
    assert torch.linalg.norm(gradient - x.grad) <= RTOL * torch.linalg.norm(x.grad)
    assert result.loss == pytest.approx(expected_loss.item(), rel=RTOL)
    for name, p in worker.model.named_parameters():
        expected = dict(stage1.named_parameters())[name].grad
        assert torch.linalg.norm(p.grad - expected) <= RTOL * torch.linalg.norm(expected), name
    assert sum(inbox.misbehaving.values()) == 8  # nothing else was refused, the good frames included


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"stream ended after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def test_frame_over_the_limit_is_refused_before_its_payload():
    """A header announcing more than `max_frame_bytes` closes the connection before a byte of payload is read
    (inbox.py: "the frame limit (checked on the header, before a byte of payload is read)"), even when the
    announced payload is small in absolute terms."""
    max_frame_bytes = 100_000
    port = free_port()
    book = AddressBook(
        {"d0": PeerAddress(direct=("127.0.0.1", free_port())), "d1": PeerAddress(direct=("127.0.0.1", port))}
    )
    transport = NetworkTransport("d1", book, [TcpLink("127.0.0.1", port)], max_frame_bytes=max_frame_bytes)
    transport.start()
    try:
        oversize = FrameHeader(kind="activation", dtype="fp32", shape=(BATCH, SPEC.seq_len, 2 * SPEC.hidden),
                               sender="d0", step=0)  # fmt: skip
        assert max_frame_bytes < oversize.payload_bytes < 2**20
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(oversize.encode())  # and never the payload
            assert closed_by_peer(sock), "the peer waits for the payload of a frame over its limit"
        wait_for(lambda: transport.inbox.misbehaving["d0"] == 1, "the frame to be counted", timeout_s=5)
        sender, reason = transport.inbox.rejections[-1]
        assert sender == "d0" and "frame limit" in reason and "connection closed" in reason, reason
    finally:
        transport.shutdown()
