"""Tensors to frame payloads and back: raw bytes, 16-bit floats, 8 bits with a scale per block of 64 values,
or 4 or 6 bits with a scale per tile of 64 values, a tile rotated where that lowers its error.

`encode` runs in the sender's compute thread. With `copy=False` and a raw codec it returns a view of
the tensor's own memory (the sender must not change the tensor until the frame has left); otherwise the
payload is a copy. A tensor on an accelerator is encoded there and copied out through pinned memory. `decode` checks what arrived (checksum, size, finiteness) before anyone uses it.
"""

from __future__ import annotations

import functools
import math

import torch
import xxhash

from hetpeer.protocol.frame import BLOCK, BLOCKED_CODECS, FLOAT_DTYPES, FrameError, FrameHeader

TORCH_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
WIRE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}
FP16_IN_BF16 = 65280.0  # the largest bf16 value that is finite in fp16


def wire_dtype(tensor: torch.Tensor) -> str:
    if tensor.dtype not in WIRE_NAMES:
        raise ValueError(f"tensors of {tensor.dtype} cannot travel in a frame (known: {', '.join(TORCH_DTYPES)})")
    return WIRE_NAMES[tensor.dtype]


def wire_codec(tensor: torch.Tensor, codec: str) -> str:
    """The codec a tensor really travels in: integers and scalars travel raw, and so does anything empty."""
    if wire_dtype(tensor) not in FLOAT_DTYPES or tensor.numel() == 0 or (codec in BLOCKED_CODECS and tensor.dim() == 0):
        return "raw"
    return codec


def encode(tensor: torch.Tensor, codec: str, copy: bool = True) -> tuple[str, memoryview]:
    """The tensor's wire dtype and its payload in `wire_codec(tensor, codec)`."""
    dtype, codec = wire_dtype(tensor), wire_codec(tensor, codec)
    data = tensor.detach()  # squeezed where it lies (an accelerator's copy carries the smaller form), then brought over
    if codec == "raw":
        host = _host(data)
        return dtype, _bytes(host.clone() if copy and host.data_ptr() == tensor.data_ptr() else host)
    if codec == "fp16":
        half = data.to(torch.float16)
        if not all_finite(half):  # saturate finite values past fp16's range: as inf they would be refused
            limit = torch.finfo(torch.float16).max
            half = torch.where(data.isinf(), data, data.clamp(-limit, limit)).to(torch.float16)
        return dtype, _bytes(_host(half))
    if codec == "bf16":
        if data.dtype == torch.float16:  # fp16's largest values round up past its range in bf16: the receiver would refuse them
            data = torch.where(data.isinf(), data, data.clamp(-FP16_IN_BF16, FP16_IN_BF16))
        return dtype, _bytes(_host(data.to(torch.bfloat16)))
    tiles = _tiles(data)
    packed = {"int8": lambda: _int8(tiles, data.numel()), "int4": lambda: _int4(tiles), "int6": lambda: _int6(tiles)}
    return dtype, _bytes(_host(packed[codec]()))


def _tiles(data: torch.Tensor) -> torch.Tensor:
    """(blocks, BLOCK) float32: the tensor's values in order, zeros padding the last block."""
    flat = data.reshape(-1).float()
    return torch.nn.functional.pad(flat, (0, -flat.numel() % BLOCK)).view(-1, BLOCK)


