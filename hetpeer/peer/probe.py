"""What this machine can do: achieved TFLOPS and the memory a peer uses.

`block_tflops` times forward and backward passes of one transformer block of the model at the
plan's micro-batch, in the training dtype (bf16 runs under `torch.autocast` with fp32 weights, as the
stage worker does), and divides the FLOPs the planner counts for them (3x the forward) by the time.
It is what the planner's `time` model means by a device's TFLOPS: throughput achieved on this model,
with its attention, norms and activations, not a datasheet peak. `matmul_tflops` is the plain
matrix-multiply rate, the usual quick probe, for comparison. `TensorPeak` measures the peak bytes of
tensors on any device, as `torch.cuda.max_memory_allocated` does on a GPU.
"""

from __future__ import annotations

import contextlib
import math
import resource
import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import ContextManager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hetpeer.peer.model import build_stage
from hetpeer.protocol.workload import ModelSpec, Workload


AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # what the stage worker computes in
TIMING_S = 0.005  # a timing lasts at least this long, however short one call is
MAX_CALLS_PER_TIMING = 1000


def block_tflops(
    spec: ModelSpec,
    micro_batch: int,
    device: str = "cpu",
    seconds: float = 1.0,
    dtype: str = "fp32",
    around: ContextManager | None = None,
    best: bool = False,
) -> float:
    """Achieved TFLOPS in `dtype` of forward + backward through one block of `spec`, from at least 3
    timed passes: the median pass (what the device gives this process now, sharing it), or with `best`
    the fastest (what it gives a process that has it to itself: other work only ever slows a pass).
    `around`, a reusable context manager (e.g. a `measure.Slowdown`), is entered around each pass."""
    if dtype not in AUTOCAST_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(AUTOCAST_DTYPES)}, got {dtype!r}")
    block = build_stage(spec.with_layers(3), 1, 2, device=device)  # one block alone: no embeddings, no head
    x = torch.randn(micro_batch, spec.seq_len, spec.hidden, device=device, requires_grad=True)
    flops = 3 * micro_batch * Workload(spec, batch=micro_batch, micro_batch=micro_batch).layer_fwd_flops_per_seq
    cast = AUTOCAST_DTYPES[dtype]
    autocast = (
        contextlib.nullcontext() if cast is None else torch.autocast(torch.device(device).type, dtype=cast)
    )
    wrapper = contextlib.nullcontext() if around is None else around

    def run() -> None:
        with wrapper:
            with autocast:
                y = block(x)
            y.float().sum().backward()

    return flops / _time_per_call(run, device, seconds, best) / 1e12


def matmul_tflops(size: int = 1024, device: str = "cpu", seconds: float = 1.0) -> float:
    """Achieved fp32 TFLOPS of square matrix multiplies of `size`."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    return 2 * size**3 / _time_per_call(lambda: a @ b, device, seconds) / 1e12


def _time_per_call(run, device: str, seconds: float, best: bool = False) -> float:
    """The median (or with `best` the shortest) time of one call, over at least 3 timings and about
    `seconds`. Not the mean: a burst of other work on the machine (another process starting, a peer's
    DHT node) slows a few calls, and should not decide the figure. A timing runs enough calls to last
    `TIMING_S` (judged from a call after the warm-up: a first call pays for set-up, kernel loading on an
    accelerator) and synchronizes the device once, at its end: an
    accelerator queues the calls' kernels, and a synchronization after every call would time launch gaps
    and an empty queue instead of the work."""
    run()  # warm up
    _sync(device)
    started = time.perf_counter()
    run()
    _sync(device)
    calls = max(1, min(MAX_CALLS_PER_TIMING, math.ceil(TIMING_S / max(time.perf_counter() - started, 1e-9))))
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - started < seconds:
        timing_started = time.perf_counter()
        for _ in range(calls):
            run()
        _sync(device)
        times.append((time.perf_counter() - timing_started) / calls)
    return min(times) if best else statistics.median(times)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def resident_bytes() -> int:
    """This process's resident memory now (Linux), or its peak where /proc is missing."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return peak_resident_bytes()


def peak_resident_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class TensorPeak(TorchDispatchMode):
    """The bytes of tensor storages that operations create while it is active, now and at their peak: what
    `torch.cuda.max_memory_allocated` counts on a GPU, on any device (the CPU keeps no such count). Storages
    made before it started (parameters, optimizer state) and outputs that share an input's storage (views,
    in-place operations) are not counted. Every operation runs through Python while it is active: for
    measuring, not for training."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}  # storage -> bytes
        self.now_bytes = 0
        self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage()._cdata not in inputs:
                self._track(tensor.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._live:
            return
        self._live[key] = storage.nbytes()
        self.now_bytes += storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.now_bytes)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.now_bytes -= self._live.pop(key)
