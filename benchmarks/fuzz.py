"""Fuzz benchmark: the fuzz tests' targets (tests/fuzz_targets.py), each run for a while instead of a
bounded number of examples.

    python3 benchmarks/fuzz.py [--seconds 60] [--targets frame_header,payload,...] [--out DIR] [--seed N] [--json]

Targets: frame headers, payloads, the inbox, peer records, plans, topology, join and address files, the
state server, and the coordinator's gRPC API (an in-process server on 127.0.0.1). Per target it prints
the examples run and their rate, the outcomes (accepted, or refused by exception type or gRPC status),
the crashes (any other exception, or an accepted input that breaks an invariant; each input is saved
under --out with its traceback), and how the process's memory grew: the growth of its peak RSS
(`resource.getrusage`) and of its current RSS over the target's --seconds. The frame, payload and inbox
targets declare payloads of up to 2**64 bytes: a receiver that allocated what a header declares would
show here. Before its --seconds, each target warms up (not counted) for up to a third as long: hypothesis
drawing inputs alone, whose own memory grows over its first two chunks and then holds, then a few
examples of the target, so that the growth measured is the target's.
Exit status 1 when any target crashed.

Hypothesis draws the inputs (a test dependency: `pip install -e .[test]`); each target runs in chunks
of a few thousand examples with a fresh seed each, so hypothesis' own bookkeeping stays bounded too.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import math
import os
import random
import resource
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

import fuzz_targets  # noqa: E402  (the strategies and checks the tests use)

CHUNK = 1000  # examples per hypothesis run
WARM_UP = 30  # examples of the target run before the figures start
SAVED_PER_TARGET = 20  # crash inputs written per target; the rest are only counted
ALLOWED_REFUSALS = ("FrameError", "SchemaError")


class _TimeUp(BaseException):
    """Stops a hypothesis run from inside (hypothesis passes on what is not an Exception)."""


def _rss_kib() -> int:
    """The current resident set (Linux); 0 where /proc is missing."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    except (OSError, ValueError, IndexError):
        return 0


def _peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _declared(name: str, case) -> int:
    """The largest payload an input's headers declare (0 where the target has no frames)."""
    if name == "frame_header" and len(case) >= 8 + 29:
        return int.from_bytes(case[8 + 21 : 8 + 29], "little")  # the header's uint64 payload-bytes field
    if name == "payload":
        return case[0].payload_bytes
    if name == "inbox":
        return max(header.payload_bytes for header, _ in case[1])
    return 0


