"""What this machine can do: achieved TFLOPS and the memory a peer uses.

`profile_machine` is what a joining peer announces: the accelerator's name, one block of the model
timed in the training dtype (over the slowdown, for an emulated slower device: `Slowdown` stretches its
training to that pace), the free memory, and which device it computes on (`compute_identity`:
an opaque key that peers on the same CPU cores or GPU share, and its share of that device).

`block_tflops` times forward and backward passes of one transformer block of the model at the
plan's micro-batch, in the training dtype (bf16 runs under `torch.autocast` with fp32 weights, as the
stage worker does), and divides the FLOPs the planner counts for them (3x the forward) by the time.
It is what the planner's `time` model means by a device's TFLOPS: throughput achieved on this model,
with its attention, norms and activations, not a datasheet peak. `matmul_tflops` is the plain
matrix-multiply rate, the usual quick probe, for comparison. `TensorPeak` measures the peak bytes of
tensors on any device, as `torch.cuda.max_memory_allocated` does on a GPU. `Slowdown` emulates a slower
accelerator on a fast one (tests and benchmarks of heterogeneous swarms).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import platform
import resource
import statistics
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import ContextManager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hetpeer.peer.model import build_stage
from hetpeer.protocol.modelspec import ModelSpec
from hetpeer.protocol.stepcosts import StepCosts
from hetpeer.protocol.workload import Workload


AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # what the stage worker computes in
TIMING_S = 0.005  # a timing lasts at least this long, however short one call is
MAX_CALLS_PER_TIMING = 1000


@dataclass(frozen=True, slots=True)
class MachineProfile:
    device_name: str
    tflops: float  # achieved forward + backward throughput of one block in the training dtype
    memory_bytes: int  # free accelerator memory (cuda) or available system memory (cpu)
    compute_key: str | None = None  # the device it computes on, opaque (`compute_identity`); None: unknown
    compute_share: float = 1.0  # of that device, what it uses computing flat out
    compute_background: float = 0.0  # of that device, what other work kept busy while it did not train (`DeviceLoad`)
    compute_own: float = 0.0  # of that device, what this peer's own process kept busy over the same time
    step_costs: StepCosts = StepCosts()  # what a stage's step costs beyond its blocks (`pipeline.steptime`)
    timings: int = 1  # how many times the peer has timed the device since it started (`tflops` is the fastest)

    def __post_init__(self) -> None:
        if not self.device_name:
            raise ValueError("device_name must not be empty")
        if not (math.isfinite(self.tflops) and self.tflops > 0):
            raise ValueError(f"tflops must be finite and positive, got {self.tflops!r}")
        if self.memory_bytes < 0:
            raise ValueError(f"memory_bytes must not be negative, got {self.memory_bytes}")
        if self.timings < 1:
            raise ValueError(f"timings must be at least 1, got {self.timings}")
        if not (math.isfinite(self.compute_share) and 0 < self.compute_share <= 1):
            raise ValueError(f"compute_share must be in (0, 1], got {self.compute_share!r}")
        for name in ("compute_background", "compute_own"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value < 1):
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")


def profile_machine(
    spec: ModelSpec, micro_batch: int, dtype: str, device: str, slowdown: float = 1.0, seconds: float = 1.0, swarm: str = ""
) -> MachineProfile:
    """What this peer announces about its machine; the compute probe takes about `seconds`.

    TFLOPS are the fastest pass's: what the device achieves for a peer that has it to itself, as a peer
    of a real swarm has its GPU. (Peers sharing one machine, as in `hetpeer swarm`, start and probe at
    different moments: a typical pass would credit the first to probe with the whole machine.) A peer
    emulating a device `slowdown` times slower announces its machine's figure over `slowdown`: the
    emulation (`Slowdown`) stretches each pass of training to `slowdown` times the fastest it has seen,
    and over a run that is the machine's own pace. Timing a few slowed passes instead, each started cold
    after its sleep, read the 12x peers of `benchmarks/vs_hivemind.py` 2.2x to 3.3x slower than its 6x ones,
    which trained 2.0x apart, and the planner left the slow ones out."""
    tflops = block_tflops(spec, micro_batch, device, seconds, dtype=dtype, best=True) / slowdown
    key, share = compute_identity(device, swarm, slowdown)
    return MachineProfile(device_name(device), tflops, free_memory_bytes(device), key, share)


def compute_identity(device: str, swarm: str, slowdown: float = 1.0) -> tuple[str | None, float]:
    """(key, share) of the device this peer computes on, for the planner to see peers that share one.

    The key is 16 hex digits of a hash of the swarm's name and what identifies the device: a GPU's UUID, or
    for CPU threads this kernel's boot id and the cores this process may run on (containers on one host share
    them). Peers of one swarm on one device announce the same key; it says nothing else about the machine, and
    the swarm's name in the hash keeps keys of different swarms apart. None where nothing identifies it.
    The share is what of the device the peer uses computing flat out: its threads over those cores (1 on a
    GPU), over its emulated slowdown (a slowed peer sleeps the rest of its time)."""
    if torch.device(device).type == "cuda":
        identity = str(getattr(torch.cuda.get_device_properties(torch.device(device)), "uuid", "") or "")
        share = 1.0
    else:
        cores = usable_cores()
        boot = Path("/proc/sys/kernel/random/boot_id")
        identity = f"{boot.read_text().strip()} {cores}" if boot.exists() else ""
        share = min(1.0, torch.get_num_threads() / len(cores))
    key = hashlib.sha256(f"hetpeer compute\0{swarm}\0{identity}".encode()).hexdigest()[:16] if identity else None
    return key, share / slowdown


def usable_cores() -> list[int]:
    """The CPU cores this process may run on (all of them where the system does not say)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


