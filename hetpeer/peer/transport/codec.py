"""Tensors to frame payloads and back: raw bytes, 16-bit floats, or 8-bit with per-row scales.

`encode` runs in the sender's compute thread and returns bytes (a copy), so compute may change the
tensor right after; `decode` checks what arrived (finite, as large as the header says) before anyone uses it.
"""

from __future__ import annotations

import zlib

import torch

from hetpeer.protocol.frame import FLOAT_DTYPES, FrameError, FrameHeader

TORCH_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
WIRE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def wire_dtype(tensor: torch.Tensor) -> str:
    if tensor.dtype not in WIRE_NAMES:
        raise ValueError(f"tensors of {tensor.dtype} cannot travel in a frame (known: {', '.join(TORCH_DTYPES)})")
    return WIRE_NAMES[tensor.dtype]


def encode(tensor: torch.Tensor, codec: str) -> tuple[str, bytes]:
    """The tensor's wire dtype and its payload in `codec`; a float codec on an integer tensor sends it raw."""
    dtype = wire_dtype(tensor)
    data = tensor.detach().to("cpu").contiguous()
    if dtype not in FLOAT_DTYPES or codec == "raw":
        return dtype, _bytes(data)
    if codec in ("fp16", "bf16"):
        return dtype, _bytes(data.to(TORCH_DTYPES[codec]))
    rows = data.float().reshape(-1, data.shape[-1]) if data.dim() else data.float().reshape(1, 1)
    scales = rows.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    values = torch.round(rows / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return dtype, _bytes(scales) + _bytes(values)


def decode(header: FrameHeader, payload: bytearray | bytes) -> torch.Tensor:
    """The tensor a checked frame carries; FrameError if its bytes are inconsistent or not finite."""
    if len(payload) != header.payload_bytes:
        raise FrameError(f"payload of {len(payload)} bytes, header says {header.payload_bytes}")
    if zlib.crc32(payload) != header.checksum:
        raise FrameError("payload checksum does not match")
    dtype = TORCH_DTYPES[header.dtype]
    if header.numel == 0:
        return torch.empty(header.shape, dtype=dtype)
    raw = torch.frombuffer(payload, dtype=torch.uint8)
    if header.codec == "raw":
        tensor = raw.view(dtype).reshape(header.shape)
    elif header.codec in ("fp16", "bf16"):
        tensor = raw.view(TORCH_DTYPES[header.codec]).reshape(header.shape).to(dtype)
    else:
        width = header.shape[-1]
        rows = header.numel // width
        scales = raw[: rows * 4].view(torch.float32)
        values = raw[rows * 4 :].view(torch.int8).reshape(rows, width)
        tensor = (values.float() * scales[:, None]).reshape(header.shape).to(dtype)
    if header.dtype in FLOAT_DTYPES and not bool(torch.isfinite(tensor).all()):
        raise FrameError("tensor holds NaN or infinite values")
    return tensor


def checksum(payload: bytes) -> int:
    return zlib.crc32(payload)


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
