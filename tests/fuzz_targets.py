"""What the fuzz tests (tests/unit/test_fuzz.py, tests/integration/test_fuzz_api.py) and benchmarks/fuzz.py
throw at hetpeer's parsers, and what they hold them to.

Each `Target` pairs a hypothesis strategy with a `run` that feeds one drawn input through the real entry
point. `run` returns a label: "accepted", or the name of the exception the parser is allowed to refuse
with (FrameError, SchemaError), after checking that the refusal is clear (one line, naming the field or
the problem). Anything else `run` raises -- another exception type, or an AssertionError from an
invariant of what was accepted -- is a crash. The tests run a bounded number of examples; the benchmark
runs each target for a while and counts.

Inputs are either arbitrary (random bytes, random JSON-like values) or mutations of a valid input
(bit flips, truncation, huge declared lengths and shapes, fields of the wrong type, NaN and infinities,
integers past a float's range), so that most of them get past the first check.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from hetpeer.peer.transport.codec import TORCH_DTYPES, PayloadCheck, checksum, decode, encode
from hetpeer.peer.transport.inbox import Inbox, Late
from hetpeer.protocol.addresses import AddressBook, PeerAddress
from hetpeer.protocol.frame import (
    BLOCKED_CODECS,
    _FIXED,
    CODECS,
    DTYPES,
    FLOAT_DTYPES,
    KINDS,
    MAX_HEADER_BYTES,
    MAX_NDIM,
    PREFIX,
    FrameError,
    FrameHeader,
    decode_header,
    header_length,
    payload_bytes,
)
from hetpeer.protocol.join import JoinInfo
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.identity import device_id
from hetpeer.protocol.records import LinkMeasurement, PeerRecord, plan_from_wire
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.wire import SchemaError


def fuzz_settings(max_examples: int) -> settings:
    """Bounded and deterministic (derandomized, no example database) for CI."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@dataclass(frozen=True)
class Target:
    name: str
    strategy: st.SearchStrategy
    run: Callable[[Any], str]  # "accepted" or the allowed exception's name; raises on a crash


def clear(error: Exception, root: str | None = None) -> str:
    """The refusal's label, once it is one clear line; a SchemaError must name a path under `root`."""
    text = str(error)
    assert len(text) >= 8 and "\n" not in text, f"unclear refusal {error!r}"
    if isinstance(error, SchemaError):
        shown = error.path if error.path.isprintable() else repr(error.path)[1:-1]
        assert text.startswith(f"{shown}: ") and len(text) > len(shown) + 4, f"no reason after the path: {text!r}"
        if root is not None:
            top = error.path.split(".")[0].split("[")[0]
            assert top in (root, *ROOTS.get(root, ())), f"path {error.path!r} not under {root!r}"
    return type(error).__name__


ROOTS = {"plan_record": ("plan",)}  # a plan record's errors name the record or the plan in it


# -- values -------------------------------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")
SPECIAL = [0, 1, -1, 2**31, 2**32, 2**63, -(2**63), 2**64, 10**400, -(10**400), 0.0, -0.0, 5e-324, 1e-300, 65504.0,
           70000.0, 3.4e38, 1e300, 1.7e308, -1.7e308, NAN, INF, -INF, True, False, None, "", "0", "NaN", "x" * 300]
scalars = st.one_of(
    st.sampled_from(SPECIAL),
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12),
)


def values(keys: st.SearchStrategy) -> st.SearchStrategy:
    return st.recursive(
        scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4), max_leaves=10
    )


json_keys = st.text(max_size=10)
json_values = values(json_keys)  # what JSON text parses to
# what a Python caller or msgpack may hand over besides: keys that are not strings
any_keys = st.one_of(json_keys, st.integers(-2, 2))
any_values = values(any_keys)