def _int8(tiles: torch.Tensor, numel: int) -> torch.Tensor:
    """The int8 payload: a float32 absmax scale per block, then a signed byte per value (no padding)."""
    scales = tiles.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    values = torch.round(tiles / scales[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)[:numel]
    return torch.cat((scales.view(torch.uint8), values.view(torch.uint8)))


def _int4(tiles: torch.Tensor) -> torch.Tensor:
    """The int4 payload: the tiles' scales, then two 4-bit codes a byte, low nibble first (`_rotated_codes`)."""
    codes, scales = _rotated_codes(tiles, 7)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return torch.cat((scales.view(torch.uint8), packed.reshape(-1)))


def _int6(tiles: torch.Tensor) -> torch.Tensor:
    """The int6 payload: the tiles' scales, then four 6-bit codes in each 3 bytes, the first in the low bits."""
    codes, scales = _rotated_codes(tiles, 31)
    c0, c1, c2, c3 = codes.view(-1, BLOCK // 4, 4).unbind(dim=2)
    packed = torch.stack((c0 | (c1 << 6), (c1 >> 2) | (c2 << 4), (c2 >> 4) | (c3 << 2)), dim=2)  # uint8: high bits drop
    return torch.cat((scales.view(torch.uint8), packed.reshape(-1)))


def _rotated_codes(tiles: torch.Tensor, most: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes 1 .. 2 most + 1 (uint8, code c for (c - most - 1) x scale) of each tile as it is or rotated by the
    Hadamard transform, which spreads an outlier over the tile so that the other values keep their resolution:
    whichever form has the smaller absmax, since rounding to 2 most + 1 levels (a step of absmax / most) errs by up
    to half a step on every value either way (the rotation is orthonormal: an error in the rotated form is the same
    error in the tile). Scales are float32, negative where the tile is rotated."""
    turned = tiles @ _hadamard(tiles.device)
    plain_max, turned_max = tiles.abs().amax(dim=1), turned.abs().amax(dim=1)
    rotate = turned_max < plain_max
    scale = torch.minimum(plain_max, turned_max).clamp_min_(torch.finfo(torch.float32).tiny).div_(float(most))
    form = torch.where(rotate[:, None], turned, tiles)
    codes = form.div_(scale[:, None]).round_().clamp_(-most, most).add_(most + 1).to(torch.uint8)
    return codes, torch.where(rotate, -scale, scale)  # the sign says "rotated"


@functools.cache
def _hadamard(device: torch.device) -> torch.Tensor:
    """The BLOCK-point orthonormal Hadamard matrix (Sylvester's construction): symmetric, its own inverse."""
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < BLOCK:
        matrix = torch.cat((torch.cat((matrix, matrix), 1), torch.cat((matrix, -matrix), 1)))
    return (matrix / math.sqrt(BLOCK)).to(device)


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in host memory, contiguous. From an accelerator it comes through page-locked (pinned) memory,
    which the copy engine fills at the bus's rate, where pageable memory is staged through a bounce buffer."""
    if tensor.device.type == "cpu":
        return tensor.contiguous()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()  # the bytes are read right after
    return host


class PayloadCheck:
    """Checks a payload as its bytes arrive: the XXH3-64 checksum, and that every float is finite.

    Fed chunk by chunk (`update`) while the rest is still on the wire, so checking overlaps the
    transfer instead of following it. Floats are checked in the wire layout: the raw tensor, the
    16-bit values of an fp16/bf16 frame, or the float32 block scales of an int8 or int4 frame.
    """

    def __init__(self, header: FrameHeader) -> None:
        self.header = header
        self.hasher = xxhash.xxh3_64()
        self.received = 0
        self.finite = True
        self.checked = 0  # bytes of the float region already checked
        if header.dtype not in FLOAT_DTYPES:
            self.float_dtype, self.float_end = None, 0
        elif header.codec in BLOCKED_CODECS:
            self.float_dtype, self.float_end = torch.float32, -(-header.numel // BLOCK) * 4
        else:
            name = header.dtype if header.codec == "raw" else header.codec
            self.float_dtype, self.float_end = TORCH_DTYPES[name], header.payload_bytes
        self.item_bytes = torch.empty((), dtype=self.float_dtype).element_size() if self.float_dtype else 1

    def update(self, buffer: memoryview | bytearray, end: int) -> None:
        """The payload's bytes up to `end` have arrived in `buffer` (which holds the whole payload)."""
        view = memoryview(buffer)
        self.hasher.update(view[self.received : end])
        self.received = end
        ready = min(end, self.float_end) // self.item_bytes * self.item_bytes
        if self.finite and ready > self.checked:
            floats = torch.frombuffer(view[self.checked : ready], dtype=self.float_dtype)
            self.finite = all_finite(floats)
            self.checked = ready

    def verify(self, checksum: int) -> None:
        if self.received != self.header.payload_bytes:
            raise FrameError(f"payload of {self.received} bytes, header says {self.header.payload_bytes}")
        if self.hasher.intdigest() != checksum:
            raise FrameError("payload checksum does not match")
        if not self.finite:
            raise FrameError("tensor holds NaN or infinite values")


def decode(header: FrameHeader, payload: memoryview | bytearray, check: PayloadCheck | None = None) -> torch.Tensor:
    """The tensor a frame carries, once its payload passes its check (run here unless given, fed whole);
    FrameError if its bytes are inconsistent with the header, corrupted or not finite."""
    if check is None:
        check = PayloadCheck(header)
        if len(payload):
            check.update(payload, len(payload))
    check.verify(header.checksum)
    dtype = TORCH_DTYPES[header.dtype]
    if header.numel == 0:
        try:
            return torch.empty(header.shape, dtype=dtype)
        except RuntimeError as error:  # a 0 beside dimensions whose strides overflow int64
            raise FrameError(f"empty tensor of shape {list(header.shape)} cannot be built: {error}") from None
    tensor = _rebuild(torch.frombuffer(payload, dtype=torch.uint8), header.codec, dtype, header.numel, header.shape)
    if header.codec in BLOCKED_CODECS or (header.codec, header.dtype) == ("bf16", "fp16"):
        # finite scales times up to 127 (or 8) can still overflow, in float32 or in dtype; bf16 reaches 3.4e38, fp16 65504
        _check_range(tensor, header)
    return tensor


def as_received(tensor: torch.Tensor, codec: str) -> torch.Tensor:
    """The values a receiver rebuilds from `tensor` sent in `codec`: a sender that keeps these where every
    receiver keeps what it received holds the same bits as they do."""
    codec = wire_codec(tensor, codec)
    if codec == "raw":
        return tensor
    _, payload = encode(tensor, codec)
    rebuilt = _rebuild(torch.frombuffer(payload, dtype=torch.uint8), codec, tensor.dtype, tensor.numel(), tuple(tensor.shape))
    return rebuilt.to(tensor.device)


def _rebuild(raw: torch.Tensor, codec: str, dtype: torch.dtype, numel: int, shape: tuple[int, ...]) -> torch.Tensor:
    if codec == "raw":
        return raw.view(dtype).reshape(shape)
    if codec in ("fp16", "bf16"):
        return raw.view(TORCH_DTYPES[codec]).reshape(shape).to(dtype)
    blocks = -(-numel // BLOCK)
    scales = raw[: blocks * 4].view(torch.float32)
    if codec == "int8":
        values = torch.nn.functional.pad(raw[blocks * 4 :].view(torch.int8).float(), (0, -numel % BLOCK))
        return (values.view(blocks, BLOCK) * scales[:, None]).reshape(-1)[:numel].reshape(shape).to(dtype)
    if codec == "int4":
        packed = raw[blocks * 4 :].view(blocks, BLOCK // 2)
        codes = torch.stack((packed & 15, packed >> 4), dim=2).view(blocks, BLOCK).float().sub_(8)
    else:
        b0, b1, b2 = raw[blocks * 4 :].view(blocks, BLOCK // 4, 3).unbind(dim=2)
        codes = torch.stack((b0 & 63, (b0 >> 6) | ((b1 & 15) << 2), (b1 >> 4) | ((b2 & 3) << 4), b2 >> 2), dim=2)
        codes = codes.view(blocks, BLOCK).float().sub_(32)
    tiles = codes.mul_(scales.abs()[:, None])
    rotated = scales < 0
    if bool(rotated.any()):
        tiles[rotated] = tiles[rotated] @ _hadamard(tiles.device)
    return tiles.reshape(-1)[:numel].reshape(shape).to(dtype)


def _check_range(tensor: torch.Tensor, header: FrameHeader) -> None:
    if not all_finite(tensor):
        raise FrameError(f"tensor overflows {header.dtype} once decoded from codec {header.codec}")


def all_finite(tensor: torch.Tensor) -> bool:
    # a float32 sum is finite exactly when no element is NaN or infinite, unless finite elements near
    # 1e38 overflow it; that rare case takes the exact (30x slower) elementwise test
    if bool(torch.isfinite(tensor.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(tensor).all())


def checksum(payload: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