class DeviceLoad:
    """What of this peer's CPU cores other work keeps busy, and what this peer's own process does: each
    `sample()` reads the share of those cores busy since the last one (the kernel's count, /proc/stat) and
    this process's CPU time over it; the figures are the means of the last `window` samples: the load the
    machine carries on average beside this process (other peers' processes and DHT daemons, a coordinator
    beside them), bursts included, since a training step that meets one waits for it, and this process's own.
    Both go out in the peer's record: where peers share a device, the coordinator takes from the others'
    load what they announce as their own (starting, timing their devices, probing links: work that stops
    or shrinks when they train, `coordinator/planner/sharing.py`).
    It reads nothing where the kernel does not say (None), and nothing of a GPU: a GPU's other work is not
    counted."""

    def __init__(self, device: str, window: int = 8) -> None:
        stat = Path("/proc/stat")
        self._cores = usable_cores()
        self._usable = torch.device(device).type == "cpu" and stat.exists() and bool(self._cores)
        self._window = window
        self._samples: list[tuple[float, float]] = []
        self._last = self._read() if self._usable else None

    def _read(self) -> tuple[float, float, float]:
        """(busy seconds of this peer's cores, all seconds of them, this process's CPU seconds)."""
        tick = os.sysconf("SC_CLK_TCK")
        busy = total = 0.0
        wanted = {f"cpu{c}" for c in self._cores}
        for line in Path("/proc/stat").read_text().splitlines():
            name, *fields = line.split()
            if name in wanted:
                values = [int(v) for v in fields[:8]]
                idle = values[3] + values[4]  # idle and iowait
                total += sum(values)
                busy += sum(values) - idle
        own = os.times()
        return busy / tick, total / tick, own.user + own.system

    def skip(self) -> None:
        """Leave the time since the last sample out: the next sample starts now."""
        if self._usable:
            self._last = self._read()

    def sample(self) -> tuple[float, float] | None:
        """Add a sample; (other work, this process) now, each a share of the cores in [0, 1), or None where it is
        not measured."""
        if not self._usable:
            return None
        now = self._read()
        busy, total, own = (b - a for a, b in zip(self._last, now))
        self._last = now
        if total > 0:
            mine = min(own / total, busy / total, 0.95)
            other = min(0.95 - mine, max(0.0, (busy - own) / total))
            self._samples = (self._samples + [(other, mine)])[-self._window :]
        if not self._samples:
            return None
        return statistics.fmean(s[0] for s in self._samples), statistics.fmean(s[1] for s in self._samples)


def device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    model = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    return f"cpu: {model or platform.processor() or platform.machine() or 'unknown'} x{torch.get_num_threads()}"