def fuzz(name: str, run, strategy, seconds: float, base_seed: int, out: Path) -> dict:
    outcomes: collections.Counter[str] = collections.Counter()
    crashes: collections.Counter[str] = collections.Counter()
    declared = [0]
    deadline, generate_only = math.inf, True

    def body(case) -> None:
        if time.monotonic() > deadline:
            raise _TimeUp
        if generate_only:
            drawn[0] += 1
            return
        declared[0] = max(declared[0], _declared(name, case))
        try:
            outcomes[run(case)] += 1
        except Exception as error:  # a crash: anything the target does not allow
            kind = f"{type(error).__name__}: {str(error).splitlines()[0][:80] if str(error) else ''}"
            crashes[kind] += 1
            if sum(crashes.values()) <= SAVED_PER_TARGET:
                out.mkdir(parents=True, exist_ok=True)
                path = out / f"{name}-{sum(crashes.values()):02d}.txt"
                path.write_text(f"{fuzz_targets.describe(case)}\n\n{''.join(traceback.format_exception(error))}")

    def run_chunk(index: int, examples: int) -> None:
        seed(base_seed + index)(
            settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                     suppress_health_check=list(HealthCheck))(given(strategy)(body))
        )()

    # Not what is measured: hypothesis' own memory, which grows over its first two chunks and then holds
    # (drawing inputs alone, for up to a third of the time), and the target's lazy imports, caches and set-up.
    drawn, rss_before_drawing = [0], _rss_kib()
    deadline = time.monotonic() + min(seconds / 3, 30.0)
    for chunk in (-3, -2):
        try:
            run_chunk(chunk, CHUNK)
        except _TimeUp:
            break
    deadline, generate_only = math.inf, False
    drawing_growth = _rss_kib() - rss_before_drawing
    run_chunk(-1, WARM_UP)
    outcomes.clear()  # a crash in the warm-up stays counted
    peak, rss, started = _peak_kib(), _rss_kib(), time.perf_counter()
    deadline = time.monotonic() + seconds
    chunk = 0
    while time.monotonic() < deadline:
        try:
            run_chunk(chunk, CHUNK)
        except _TimeUp:
            break
        chunk += 1
    elapsed = time.perf_counter() - started
    examples = sum(outcomes.values()) + sum(crashes.values())
    return {
        "target": name,
        "examples": examples,
        "examples_per_s": round(examples / elapsed, 1),
        "outcomes": dict(outcomes.most_common()),
        "refusals": {k: v for k, v in outcomes.items() if k in ALLOWED_REFUSALS},
        "crashes": dict(crashes.most_common()),
        "largest_declared_payload_bytes": declared[0],
        "peak_rss_growth_mib": round((_peak_kib() - peak) / 1024, 1),
        "rss_growth_mib": round((_rss_kib() - rss) / 1024, 1),
        "peak_rss_mib": round(_peak_kib() / 1024, 1),
        "warm_up": {"inputs_drawn": drawn[0], "rss_growth_mib": round(drawing_growth / 1024, 1)},  # hypothesis alone
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [*fuzz_targets.targets(), "api"]
    parser.add_argument("--seconds", type=float, default=60.0, help="per target")
    parser.add_argument("--targets", default=",".join(names), help=f"comma-separated, of {', '.join(names)}")
    parser.add_argument("--out", type=Path, default=None, help="where crash inputs are saved (default: a new temp folder)")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed of the first chunk (default: random)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on the last line")
    args = parser.parse_args()
    chosen = [t for t in args.targets.split(",") if t]
    unknown = sorted(set(chosen) - set(names))
    if unknown or args.seconds <= 0:
        parser.error(f"unknown targets {unknown} (known: {', '.join(names)})" if unknown else "--seconds must be positive")
    logging.getLogger("hetpeer").setLevel(logging.CRITICAL)  # refusals are logged as warnings: millions of them
    out = args.out or Path(tempfile.mkdtemp(prefix="hetpeer-fuzz-"))
    base_seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    targets = fuzz_targets.targets()
    print(f"fuzzing {len(chosen)} targets for {args.seconds:g} s each, seed {base_seed}; crash inputs go to {out}")
    results = []
    for name in chosen:
        if name == "api":
            rig = fuzz_targets.ApiRig()
            try:
                result = fuzz(name, lambda case: fuzz_targets.run_api(rig, case), fuzz_targets.api_calls(),
                              args.seconds, base_seed, out)
                try:
                    rig.check_serving()
                    result["serving_after"] = True
                except Exception as error:  # counted as a crash: the server stopped answering well-formed calls
                    result["serving_after"] = False
                    result["crashes"][f"not serving after the run: {error!r}"[:100]] = 1
            finally:
                rig.close()
        else:
            target = targets[name]
            result = fuzz(name, target.run, target.strategy, args.seconds, base_seed, out)
        results.append(result)
        crashes = sum(result["crashes"].values())
        print(
            f"{name:13s} {result['examples']:8d} examples {result['examples_per_s']:8.1f}/s  "
            f"crashes {crashes}  peak RSS +{result['peak_rss_growth_mib']} MiB, RSS +{result['rss_growth_mib']} MiB "
            f"(largest declared payload {result['largest_declared_payload_bytes']} B; drawing "
            f"{result['warm_up']['inputs_drawn']} inputs alone: RSS +{result['warm_up']['rss_growth_mib']} MiB)\n"
            f"{'':13s} outcomes {result['outcomes']}"
            + (f"\n{'':13s} crashes {result['crashes']}" if crashes else ""),
            flush=True,
        )
    crashed = sum(sum(r["crashes"].values()) for r in results)
    print(f"total: {sum(r['examples'] for r in results)} examples, {crashed} crashes"
          + (f" (inputs in {out})" if crashed else ""))
    if args.json:
        print(json.dumps({"seconds": args.seconds, "seed": base_seed, "crashes": crashed, "targets": results}))
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
