"""Tensor frames: headers round-trip, every malformed header or payload is refused with a FrameError that says
what is wrong, and the codecs rebuild tensors exactly (raw) or within their stated precision."""

from __future__ import annotations

import itertools
import struct

import pytest
import torch

from hetpeer.peer.transport import MemoryHub, MemoryTransport
from hetpeer.peer.transport.codec import TORCH_DTYPES, checksum, decode, encode
from hetpeer.protocol.frame import (
    BLOCKED_CODECS,
    CODE_BITS,
    CODECS,
    DTYPES,
    FLOAT_DTYPES,
    KINDS,
    MAX_HEADER_BYTES,
    MAX_NDIM,
    MAX_SENDER_BYTES,
    PREFIX,
    _FIXED as FIXED,
    FrameError,
    FrameHeader,
    decode_header,
    bytes_per_value,
    header_length,
    payload_bytes,
)

# FIXED is the fixed part of the header, in the order of frame.py's docstring: version, kind, dtype, codec,
# ndim, epoch, step, micro-batch, payload bytes, checksum.
SHAPES = [(), (0,), (3, 0, 2), (5,), (2, 3), (1,) * MAX_NDIM]


def _valid(dtype: str, codec: str, shape: tuple[int, ...]) -> bool:
    return (codec == "raw" or dtype in FLOAT_DTYPES) and not (codec in BLOCKED_CODECS and not shape)


def _body(header: FrameHeader) -> bytes:
    frame = header.encode()
    assert header_length(frame[: PREFIX.size]) == len(frame) - PREFIX.size
    return frame[PREFIX.size :]


def _patched(body: bytes, **fields) -> bytes:
    """`body` with some fixed header fields replaced (by name) and the rest left as they are."""
    names = ("version", "kind", "dtype", "codec", "ndim", "epoch", "step", "micro", "size", "checksum")
    values = dict(zip(names, FIXED.unpack_from(body)))
    values.update(fields)
    return FIXED.pack(*(values[n] for n in names)) + body[FIXED.size :]


def _header(**overrides) -> FrameHeader:
    fields = dict(kind="activation", dtype="fp32", shape=(2, 3), sender="peer-a", step=7, micro=1, epoch=2)
    fields.update(overrides)
    return FrameHeader(**fields)


# -- headers -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_header_round_trip_every_kind_dtype_codec_and_shape(kind):
    count = 0
    for dtype, codec, shape in itertools.product(DTYPES, CODECS, SHAPES):
        if not _valid(dtype, codec, shape):
            continue
        header = FrameHeader(
            kind=kind, dtype=dtype, shape=shape, sender="dev-7", step=2**64 - 1, micro=2**32 - 1,
            epoch=2**32 - 1, codec=codec, checksum=2**64 - 1,
        )
        assert header.payload_bytes == payload_bytes(dtype, shape, codec)
        assert decode_header(_body(header)) == header
        count += 1
    # every dtype raw; fp16, bf16 and the blocked codecs for float dtypes, the blocked ones not for 0-d shapes
    floats = len(FLOAT_DTYPES)
    assert count == len(SHAPES) * len(DTYPES) + (len(CODECS) - 1) * len(SHAPES) * floats - len(BLOCKED_CODECS) * floats


def test_payload_sizes_follow_dtype_shape_and_codec():
    assert payload_bytes("fp32", (2, 3), "raw") == 24
    assert payload_bytes("int64", (2, 3), "raw") == 48
    assert payload_bytes("fp32", (2, 3), "bf16") == 12
    assert payload_bytes("bf16", (2, 3), "fp16") == 12
    assert payload_bytes("fp32", (2, 3), "int8") == 1 * 4 + 6  # a float32 scale per block of 64, a byte each
    assert payload_bytes("fp32", (4, 2, 3), "int8") == 1 * 4 + 24
    assert payload_bytes("fp32", (3, 64), "int8") == 3 * 4 + 192
    assert payload_bytes("fp32", (65,), "int8") == 2 * 4 + 65
    assert payload_bytes("fp32", (), "raw") == 4
    assert payload_bytes("fp32", (0, 5), "int8") == 0
    assert payload_bytes("fp32", (2, 3), "int4") == 1 * 4 + 32  # a scale per tile of 64, then the padded tile's nibbles
    assert payload_bytes("bf16", (3, 64), "int4") == 3 * (4 + 32)
    assert payload_bytes("fp32", (65,), "int4") == 2 * (4 + 32)
    assert payload_bytes("fp32", (0, 5), "int4") == 0
    assert payload_bytes("fp32", (2, 3), "int6") == 1 * 4 + 48  # a scale per tile of 64, then 64 codes of 6 bits
    assert payload_bytes("bf16", (3, 64), "int6") == 3 * (4 + 48)
    assert payload_bytes("fp32", (65,), "int6") == 2 * (4 + 48)
    assert bytes_per_value("fp32", "int6") == 0.75 + 4 / 64 and bytes_per_value("bf16", "int4") == 0.5 + 4 / 64