def free_memory_bytes(device: str) -> int:
    """Free accelerator memory, or the system memory this process can still use: the machine's available
    memory, or what its control group (a container's memory limit) leaves, whichever is less."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    available = None
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    left = cgroup_free_bytes()
    return available if left is None else min(available, left)


def cgroup_free_bytes(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The memory limit of this process's control group less what the group uses now (cgroup v2's
    memory.max and memory.current, or v1's memory/memory.limit_in_bytes and usage_in_bytes); None without
    a limit. Reads the group mounted at `root`: inside a container that is the container's own."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit_text = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= 2**60:  # v1 writes "no limit" as ~2^63
            return None
        return max(0, int(limit_text) - usage)
    return None


def block_tflops(
    spec: ModelSpec,
    micro_batch: int,
    device: str = "cpu",
    seconds: float = 1.0,
    dtype: str = "fp32",
    best: bool = False,
) -> float:
    """Achieved TFLOPS in `dtype` of forward + backward through one block of `spec`, from at least 3
    timed passes: the median pass (what the device gives this process now, sharing it), or with `best`
    the fastest (what it gives a process that has it to itself: other work only ever slows a pass). The
    fastest pass computed on one CPU thread is timed by the CPU time that thread used: the time other
    processes hold the core is not counted (the 8 peers of `benchmarks/vs_hivemind.py` starting on 2 cores
    timed passes up to 5 times slower by the clock than alone; by the thread's CPU time, up to about 1.5 times:
    a busy machine still slows a pass through the caches it shares)."""
    if dtype not in AUTOCAST_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(AUTOCAST_DTYPES)}, got {dtype!r}")
    block = build_stage(spec.with_layers(3), 1, 2, device=device)  # one block alone: no embeddings, no head
    x = torch.randn(micro_batch, spec.seq_len, spec.hidden, device=device, requires_grad=True)
    flops = 3 * micro_batch * Workload(spec, batch=micro_batch, micro_batch=micro_batch).layer_fwd_flops_per_seq
    autocast = autocast_for(device, dtype)

    def run() -> None:
        with autocast:
            y = block(x)
        y.float().sum().backward()

    alone = best and torch.device(device).type == "cpu" and torch.get_num_threads() == 1
    return flops / time_per_call(run, device, seconds, best, time.thread_time if alone else time.perf_counter) / 1e12


def autocast_for(device: str, dtype: str) -> ContextManager:
    """What the stage worker computes `dtype` under on `device`: nothing for fp32, `torch.autocast` for bf16
    (fp32 weights). Reusable."""
    cast = AUTOCAST_DTYPES[dtype]
    return contextlib.nullcontext() if cast is None else torch.autocast(torch.device(device).type, dtype=cast)


def matmul_tflops(size: int = 1024, device: str = "cpu", seconds: float = 1.0) -> float:
    """Achieved fp32 TFLOPS of square matrix multiplies of `size`."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    return 2 * size**3 / time_per_call(lambda: a @ b, device, seconds) / 1e12


def time_per_call(run, device: str, seconds: float, best: bool = False, clock=time.perf_counter) -> float:
    """The median (or with `best` the shortest) time of one call by `clock`, over at least 3 timings and
    about `seconds`. Not the mean: a burst of other work on the machine (another process starting, a peer's
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
        timing_started = clock()
        for _ in range(calls):
            run()
        _sync(device)
        times.append((clock() - timing_started) / calls)
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


class Slowdown:
    """Emulates an accelerator `factor` times slower: the work inside `with slowdown.of(key):` (or `with
    slowdown:`, key None) lasts `factor` times the fastest this object has seen that work done, or as long
    as it took if that is longer. A device runs its kernels at its own pace: scaling each run's own time
    instead would also scale the host's noise (a busy core, the GIL) `factor`-fold. A key names one kind of
    work (forward or backward of one micro-batch shape, say); work that changes needs a new key or a new
    Slowdown. Reusable and thread-safe (each thread times its own blocks)."""

    def __init__(self, factor: float) -> None:
        if not (math.isfinite(factor) and factor >= 1):
            raise ValueError(f"slowdown factor must be a finite number >= 1, got {factor!r}")
        self.factor = float(factor)
        self._starts = threading.local()
        self._fastest: dict[object, float] = {}
        self._lock = threading.Lock()

    def of(self, key: object) -> "_Timed":
        return _Timed(self, key)

    def __enter__(self) -> "Slowdown":
        self._begin(None)
        return self

    def __exit__(self, *exc: object) -> None:
        self._end()

    def _begin(self, key: object) -> None:
        if self.factor != 1:
            _sync_cuda()  # time this block's kernels, not the queue left by earlier ones
            self._stack().append((time.perf_counter(), key))

    def _end(self) -> None:
        if self.factor != 1:
            _sync_cuda()  # kernels run asynchronously: wait for them before reading the clock
            started, key = self._stack().pop()
            elapsed = time.perf_counter() - started
            with self._lock:
                fastest = self._fastest[key] = min(self._fastest.get(key, math.inf), elapsed)
            time.sleep(max(0.0, self.factor * fastest - elapsed))

    def _stack(self) -> list[tuple[float, object]]:
        if not hasattr(self._starts, "stack"):
            self._starts.stack = []
        return self._starts.stack


class _Timed:
    def __init__(self, slowdown: Slowdown, key: object) -> None:
        self.slowdown, self.key = slowdown, key

    def __enter__(self) -> "_Timed":
        self.slowdown._begin(self.key)
        return self

    def __exit__(self, *exc: object) -> None:
        self.slowdown._end()


def _sync_cuda() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