def _nodes(value: Any, path: tuple = ()) -> list[tuple]:
    """Every position in a JSON-like value, the root included, as a path of keys and indices."""
    found = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            found += _nodes(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += _nodes(v, path + (i,))
    return found


def _get(value: Any, path: tuple) -> Any:
    for step in path:
        value = value[step]
    return value


def _edit_scalar(draw, value: Any, values: st.SearchStrategy) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        nearby = [value + 1, value - 1, -value, value * 2, 2**64 + 1, 10**400]
        try:
            nearby += [value * 1e300, float(value)]  # an integer past a float's range has no such neighbours
        except OverflowError:
            pass
        return draw(st.sampled_from(nearby))
    if isinstance(value, str):
        return draw(st.sampled_from([value + "x", value[:-1], value.upper(), value * 40, value + "\x00", value + "é",
                                     f"[{value}]", "[]" + value]))
    return draw(values)


@st.composite
def mutated(draw, valid: Any, max_edits: int = 3, keys: st.SearchStrategy = any_keys) -> Any:
    """`valid` with 1..max_edits edits at random places: replaced, nudged, deleted, duplicated, or an extra key."""
    doc, json_values = copy.deepcopy(valid), values(keys)
    for _ in range(draw(st.integers(1, max_edits))):
        path = draw(st.sampled_from(_nodes(doc)))
        op = draw(st.sampled_from(["replace", "nudge", "delete", "duplicate", "add"]))
        node = _get(doc, path)
        if op == "replace" or (op in ("delete", "duplicate") and not path):
            new = draw(json_values)
        elif op == "nudge":
            new = _edit_scalar(draw, node, json_values) if not isinstance(node, (dict, list)) else draw(json_values)
        elif op == "add" and isinstance(node, dict):
            node[draw(st.one_of(keys, st.sampled_from(sorted(map(str, node)) or ["x"])))] = draw(json_values)
            continue
        elif op == "add" and isinstance(node, list):
            node.insert(draw(st.integers(0, len(node))), draw(json_values))
            continue
        elif op == "add":
            new = [node, node]
        elif op == "delete":
            del _get(doc, path[:-1])[path[-1]]
            continue
        else:
            parent = _get(doc, path[:-1])
            if isinstance(parent, list):
                parent.insert(path[-1], copy.deepcopy(node))
                continue
            new = copy.deepcopy(parent)  # a dict: the key now holds its whole parent
        if path:
            _get(doc, path[:-1])[path[-1]] = new
        else:
            doc = new
    return doc


def documents(valid: Any, keys: st.SearchStrategy = any_keys) -> st.SearchStrategy:
    """Mostly mutations of `valid`, sometimes the valid document itself or a random value."""
    return st.one_of(mutated(valid, keys=keys), st.just(valid), values(keys))


# -- frame headers --------------------------------------------------------------------------------------

senders = st.one_of(st.sampled_from(["p0", "p1", "peer-a"]), st.text(min_size=1, max_size=32).filter(str.isprintable))


@st.composite
def frame_headers(draw, small: bool = False) -> FrameHeader:
    """A valid header; `small`: a tensor of at most 512 elements, else any shape the format allows."""
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    codec = draw(st.sampled_from([c for c in CODECS if c == "raw" or dtype in FLOAT_DTYPES]))
    dim = st.integers(0, 8) if small else st.one_of(st.integers(0, 8), st.sampled_from([2**16, 2**31, 2**32 - 1]))
    shape = tuple(draw(st.lists(dim, min_size=int(codec in BLOCKED_CODECS), max_size=3 if small else MAX_NDIM)))
    while payload_bytes(dtype, shape, codec) >= 2**64:  # past what the header's payload field can declare
        shape = shape[:-1]
    return FrameHeader(
        kind=draw(st.sampled_from(KINDS)), dtype=dtype, shape=shape, sender=draw(senders),
        step=draw(st.integers(0, 2**64 - 1)), micro=draw(st.integers(0, 2**32 - 1)), epoch=draw(st.integers(0, 2**32 - 1)),
        codec=codec, checksum=draw(st.integers(0, 2**64 - 1)),
    )


_FIELDS = ("version", "kind", "dtype", "codec", "ndim", "epoch", "step", "micro", "size", "checksum")
_FIELD_AT = {
    name: (PREFIX.size + struct.calcsize("<" + _FIXED.format[1:][:i]), "<" + _FIXED.format[1:][i])
    for i, name in enumerate(_FIELDS)
}


def _interesting(bits: int) -> st.SearchStrategy:
    top = 2**bits - 1
    return st.one_of(st.sampled_from([0, 1, 2, 8, 9, 255, top, top - 1, top // 2]), st.integers(0, top))


@st.composite
def frames(draw) -> bytes:
    """A frame's prefix and header (no payload): random bytes, or a valid one mutated."""
    if draw(st.integers(0, 5)) == 0:
        return draw(st.binary(max_size=2 * MAX_HEADER_BYTES))
    frame = bytearray(draw(frame_headers()).encode())
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["flip", "byte", "truncate", "extend", "field", "length", "dim", "sender"]))
        at = draw(st.integers(0, max(0, len(frame) - 1)))
        if op == "flip" and frame:
            frame[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte" and frame:
            frame[at] = draw(st.integers(0, 255))
        elif op == "truncate":
            del frame[at:]
        elif op == "extend":
            frame += draw(st.binary(min_size=1, max_size=64))
        elif op == "field":
            offset, fmt = _FIELD_AT[draw(st.sampled_from(_FIELDS))]
            if len(frame) >= offset + struct.calcsize(fmt):
                struct.pack_into(fmt, frame, offset, draw(_interesting(8 * struct.calcsize(fmt))))
        elif op == "length" and len(frame) >= PREFIX.size:
            choices = st.one_of(_interesting(32), st.integers(_FIXED.size - 1, MAX_HEADER_BYTES + 1))
            struct.pack_into("<I", frame, 4, draw(choices))
        elif op == "dim" and len(frame) >= PREFIX.size + _FIXED.size + 4:
            ndim = min(frame[PREFIX.size + 4], (len(frame) - PREFIX.size - _FIXED.size) // 4)
            if ndim:
                at = PREFIX.size + _FIXED.size + 4 * draw(st.integers(0, ndim - 1))
                struct.pack_into("<I", frame, at, draw(_interesting(32)))
        elif op == "sender" and len(frame) > PREFIX.size + _FIXED.size:
            end = PREFIX.size + _FIXED.size + 4 * frame[PREFIX.size + 4]
            if end < len(frame):
                frame[end] = draw(st.sampled_from([0, 1, 127, 128, 129, 255, max(0, len(frame) - end - 2)]))
    return bytes(frame)


def run_frame(frame: bytes) -> str:
    """The receiving side's order: the prefix's header length, then the header of exactly that many bytes
    (or, when the prefix is refused, whatever follows it: `decode_header` must stand on its own)."""
    body = frame[PREFIX.size :]
    try:
        length = header_length(frame[: PREFIX.size])
        assert _FIXED.size < length <= MAX_HEADER_BYTES, length
        body = body[:length]
    except FrameError as error:
        clear(error)
    try:
        header = decode_header(body)
    except FrameError as error:
        return clear(error)
    assert header.payload_bytes == payload_bytes(header.dtype, header.shape, header.codec), header
    canonical = header.encode()[PREFIX.size :]
    assert decode_header(canonical) == header, "a decoded header does not survive its own encoding"
    # the same fields, bytes for bytes; only the zero padding after the sender may differ in length
    core = _FIXED.size + 4 * len(header.shape) + 1 + len(header.sender.encode())
    assert body[:core] == canonical[:core] and not any(body[core:]), "a decoded header encodes to other bytes"
    return "accepted"


# -- payloads --------------------------------------------------------------------------------------------

FLOAT_SPECIALS = [NAN, INF, -INF, 65504.0, 65520.0, 70000.0, 3.4e38, -3.4e38, -0.0, 1e-45, 1e-8]


@st.composite
def payload_cases(draw) -> tuple[FrameHeader, bytes, tuple[int, ...], torch.Tensor | None]:
    """(header, payload, split points, expected tensor or None): a sender's real encoding of a small
    tensor (with NaN, infinities or near-overflow values at times), then broken one way or another."""
    header = draw(frame_headers(small=True))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    dtype = TORCH_DTYPES[header.dtype]
    if header.dtype in FLOAT_DTYPES:
        scale = draw(st.sampled_from([1.0, 1e4, 6e4, 1e30, 3e38]))
        tensor = (torch.randn(header.shape, generator=generator) * scale).to(dtype)
        flat = tensor.view(-1)
        for index, value in draw(st.lists(st.tuples(st.integers(0, 511), st.sampled_from(FLOAT_SPECIALS)), max_size=3)):
            if flat.numel():
                flat[index % flat.numel()] = value
    else:
        tensor = torch.randint(0, 255, header.shape, generator=generator).to(dtype)
    _, view = encode(tensor, header.codec)
    payload = bytes(view)
    sum_ = checksum(payload)
    op = draw(st.sampled_from(["none", "flip", "truncate", "extend", "checksum", "random", "resize", "inject", "reshape"]))
    if op == "flip" and payload:
        at = draw(st.integers(0, len(payload) - 1))
        payload = payload[:at] + bytes([payload[at] ^ (1 << draw(st.integers(0, 7)))]) + payload[at + 1 :]
    elif op == "truncate":
        payload = payload[: draw(st.integers(0, len(payload)))]
    elif op == "extend":
        payload += draw(st.binary(min_size=1, max_size=16))
    elif op == "checksum":
        sum_ = draw(st.integers(0, 2**64 - 1))
    elif op in ("random", "resize"):  # arbitrary bit patterns behind a correct checksum
        size = len(payload) if op == "random" else draw(st.integers(0, 2 * len(payload) + 8))
        payload = torch.randint(0, 256, (size,), generator=generator, dtype=torch.uint8).numpy().tobytes()
        sum_ = checksum(payload)
    elif op == "inject" and header.dtype in FLOAT_DTYPES and payload:
        # a float in the region a receiver checks: the tensor, its 16-bit form, or a blocked frame's scales
        region_dtype = (torch.float32 if header.codec in BLOCKED_CODECS
                        else TORCH_DTYPES[header.dtype if header.codec == "raw" else header.codec])
        width = region_dtype.itemsize
        region = -(-header.numel // 64) * 4 if header.codec in BLOCKED_CODECS else len(payload)
        if region >= width:
            at = draw(st.integers(0, region // width - 1)) * width
            value = draw(st.sampled_from([NAN, INF, -INF, 3.4e38, 65504.0, 1e30]))
            patch = bytearray(payload)
            patch[at : at + width] = torch.tensor([value], dtype=region_dtype).view(torch.uint8).numpy().tobytes()
            payload = bytes(patch)
            sum_ = checksum(payload)
    elif op == "reshape":
        other = draw(st.one_of(frame_headers(small=True), frame_headers()))
        codec = other.codec if header.dtype in FLOAT_DTYPES else "raw"
        if (codec not in BLOCKED_CODECS or other.shape) and payload_bytes(header.dtype, other.shape, codec) < 2**64:
            header = dataclasses.replace(header, shape=other.shape, codec=codec, payload_bytes=-1)
    header = dataclasses.replace(header, checksum=sum_)
    splits = tuple(sorted(draw(st.lists(st.integers(0, len(payload)), max_size=3))))
    expected = tensor if op == "none" and header.codec == "raw" else None
    return header, payload, splits, expected


def _decoded(header: FrameHeader, payload: bytearray, check: PayloadCheck | None) -> str | torch.Tensor:
    try:
        tensor = decode(header, payload, check)
    except FrameError as error:
        return clear(error)
    assert tuple(tensor.shape) == header.shape and tensor.dtype == TORCH_DTYPES[header.dtype], (tensor.shape, tensor.dtype)
    if header.dtype in FLOAT_DTYPES:
        assert bool(torch.isfinite(tensor).all()), f"a {header.codec} frame of {header.dtype} decoded to non-finite values"
    return tensor


def run_payload(case: tuple[FrameHeader, bytes, tuple[int, ...], torch.Tensor | None]) -> str:
    """`decode` fed the whole payload, and fed a `PayloadCheck` chunk by chunk: the same verdict."""
    header, payload, splits, expected = case
    whole = _decoded(header, bytearray(payload), None)
    buffer, check = bytearray(payload), PayloadCheck(header)
    for end in (*splits, len(buffer)):
        check.update(buffer, end)
    chunked = _decoded(header, buffer, check)
    if isinstance(whole, str):
        assert whole == chunked, (whole, chunked)
        return whole
    assert isinstance(chunked, torch.Tensor) and torch.equal(whole, chunked), "chunked and whole checks disagree"
    if expected is not None:
        assert torch.equal(whole.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), "raw bytes changed"
    return "accepted"


# -- the inbox ---------------------------------------------------------------------------------------------

@st.composite
def inbox_cases(draw) -> tuple[int, list[tuple[FrameHeader, bytes]]]:
    """(max_frame_bytes, frames): small frames (sometimes declaring huge shapes) from a few senders, with
    colliding steps so that duplicates occur."""
    limit = draw(st.sampled_from([1, 256, 4096, 1 << 30]))
    offered = []
    for _ in range(draw(st.integers(1, 5))):
        header, payload, _, _ = draw(payload_cases())
        if draw(st.integers(0, 4)) == 0:
            header = draw(frame_headers())  # a declared size unrelated to the payload
        header = dataclasses.replace(
            header, kind=draw(st.sampled_from(KINDS)), sender=draw(st.sampled_from(["a", "b"]) | senders),
            step=draw(st.integers(0, 2)), micro=draw(st.integers(0, 1)),
        )
        offered.append((header, payload))
    return limit, offered


def _policy(header: FrameHeader) -> str | None:
    if header.kind == "gradient":
        return "no gradients expected here"
    if header.kind == "labels" and header.step == 0:
        return Late("step 0 is done")
    if header.kind == "tied":
        raise RuntimeError("a policy bug")  # the inbox must survive it
    return None


def run_inbox(case: tuple[int, list[tuple[FrameHeader, bytes]]]) -> str:
    """Frames screened, refused or offered as a transport does: nothing raises, every refusal is counted,
    every accepted frame can be received, nothing past the frame limit is decoded."""
    limit, offered = case
    inbox = Inbox("me", max_frame_bytes=limit, policy=_policy)
    handled: list[FrameHeader] = []
    inbox.handlers["probe"] = lambda header, tensor: handled.append(header)
    stored, refused, late = [], 0, 0
    for header, payload in offered:
        reason = inbox.screen(header)
        if header.payload_bytes > limit:
            assert reason is not None and "frame limit" in reason, reason
        if reason is not None:
            inbox.refuse(header, reason)
            late += isinstance(reason, Late)
            refused += not isinstance(reason, Late)
        else:
            was_late = inbox.late
            if inbox.offer(header, bytearray(payload)):
                if header.kind != "probe":
                    stored.append(header)
            elif inbox.late > was_late:  # an older plan's frame after a newer one's for the same step: late, no fault
                late += 1
            else:
                refused += 1
    assert sum(inbox.misbehaving.values()) == refused and inbox.late == late, (inbox.misbehaving, refused, inbox.late, late)
    assert len(inbox.rejections) == min(refused, inbox.rejections.maxlen)
    assert all(reason for _, reason in inbox.rejections)
    for header in stored:
        tensor = inbox.recv(header.kind, header.sender, header.step, header.micro, timeout_s=0)
        assert tuple(tensor.shape) == header.shape
    return "refused" if refused else "accepted"


# -- peer records ------------------------------------------------------------------------------------------

KEY = b"ssh-rsa AAAAkey-of-the-signer"  # fingerprint() hashes any bytes: no RSA needed
NOW, MAX_AGE_S = 1_000_000.0, 60.0
P2P = "/ip4/127.0.0.1/tcp/4001/p2p/QmPeer"


def peer_record(name: str = "gpu0", **changes: Any) -> PeerRecord:
    fields: dict[str, Any] = dict(
        device_id=device_id(name, KEY), model="tiny", dtype="fp16", device_name="NVIDIA H100", tflops=312.5,
        memory_bytes=80 << 30, address=PeerAddress(direct=("10.0.0.7", 7000), p2p=(P2P,)), state="training",
        time=NOW - 1.5, epoch=3, layers=(4, 8), step=120, loss=2.75, val_loss=2.9, checkpoint=(4, 8, 100, 1600),
        tokens_per_s=1234.5,
        links={"gpu1-0123456789ab": LinkMeasurement(0.012, 1.25e8), "cpu2-000000000000": LinkMeasurement(0.0, 3.0e6)},
        dht=("/dns4/peer1/tcp/31338/p2p/12D3KooWDhtNode",), achieved_tflops=250.0, software="hetpeer 0.1",
    )
    fields.update(changes)
    return PeerRecord(**fields)


PEER_WIRE = peer_record().to_wire()


def run_peer_record(raw: Any) -> str:
    try:
        record = PeerRecord.from_wire(raw, KEY, NOW, MAX_AGE_S)
    except SchemaError as error:
        return clear(error, "peer")
    assert PeerRecord.from_wire(record.to_wire(), KEY, NOW, MAX_AGE_S) == record, "an accepted record does not round-trip"
    return "accepted"


# -- plans --------------------------------------------------------------------------------------------------

PLAN_WIRE = {
    "version": 1, "epoch": 3, "start_step": 100, "cost_model": "time", "model": "tiny", "layers": 6, "batch": 8,
    "micro_batch": 1, "micro_batches": 4, "dtype": "fp16",
    "stages": [
        {"index": 0, "layer_start": 0, "layer_end": 4, "devices": ["a", "b"], "sync": "allreduce"},
        {"index": 1, "layer_start": 4, "layer_end": 6, "devices": ["c", "d"], "sync": "gossip"},
    ],
    "lanes": [["a", "c"], ["b", "d"]], "standby": ["e"], "cost": {"total_s": 1.5, "sync_s": 0.25},
    "estimated_links": [["a", "d"]], "recipe": {"lr": 1e-3, "eval_every": 10, "eval_batch": 2},
}


@st.composite
def plan_cases(draw) -> tuple[str, Any]:
    """("plan", a plan's wire form) for `Plan.from_wire` (plan files, the API client), or ("record", a DHT
    plan record) for `plan_from_wire`: the plan as JSON text, that text cut or spliced at times."""
    doc = draw(documents(PLAN_WIRE))  # Plan.from_wire takes any keys; plan_from_wire gets it through JSON
    if draw(st.booleans()):
        return "plan", doc
    try:
        text = json.dumps(doc)
    except (TypeError, ValueError):
        text = repr(doc)
    if draw(st.integers(0, 3)) == 0:
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(["", "[" * 3000, "1" * 5000, "\ud800", "}"])) + text[at + 1 :]
    record = {"plan": text, "time": draw(st.sampled_from([1000.0, NAN, 0.0]))}
    return "record", draw(st.one_of(st.just(record), mutated(record, max_edits=1)))


def run_plan(case: tuple[str, Any]) -> str:
    how, raw = case
    try:
        plan = Plan.from_wire(raw) if how == "plan" else plan_from_wire(raw)[0]
    except SchemaError as error:
        return clear(error, "plan" if how == "plan" else "plan_record")
    assert Plan.from_wire(plan.to_wire()) == plan, "an accepted plan does not round-trip"
    return "accepted"


# -- topology, join and address files --------------------------------------------------------------------

TOPOLOGY_WIRE = {
    "name": "t", "description": "fuzzed",
    "devices": [
        {"id": "a0", "region": "a", "tflops": 100.0, "memory_gb": 16.0},
        {"id": "b0", "region": "b", "tflops": 50, "memory_gb": 24},
        {"id": "c0", "region": "c"},
    ],
    "regions": {"a": {"latency_ms": 1.0, "bandwidth_gbps": 10.0}, "b": {"latency_ms": 2.0, "bandwidth_gbps": 20.0},
                "c": {"latency_ms": 3.0, "bandwidth_gbps": 30.0}},
    "region_links": [{"a": "a", "b": "b", "latency_ms": 40.0, "bandwidth_gbps": 1.0},
                     {"a": "b", "b": "a", "latency_ms": 60.0, "bandwidth_gbps": 3.0}],
    "default_link": {"latency_ms": 200.0, "bandwidth_gbps": 0.5},
    "links": [{"a": "a0", "b": "c0", "latency_ms": 10.0, "bandwidth_gbps": 2.0}],
}


def run_topology(raw: Any) -> str:
    try:
        topology = Topology.from_wire(raw)
    except SchemaError as error:
        return clear(error, "topology")
    latency, bandwidth = topology.link_matrices()
    assert bool((latency >= 0).all() and (latency < INF).all()), f"latency out of range: {latency}"
    assert bool((bandwidth > 0).all() and (bandwidth < INF).all()), f"bandwidth out of range: {bandwidth}"
    assert Topology.from_wire(topology.to_wire()) == topology, "an accepted topology does not round-trip"
    return "accepted"


JOIN_WIRE = JoinInfo(
    "docker", "227589eb829af4308457c73f413bbec25bed31972677319fd300da405b61149e",
    ("/dns4/coordinator/tcp/31337/p2p/12D3KooWJ3bHAf2PgnY6i3btRPVaUxCGXLyQ6AzXL2PvQeVSJ4r1",), "tiny", "fp32",
).to_wire()


@st.composite
def join_cases(draw) -> tuple[str, Any]:
    """("wire", a join document) for `JoinInfo.from_wire`, or ("file", the file's bytes) for `JoinInfo.load`."""
    doc = draw(documents(JOIN_WIRE))
    if draw(st.booleans()):
        return "wire", doc
    try:
        data = json.dumps(doc).encode()
    except (TypeError, ValueError):
        data = repr(doc).encode()
    op = draw(st.sampled_from(["none", "cut", "garbage", "huge", "latin1"]))
    if op == "cut":
        data = data[: draw(st.integers(0, len(data)))]
    elif op == "garbage":
        data = draw(st.binary(max_size=64))
    elif op == "huge":
        data = b" " * (64 << 10) + data
    elif op == "latin1":
        data = data.replace(b"docker", "döcker".encode("latin-1"))
    return "file", data


_files = threading.local()


def run_join(case: tuple[str, Any]) -> str:
    how, raw = case
    try:
        if how == "wire":
            info = JoinInfo.from_wire(raw)
        else:
            if not hasattr(_files, "dir"):
                _files.dir = tempfile.TemporaryDirectory(prefix="hetpeer-fuzz-")
            path = Path(_files.dir.name) / "join.json"
            path.write_bytes(raw)
            info = JoinInfo.load(path)
    except SchemaError as error:
        return clear(error, "join")
    assert JoinInfo.from_wire(info.to_wire()) == info
    return "accepted"


BOOK_WIRE = AddressBook({
    "a": PeerAddress(direct=("10.0.0.1", 7000), p2p=("/ip4/10.0.0.1/tcp/4001/p2p/QmA",)),
    "b": PeerAddress(direct=("[::1]", 7001)),
    "c": PeerAddress(p2p=("/ip4/10.0.0.3/tcp/4001/p2p/QmC", "/ip6/::1/tcp/4001/p2p/QmC")),
}).to_wire()


def run_addresses(raw: Any) -> str:
    try:
        book = AddressBook.from_wire(raw)
    except SchemaError as error:
        return clear(error, "addresses")
    assert AddressBook.from_wire(book.to_wire()) == book
    return "accepted"


# -- the state server ---------------------------------------------------------------------------------------

STATE_DEVICES = ("donor", "p1", "p2")  # p2 is a known peer that is not reachable


class StateRig:
    """A donor's StateServer over MemoryTransport, serving two holdings ([0, 10) and [20, 26)), set up as the
    daemon sets it up; p1 (reachable) records the state frames it gets back."""

    HOLDINGS = ((0, 10), (20, 26))

    def __init__(self) -> None:
        from hetpeer.peer.gossip.adam import AdamConfig
        from hetpeer.peer.gossip.flat import FlatParams
        from hetpeer.peer.gossip.group import GroupSync, SyncConfig
        from hetpeer.peer.gossip.state import StateServer
        from hetpeer.peer.transport import MemoryHub, MemoryTransport
        from hetpeer.protocol.plan import StagePlan

        plan = Plan("time", "tiny", 4, 3, 1, 1, "fp32", (StagePlan(0, 0, 4, STATE_DEVICES, "gossip"),))
        self.hub = MemoryHub()
        self.donor = MemoryTransport("donor", self.hub)
        self.asker = MemoryTransport("p1", self.hub)
        self.now = 0.0  # the rate limits' clock: moved on between examples, so each starts within its limits
        self.server = StateServer(self.donor, "donor", known=lambda d: d in STATE_DEVICES, clock=lambda: self.now)
        self.syncs = []
        for i, (start, end) in enumerate(self.HOLDINGS):
            sync = GroupSync(plan, "donor", self.donor, FlatParams(torch.nn.Linear(end - start - 1, 1)),
                             AdamConfig(lr=1e-2, weight_decay=0.0), SyncConfig(chunk_bytes=16))
            for k, tensor in enumerate(sync.state_tensors()):
                tensor.copy_(torch.arange(start, end, dtype=torch.float32) + 1000 * k + 0.5)
            sync.state.step, sync.step = 40 + i, 50 + i
            self.server.hold(sync, start, end)
            self.syncs.append(sync)
        self.donor.set_policy(lambda h: self.server.accept(h) if h.kind in ("state_request", "state") else "not expected")
        self.replies: list[tuple[FrameHeader, torch.Tensor]] = []
        self.asker.inbox.handlers["state"] = lambda header, tensor: self.replies.append((header, tensor))
        self.donor.start()
        self.asker.start()


REQUEST_INTS = [-(2**63), -2, -1, 0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 19, 20, 25, 26, 27, 1 << 24, (1 << 24) + 1, 2**62, 2**63 - 1]


@st.composite
def state_requests(draw) -> list[tuple[FrameHeader, bytes]]:
    """1..4 frames at the donor: mostly well-formed state requests [k, start, length] with values at and
    around its holdings' edges, from known, unknown and unreachable senders; some of the wrong kind,
    dtype or shape, or with a bad checksum."""
    offered = []
    for micro in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):  # one the donor can serve: within one holding, tensor k of 4, or a description
            lo, hi = draw(st.sampled_from(StateRig.HOLDINGS))
            start = draw(st.integers(lo, hi - 1))
            values = [draw(st.integers(-1, 3)), start, draw(st.integers(1, hi - start))]
        else:
            any_int = st.integers(-(2**63), 2**63 - 1)
            values = [draw(st.sampled_from(REQUEST_INTS) | any_int) for _ in range(3)]
        tensor = torch.tensor(values, dtype=torch.int64)
        shape_op = draw(st.sampled_from(["request"] * 6 + ["short", "long", "float", "matrix"]))
        if shape_op == "short":
            tensor = tensor[:2]
        elif shape_op == "long":
            tensor = torch.cat([tensor, tensor])
        elif shape_op == "float":
            tensor = tensor.to(torch.float32)
        elif shape_op == "matrix":
            tensor = tensor.reshape(1, 3)
        dtype, payload = encode(tensor, "raw")
        header = FrameHeader(
            kind=draw(st.sampled_from(["state_request"] * 5 + ["state", "params"])), dtype=dtype, shape=tuple(tensor.shape),
            sender=draw(st.sampled_from(["p1"] * 6 + [*STATE_DEVICES, "stranger"]) if draw(st.integers(0, 4)) else senders),
            step=draw(st.integers(0, 2**64 - 1)),
            micro=micro, epoch=draw(st.integers(0, 3)),
            checksum=checksum(payload) if draw(st.integers(0, 7)) else draw(st.integers(0, 2**64 - 1)),
        )
        offered.append((header, bytes(payload)))
    return offered


_state_rig: list[StateRig] = []


def run_state(offered: list[tuple[FrameHeader, bytes]]) -> str:
    """Each frame delivered to the donor as off the wire: nothing raises; a reply goes only to the asker,
    only for a request its policy let through, and is exactly what the donor holds there, no more."""
    from hetpeer.peer.gossip.state import DESCRIBE, MAX_CHUNK_ELEMS

    if not _state_rig:
        _state_rig.append(StateRig())
    rig = _state_rig[0]
    rig.now += 1e6
    label = "refused"
    for header, payload in offered:
        rig.replies.clear()
        rig.donor.inbox.misbehaving.clear()  # random sender names would pile up across examples
        late = rig.donor.inbox.late
        accepted = rig.donor.deliver(header, payload)
        known = header.sender in STATE_DEVICES
        request = header.kind == "state_request" and header.shape == (3,) and header.dtype == "int64"
        if not (known and request):
            assert not accepted, f"{header} was accepted"
        if header.sender != "p1" or not accepted:
            assert not rig.replies, f"{len(rig.replies)} replies to a request by {header.sender}"
            continue
        assert len(rig.replies) <= 1, rig.replies
        k, start, length = torch.frombuffer(bytearray(payload), dtype=torch.int64).tolist()
        if not rig.replies:
            refusals = sum(rig.donor.inbox.misbehaving.values()) + rig.donor.inbox.late - late
            assert refusals == 1, "a request left unanswered without a reason"
            continue
        reply, tensor = rig.replies[0]
        assert (reply.step, reply.micro, reply.epoch) == (header.step, header.micro, header.epoch)
        if k == DESCRIBE:
            assert tensor.shape == (5,)
            label = "described"
            continue
        assert 0 < length <= MAX_CHUNK_ELEMS and tensor.shape == (length,), (k, start, length, tensor.shape)
        holding = next(i for i, (lo, hi) in enumerate(StateRig.HOLDINGS) if lo <= start and start + length <= hi)
        lo = StateRig.HOLDINGS[holding][0]
        assert torch.equal(tensor, rig.syncs[holding].state_tensors()[k][start - lo : start - lo + length])
        label = "served"
    return label


# -- the coordinator's gRPC API --------------------------------------------------------------------------------

API_METHODS = ("GetPlan", "ListPeers", "GetProgress")


class ApiRig:
    """An in-process ApiServer on 127.0.0.1 serving a fixed view, and a raw channel to it."""

    def __init__(self) -> None:
        import grpc

        from hetpeer.coordinator.api import ApiServer
        from hetpeer.coordinator.view import SwarmView

        peers = {r.device_id: r for r in (peer_record("gpu0"), peer_record("gpu1", state="standby", loss=None))}
        self.view = SwarmView("fuzz", "ab" * 32, Plan.from_wire(PLAN_WIRE), NOW - 5.0, peers, 1, NOW)
        self.server = ApiServer(lambda: self.view)
        self.server.start()
        self.channel = grpc.insecure_channel(self.server.address)
        self.grpc = grpc

    def call(self, method: str, request: bytes, timeout_s: float = 10.0) -> bytes:
        return self.channel.unary_unary(f"/hetpeer.Coordinator/{method}")(request, timeout=timeout_s)

    def check_serving(self) -> None:
        """A well-formed call still gets the view's answer."""
        from hetpeer.coordinator.api_client import ApiClient

        with ApiClient(self.server.address) as client:
            plan, _ = client.call_get_plan()
            assert plan == self.view.plan
            assert sorted(p.record.device_id for p in client.call_list_peers()) == sorted(self.view.peers)
            assert client.call_get_progress().swarm == "fuzz"

    def close(self) -> None:
        self.channel.close()
        self.server.shutdown(0)


@st.composite
def api_calls(draw) -> tuple[str, bytes]:
    """(method, request bytes): random bytes, a valid (empty) request with bytes appended, protobuf-looking
    fields, or a request over gRPC's 4 MiB limit; now and then a method the service does not have."""
    method = draw(st.sampled_from(API_METHODS * 3 + ("Nope", "getplan", "GetPlan/x", "")))
    kind = draw(st.sampled_from(["random"] * 3 + ["fields"] * 3 + ["huge"]))
    if kind == "random":
        return method, draw(st.binary(max_size=256))
    if kind == "huge":
        return method, b"\x0a\xff\xff\xff\x02" + bytes((4 << 20) + 16)
    fields = b""
    for _ in range(draw(st.integers(1, 4))):  # well-formed unknown fields of every wire type, or a broken one
        number, wire_type = draw(st.integers(1, 2**29 - 1)), draw(st.sampled_from([0, 1, 2, 5, 3, 4, 6, 7]))
        body = {
            0: _varint(draw(st.integers(0, 2**64 - 1))),
            1: draw(st.binary(min_size=8, max_size=8)),
            5: draw(st.binary(min_size=4, max_size=4)),
            2: _varint(len(data := draw(st.binary(max_size=32)))) + data,
        }.get(wire_type, draw(st.binary(max_size=8)))
        fields += _varint(number << 3 | wire_type) + body
    return method, fields


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def run_api(rig: ApiRig, case: tuple[str, bytes]) -> str:
    """A raw call: answered, or refused with a status that says the request was bad, never a server fault
    (UNKNOWN or INTERNAL: a handler raised) nor silence (UNAVAILABLE, DEADLINE_EXCEEDED)."""
    grpc = rig.grpc
    method, request = case
    # INVALID_ARGUMENT: a request that does not parse (the server parses its own: see `api._handlers`);
    # RESOURCE_EXHAUSTED: one over grpc's message size limit
    refusals = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED}
    try:
        reply = rig.call(method, request)
    except grpc.RpcError as error:
        assert error.code() in refusals, f"{method}: {error.code()}: {error.details()}"
        if error.code() == grpc.StatusCode.UNIMPLEMENTED:
            assert method not in API_METHODS
        return error.code().name
    assert method in API_METHODS
    assert isinstance(reply, bytes)
    return "answered"


def targets() -> dict[str, Target]:
    """The in-process targets (the gRPC API needs a server: `ApiRig`)."""
    return {
        "frame_header": Target("frame_header", frames(), run_frame),
        "payload": Target("payload", payload_cases(), run_payload),
        "inbox": Target("inbox", inbox_cases(), run_inbox),
        "peer_record": Target("peer_record", documents(PEER_WIRE), run_peer_record),
        "plan": Target("plan", plan_cases(), run_plan),
        "topology": Target("topology", documents(TOPOLOGY_WIRE), run_topology),
        "join": Target("join", join_cases(), run_join),
        "addresses": Target("addresses", documents(BOOK_WIRE), run_addresses),
        "state_server": Target("state_server", state_requests(), run_state),
    }


def describe(value: Any) -> str:
    """A crash's input in a form one can paste back into Python."""
    if isinstance(value, (bytes, bytearray)):
        return f"bytes.fromhex({bytes(value).hex()!r})"
    return repr(value)