def test_long_unicode_sender_round_trips_up_to_the_limit():
    sender = "é" * (MAX_SENDER_BYTES // 2)  # two UTF-8 bytes each: exactly at the limit
    header = _header(sender=sender)
    assert decode_header(_body(header)).sender == sender
    with pytest.raises(FrameError, match="sender id must be 1 to 128 bytes, got 130"):
        _header(sender=sender + "é")
    with pytest.raises(FrameError, match="got 0"):
        _header(sender="")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"step": -1}, "step -1"),
        ({"step": 2**64}, "out of range"),
        ({"micro": -1}, "micro-batch -1"),
        ({"micro": 2**32}, "out of range"),
        ({"epoch": 2**32}, "epoch 4294967296"),
        ({"kind": "weights"}, "unknown frame kind 'weights'"),
        ({"dtype": "fp64"}, "unknown dtype 'fp64'"),
        ({"codec": "zstd"}, "unknown codec 'zstd'"),
        ({"dtype": "int64", "codec": "bf16"}, "codec bf16 applies to floating-point tensors, not int64"),
        ({"dtype": "uint8", "codec": "int8"}, "not uint8"),
        ({"shape": (), "codec": "int8"}, "int8 needs at least one dimension"),
        ({"shape": (), "codec": "int4"}, "int4 needs at least one dimension"),
        ({"shape": (1,) * (MAX_NDIM + 1)}, "bad shape"),
        ({"shape": (2**32,)}, "bad shape"),
        ({"shape": (-1, 3)}, "bad shape"),
        ({"payload_bytes": 23}, "payload of 23 bytes does not match fp32\\[2, 3\\] in codec raw \\(24 bytes\\)"),
    ],
)
def test_headers_out_of_range_are_refused_on_construction(overrides, message):
    with pytest.raises(FrameError, match=message):
        _header(**overrides)


@pytest.mark.parametrize("sender", ["a", "peer-a", "bob-0123456789ab", "x" * MAX_SENDER_BYTES])
def test_payloads_start_aligned_in_the_stream(sender):
    header = _header(sender=sender)
    assert len(header.encode()) % 64 == 0
    assert decode_header(header.encode()[PREFIX.size:]) == header


def test_prefix_errors():
    body = _body(_header())
    with pytest.raises(FrameError, match="not a hetpeer frame"):
        header_length(PREFIX.pack(b"HPF0", len(body)))
    with pytest.raises(FrameError, match="prefix must be 8 bytes, got 7"):
        header_length(PREFIX.pack(b"HPF1", len(body))[:7])
    for length in (0, FIXED.size, MAX_HEADER_BYTES + 1, 2**32 - 1):
        with pytest.raises(FrameError, match=f"header length {length} outside"):
            header_length(PREFIX.pack(b"HPF1", length))
    assert header_length(PREFIX.pack(b"HPF1", MAX_HEADER_BYTES)) == MAX_HEADER_BYTES


def _with_sender_bytes(body: bytes, sender: bytes) -> bytes:
    ndim = body[4]
    end = FIXED.size + 4 * ndim
    return body[:end] + bytes([len(sender)]) + sender


