"""Which accelerator a peer trains on: `--device auto` (a CUDA GPU when there is one, else the CPU), or the one
asked for, checked before anything is built on it, with the reason in words for the volunteer to read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 2**30


class DeviceError(ValueError):
    """A device this machine does not have, or a name that is not a device."""


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    device: str  # a torch device: "cpu" or "cuda:N"
    reason: str  # what it is and why it was taken, in words

    def __str__(self) -> str:
        return f"{self.device} ({self.reason})"


def choose_device(requested: str = "auto", dtype: str = "fp32") -> DeviceChoice:
    """The device `requested` names ("auto", "cpu", "cuda" or "cuda:N") for training in `dtype`. "auto" takes the
    CUDA GPU with the most free memory, else the CPU; either way the reason says what was found. A GPU without
    bf16 units still trains a bf16 plan (torch emulates it, slower), and the reason says so."""
    if requested == "cpu":
        return DeviceChoice("cpu", "as asked")
    if requested == "auto":
        if not torch.cuda.is_available():
            return DeviceChoice("cpu", _no_cuda())
        free = [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]
        index = max(range(len(free)), key=free.__getitem__)
        how = "the GPU with the most free memory" if len(free) > 1 else "the only GPU"
        return DeviceChoice(f"cuda:{index}", f"{how}: {_describe(index, dtype)}")
    kind, colon, number = requested.partition(":")
    if kind != "cuda" or (colon and not number.isdigit()):
        raise DeviceError(f"--device must be auto, cpu, cuda or cuda:N, got {requested!r}")
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {requested}: {_no_cuda()}; use --device cpu or auto")
    index = int(number) if number else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"--device {requested}: torch sees {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    return DeviceChoice(f"cuda:{index}", f"as asked: {_describe(index, dtype)}")


def _describe(index: int, dtype: str) -> str:
    free, total = torch.cuda.mem_get_info(index)
    words = f"{torch.cuda.get_device_name(index)}, {free / GIB:.1f} of {total / GIB:.1f} GiB free"
    if dtype == "bf16":
        with torch.cuda.device(index):
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        words += ", bf16 native" if native else ", bf16 emulated (no bf16 units: slower than on newer GPUs)"
    return words


def _no_cuda() -> str:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA GPU (no driver, or CUDA_VISIBLE_DEVICES hides them)"