def _cases() -> list[tuple[str, bytes, str]]:
    body = _body(_header())  # fp32 [2, 3] raw from "peer-a"
    return [
        ("wrong version", _patched(body, version=1), "frame version 1 is not 2"),
        ("unknown kind code", _patched(body, kind=len(KINDS)),
         f"unknown kind, dtype or codec code \\({len(KINDS)}, 0, 0\\)"),
        ("unknown dtype code", _patched(body, dtype=len(DTYPES)), f"\\(0, {len(DTYPES)}, 0\\)"),
        ("unknown codec code", _patched(body, codec=255), "\\(0, 0, 255\\)"),
        ("too many dims", _patched(body, ndim=MAX_NDIM + 1), f"{MAX_NDIM + 1} dimensions, at most {MAX_NDIM}"),
        ("shorter than the fixed part", body[: FIXED.size], f"header of {FIXED.size} bytes is too short"),
        ("empty", b"", "header of 0 bytes is too short"),
        ("ends inside the shape", _patched(body, ndim=7)[: FIXED.size + 10], "header ends inside the shape"),
        ("ends inside the sender", _with_sender_bytes(body, b"peer-a")[:-1], "does not end after the sender"),
        ("padding of a whole block", body + bytes(64), "does not end after the sender"),
        ("padding not zero", body[:-1] + b"\1", "does not end after the sender"),
        ("non-UTF-8 sender", _with_sender_bytes(body, b"peer\xff"), "sender id is not UTF-8"),
        ("empty sender", _with_sender_bytes(body, b""), "sender id must be 1 to 128 bytes, got 0"),
        ("sender too long", _with_sender_bytes(body, b"x" * (MAX_SENDER_BYTES + 1)), "got 129"),
        ("payload size vs shape", _patched(body, size=25), "payload of 25 bytes does not match fp32\\[2, 3\\]"),
        ("payload size vs codec", _patched(body, codec=CODECS.index("bf16")),
         "payload of 24 bytes .* in codec bf16 \\(12 bytes\\)"),
        ("payload size vs dtype", _patched(body, dtype=list(DTYPES).index("int64")), "does not match int64\\[2, 3\\]"),
        (
            "codec on an integer dtype",
            _patched(body, dtype=list(DTYPES).index("int32"), codec=CODECS.index("int8")),
            "codec int8 applies to floating-point tensors, not int32",
        ),
        ("int8 on a 0-d tensor", _patched(_body(_header(shape=(), dtype="fp32")), codec=CODECS.index("int8"), size=5),
         "int8 needs at least one dimension"),
    ]


@pytest.mark.parametrize("body, message", [c[1:] for c in _cases()], ids=[c[0] for c in _cases()])
def test_malformed_headers_are_refused_with_the_reason(body, message):
    with pytest.raises(FrameError, match=message):
        decode_header(body)


# -- payloads ----------------------------------------------------------------------------------------


def _sample(dtype: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    torch_dtype = TORCH_DTYPES[dtype]
    if dtype in FLOAT_DTYPES:
        return (torch.randn(shape, generator=generator) * 3).to(torch_dtype)
    info = torch.iinfo(torch_dtype)
    low, high = max(info.min, -(2**62)), min(info.max, 2**62)
    values = torch.randint(low, high, shape, generator=generator, dtype=torch.int64).to(torch_dtype)
    if values.numel() >= 2:  # the extremes must survive too
        values.view(-1)[0], values.view(-1)[1] = info.min, info.max
    return values


def _travel(tensor: torch.Tensor, codec: str, *, kind: str = "activation") -> tuple[FrameHeader, bytes, torch.Tensor]:
    """Encode, put through a header's wire form, and decode, as a receiver would."""
    dtype, payload = encode(tensor, codec)
    header = FrameHeader(
        kind=kind, dtype=dtype, shape=tuple(tensor.shape), sender="a", step=0, codec=codec,
        checksum=checksum(payload),
    )
    header = decode_header(_body(header))
    assert len(payload) == header.payload_bytes
    return header, payload, decode(header, bytearray(payload))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (4, 0), (7,), (3, 5), (2, 3, 4)])
def test_raw_codec_is_exact_for_every_dtype(dtype, shape):
    tensor = _sample(dtype, shape)
    header, _, back = _travel(tensor, "raw")
    assert header.dtype == dtype
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_raw_codec_sends_what_a_non_contiguous_view_holds():
    tensor = _sample("fp32", (4, 6)).t()[1:, ::2]
    assert not tensor.is_contiguous()
    assert torch.equal(_travel(tensor, "raw")[2], tensor)


@pytest.mark.parametrize("codec, dtype, relative", [
    ("fp16", "fp32", 2**-11), ("bf16", "fp32", 2**-8), ("fp16", "bf16", 0.0), ("bf16", "fp16", 2**-8),
    ("bf16", "bf16", 0.0),
])
def test_16_bit_codecs_round_to_their_precision(codec, dtype, relative):
    tensor = _sample(dtype, (16, 33))
    header, payload, back = _travel(tensor, codec)
    assert len(payload) == tensor.numel() * 2
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    error = (back.float() - tensor.float()).abs()
    assert bool((error <= tensor.float().abs() * relative).all())
    assert not torch.equal(back, tensor) or relative == 0.0


def _blocks(seed: int, small: float) -> torch.Tensor:
    """Six rows of 64 values, one per codec block: of very different scales (`small` and 1e3 or 1e4 times the
    rest, as far apart as the dtype holds as normal numbers), an all-zero one, one with an outlier (-50)."""
    rows = torch.randn(6, 64, generator=torch.Generator().manual_seed(seed))
    rows[1] *= small
    rows[2] *= 1e3 if small >= 1e-3 else 1e4
    rows[3] = 0.0
    rows[4, 7] = -50.0
    return rows


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_int8_codec_keeps_each_block_within_half_a_step_of_its_own_scale(dtype):
    rows = _blocks(seed=1, small=1e-3 if dtype == "fp16" else 1e-6)
    tensor = rows.reshape(2, 3, 64).to(TORCH_DTYPES[dtype])
    header, payload, back = _travel(tensor, "int8")
    assert len(payload) == 6 * 4 + 6 * 64
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    original, rebuilt = tensor.float().reshape(6, 64), back.float().reshape(6, 64)
    absmax = original.abs().amax(dim=1)
    # Rounding to the nearest of 127 levels is off by at most half a level (absmax / 254); the target dtype
    # may add its own rounding on top.
    storage = {"fp32": 0.0, "bf16": 2**-8, "fp16": 2**-11}[dtype]
    bound = absmax[:, None] / 254 * 1.0001 + (original.abs() + rebuilt.abs()) * storage
    assert bool(((rebuilt - original).abs() <= bound).all())
    assert bool((rebuilt[3] == 0).all())
    assert rebuilt[4, 7].item() == pytest.approx(-50.0, rel=1e-6)
    assert rebuilt[1].abs().max().item() == pytest.approx(original[1].abs().max().item(), rel=1e-2)


@pytest.mark.parametrize("codec, most", [("int4", 7), ("int6", 31)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_4_and_6_bit_codecs_keep_each_tile_within_half_a_step_of_its_better_form(dtype, codec, most):
    rows = _blocks(seed=2, small=1e-2 if dtype == "fp16" else 1e-6)
    rows[5] = 0.75  # a flat tile: exact as it is, 8 times coarser rotated
    tensor = rows.reshape(2, 3, 64).to(TORCH_DTYPES[dtype])
    header, payload, back = _travel(tensor, codec)
    assert len(payload) == 6 * (4 + 64 * CODE_BITS[codec] // 8)
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    original, rebuilt = tensor.float().reshape(6, 64), back.float().reshape(6, 64)
    hadamard = torch.ones(1, 1)
    while len(hadamard) < 64:
        hadamard = torch.cat((torch.cat((hadamard, hadamard), 1), torch.cat((hadamard, -hadamard), 1)))
    turned = original @ hadamard / 8
    step = torch.minimum(original.abs().amax(dim=1), turned.abs().amax(dim=1)) / most
    scales = torch.frombuffer(bytearray(payload[: 6 * 4]), dtype=torch.float32)
    assert (scales < 0).tolist() == (turned.abs().amax(dim=1) < original.abs().amax(dim=1)).tolist()
    assert scales[4] < 0 and scales[3] > 0 and scales[5] > 0  # the outlier's tile turned; the flat one did not
    # Each of the 64 values of the form that travelled is off by at most half a step; the rotation keeps the
    # length of the error. The target dtype may add its own rounding on top.
    storage = {"fp32": 1e-6, "bf16": 2**-8, "fp16": 2**-11}[dtype]
    bound = step * 4 * 1.0001 + (original.norm(dim=1) + rebuilt.norm(dim=1)) * storage
    assert bool(((rebuilt - original).norm(dim=1) <= bound).all())
    assert bool((rebuilt[3] == 0).all()) and bool((rebuilt[5] == original[5]).all())
    flat = (original[4] / (original[4].abs().max() / most)).round().clamp(-most, most) * (original[4].abs().max() / most)
    assert (rebuilt[4] - original[4]).norm() < 0.8 * (flat - original[4]).norm()  # better than left as it is


def test_int6_codec_packs_four_codes_in_three_bytes_the_first_in_the_low_bits():
    tensor = torch.tensor([31.0, -31.0, 1.0, 0.0] + [31.0] * 60)  # rotated, its first value would be 232.6: it goes plain
    payload = _travel(tensor, "int6")[1]
    assert struct.unpack("<f", payload[:4])[0] == 1.0  # absmax 31 over 31 levels; positive: not rotated
    # codes 63, 1, 33, 32: 63 | 1 << 6, 1 >> 2 | (33 & 15) << 4, 33 >> 4 | 32 << 2; then fifteen groups of four 63s
    assert payload[4:7] == bytes([127, 16, 130]) and payload[7:] == b"\xff" * 45


def test_int4_codec_packs_two_codes_a_byte_low_nibble_first():
    tensor = torch.tensor([7.0, -7.0, 1.0, 0.0] + [7.0] * 60)  # rotated, its first value would be 53.25: it goes plain
    payload = _travel(tensor, "int4")[1]
    assert struct.unpack("<f", payload[:4])[0] == 1.0  # absmax 7 over 7 levels; positive: not rotated
    assert payload[4:6] == bytes([15 | (1 << 4), 9 | (8 << 4)]) and payload[6:] == bytes([15 | (15 << 4)]) * 30


@pytest.mark.parametrize("codec", BLOCKED_CODECS)
@pytest.mark.parametrize("shape", [(0, 5), (5,), (1, 1), (3, 100)])
def test_blocked_codecs_edge_shapes(codec, shape):
    tensor = _sample("fp32", shape)
    assert _travel(tensor, codec)[2].shape == tensor.shape


@pytest.mark.parametrize("codec", BLOCKED_CODECS)
def test_blocked_codecs_encode_an_empty_last_dimension(codec):
    # The header says (3, 0) in a blocked codec is a 0-byte payload; the encoder must agree rather than crash.
    tensor = torch.empty(3, 0)
    header, payload, back = _travel(tensor, codec)
    assert payload == b"" and back.shape == (3, 0)


@pytest.mark.parametrize("codec", CODECS)
def test_an_encoded_copy_does_not_follow_later_changes_to_the_tensor(codec):
    tensor = _sample("fp32", (3, 8))
    dtype, payload = encode(tensor, codec)  # copy=True is the default
    before = bytes(payload)
    tensor.add_(100.0)
    assert bytes(payload) == before


def _frame(tensor: torch.Tensor, codec: str = "raw") -> tuple[FrameHeader, bytes]:
    dtype, payload = encode(tensor, codec)
    header = FrameHeader(kind="params", dtype=dtype, shape=tuple(tensor.shape), sender="a", step=1,
                         codec=codec, checksum=checksum(payload))
    return header, payload


@pytest.mark.parametrize("codec", CODECS)
def test_a_flipped_payload_byte_fails_the_checksum(codec):
    header, payload = _frame(_sample("fp32", (3, 8)), codec)
    for position in (0, len(payload) // 2, len(payload) - 1):
        damaged = bytearray(payload)
        damaged[position] ^= 0x10
        with pytest.raises(FrameError, match="checksum does not match"):
            decode(header, damaged)
    assert decode(header, bytearray(payload)).shape == (3, 8)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype, codec", [("fp32", "raw"), ("bf16", "raw"), ("fp16", "raw"), ("fp32", "fp16"),
                                          ("fp32", "bf16"), ("fp32", "int8"), ("bf16", "int4")])
def test_non_finite_payloads_are_refused(bad, dtype, codec):
    tensor = _sample(dtype, (3, 4))
    tensor[1, 2] = bad
    header, payload = _frame(tensor, codec)  # an honest checksum over a poisoned tensor
    with pytest.raises(FrameError, match="NaN or infinite"):
        decode(header, bytearray(payload))


def test_integer_payloads_are_not_checked_for_finiteness():
    header, payload = _frame(torch.tensor([[0, -1], [2**40, 3]], dtype=torch.int64))
    assert decode(header, bytearray(payload)).tolist() == [[0, -1], [2**40, 3]]


@pytest.mark.parametrize("delta", [-1, 1, -24])
def test_a_payload_of_the_wrong_length_is_refused(delta):
    header, payload = _frame(_sample("fp32", (2, 3)))
    wrong = bytes(payload)[:delta] if delta < 0 else bytes(payload) + b"\0" * delta
    with pytest.raises(FrameError, match=f"payload of {len(wrong)} bytes, header says 24"):
        decode(header, bytearray(wrong))


# -- through a transport ------------------------------------------------------------------------------


@pytest.fixture
def pair():
    hub = MemoryHub()
    sender, receiver = MemoryTransport("a", hub), MemoryTransport("b", hub)
    frames: list[tuple[FrameHeader, int]] = []
    deliver = receiver.deliver

    def recording(header, payload, authenticated=None):
        frames.append((header, len(payload)))
        return deliver(header, payload, authenticated)

    receiver.deliver = recording
    with sender, receiver:
        yield sender, receiver, frames


@pytest.mark.parametrize("codec", CODECS[1:])
@pytest.mark.parametrize("dtype", ["int64", "int32", "uint8"])
def test_integer_tensors_with_a_float_codec_travel_raw(pair, codec, dtype):
    sender, receiver, frames = pair
    tensor = _sample(dtype, (3, 5))
    sender.send("b", "labels", tensor, step=4, micro=2, epoch=1, codec=codec)
    (header, size), = frames
    assert header.codec == "raw" and header.dtype == dtype and size == tensor.numel() * DTYPES[dtype]
    assert torch.equal(receiver.recv("labels", "a", 4, 2, timeout_s=1.0), tensor)
    assert not receiver.inbox.misbehaving


@pytest.mark.parametrize("codec", CODECS)
def test_float_tensors_travel_in_the_chosen_codec(pair, codec):
    sender, receiver, frames = pair
    tensor = _sample("fp32", (4, 16))
    sender.send("b", "activation", tensor, step=0, codec=codec)
    (header, size), = frames
    assert header.codec == codec and header.dtype == "fp32"
    assert size == payload_bytes("fp32", (4, 16), codec)
    if codec != "raw":
        assert size < tensor.numel() * 4
    back = receiver.recv("activation", "a", 0, 0, timeout_s=1.0)
    assert back.dtype == torch.float32
    # int4 and int6: half a step of 7 or 31 levels, on each of 64 values of a tile
    levels = {"int4": 7 / 8, "int6": 31 / 8}.get(codec, 127)
    assert torch.allclose(back, tensor, rtol=0.01, atol=tensor.abs().max().item() / levels)


@pytest.mark.parametrize("codec", CODECS)
def test_a_scalar_float_tensor_can_be_sent_in_any_codec(pair, codec):
    # A 0-d tensor (a loss, a step size) has no rows to scale; the int8 codec must still let it through
    # (e.g. raw), as it does for integer tensors, rather than fail the send.
    sender, receiver, _ = pair
    sender.send("b", "params", torch.tensor(2.5), step=0, codec=codec)
    assert receiver.recv("params", "a", 0, 0, timeout_s=1.0).item() == 2.5


def test_fp16_frames_saturate_values_past_its_range_instead_of_poisoning_them():
    tensor = torch.tensor([[1e6, -1e6, 3.0, 70000.0]])
    header, payload = _frame(tensor, "fp16")
    received = decode(header, bytearray(payload))
    limit = torch.finfo(torch.float16).max
    assert torch.equal(received, torch.tensor([[limit, -limit, 3.0, limit]]))


# -- found by fuzzing (tests/unit/test_fuzz.py) ---------------------------------------------------------------


def _int8_payload(scale: float, value: int) -> bytes:
    """An int8 frame's payload for 64 elements: one block scale, then `value` and 63 zeros."""
    return struct.pack("<f", scale) + bytes([value & 0xFF]) + bytes(63)


@pytest.mark.parametrize(
    "dtype, codec, payload",
    [
        ("fp32", "int8", _int8_payload(3e38, 127)),  # finite scale x 127 overflows float32
        ("fp16", "int8", _int8_payload(1000.0, 127)),  # 127000 is past fp16's 65504
        ("bf16", "int8", _int8_payload(3e38, -127)),
    ],
)
def test_int8_frames_that_overflow_once_scaled_are_refused(dtype, codec, payload):
    header = FrameHeader(kind="params", dtype=dtype, shape=(64,), sender="a", step=1, codec=codec, checksum=checksum(payload))
    with pytest.raises(FrameError, match=f"overflows {dtype} once decoded from codec int8"):
        decode(header, bytearray(payload))


@pytest.mark.parametrize(
    "dtype, scale, code",
    [
        ("fp32", 3e38, 15),  # finite scale x 7 overflows float32
        ("fp32", -3e38, 15),  # and rotated, where the transform adds 64 values of 8 x 3e38 / 8
        ("fp16", 20000.0, 0),  # -8 x 20000 is past fp16's 65504
    ],
)
def test_int4_frames_that_overflow_once_scaled_are_refused(dtype, scale, code):
    payload = struct.pack("<f", scale) + bytes([code]) * 32
    header = FrameHeader(kind="params", dtype=dtype, shape=(64,), sender="a", step=1, codec="int4", checksum=checksum(payload))
    with pytest.raises(FrameError, match=f"overflows {dtype} once decoded from codec int4"):
        decode(header, bytearray(payload))


def test_bf16_frames_of_fp16_tensors_past_its_range_are_refused():
    payload = torch.tensor([1.0, 1e30], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    header = FrameHeader(kind="params", dtype="fp16", shape=(2,), sender="a", step=1, codec="bf16", checksum=checksum(payload))
    with pytest.raises(FrameError, match="overflows fp16 once decoded from codec bf16"):
        decode(header, bytearray(payload))
    fine = torch.tensor([1.0, -60000.0], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    header = FrameHeader(kind="params", dtype="fp16", shape=(2,), sender="a", step=1, codec="bf16", checksum=checksum(fine))
    assert decode(header, bytearray(fine)).tolist() == [1.0, -59904.0]  # bf16's rounding of -60000


def test_an_empty_tensor_whose_strides_would_overflow_is_refused():
    header = FrameHeader(kind="params", dtype="fp32", shape=(0, 2**31, 2**31, 2**31), sender="a", step=1, checksum=checksum(b""))
    assert header.payload_bytes == 0
    with pytest.raises(FrameError, match="cannot be built"):
        decode(header, bytearray())


def test_a_header_whose_payload_would_not_fit_the_payload_field_is_refused():
    with pytest.raises(FrameError, match="more than a frame can carry"):
        _header(shape=(2**32 - 1,) * 3)


@pytest.mark.parametrize("sender", ["peer\nERROR forged", "peer\x1b[31m", "tab\there"])
def test_senders_that_would_break_a_log_line_are_refused(sender):
    with pytest.raises(FrameError, match="unprintable"):
        _header(sender=sender)
    body = _with_sender_bytes(_body(_header()), sender.encode())
    with pytest.raises(FrameError, match="unprintable"):
        decode_header(body)


def test_an_fp16_tensor_at_its_range_travels_in_bf16_and_is_not_refused():
    """bf16 rounds fp16's largest values (65504) up past fp16's range; the sender saturates them first, so an
    honest frame is never refused as overflowing (and its sender never counted as misbehaving)."""
    tensor = torch.tensor([65504.0, -65504.0, 1.0, 60000.0], dtype=torch.float16)
    dtype, payload = encode(tensor, "bf16")
    header = FrameHeader(kind="activation", dtype=dtype, shape=(4,), sender="a", step=0, codec="bf16",
                         checksum=checksum(payload))
    decoded = decode(header, payload)
    assert decoded.dtype == torch.float16 and decoded.tolist() == [65280.0, -65280.0, 1.0, 59904.0]
