"""The time model against the testbed: fit its efficiency terms, then predict every plan kind from announced figures.

    python3 benchmarks/testbed.py --out /tmp/tb          # a testbed run keeps plans.json and windows.json
    python3 benchmarks/timemodel_fit.py /tmp/tb [/tmp/tb2 ...] [--json]

From the runs' peer records (`planner/efficiency.py`):
- compute: each peer's achieved TFLOPS (its training steps) against its announced TFLOPS (its probe); the term
  is the median ratio;
- links: what each peer's probe (one TCP stream) measured of each link against the link's announced bandwidth
  (the topology's, times the run's --scale) at its one-way latency; the terms are the stream's share of the
  link and the window that bounds it per round trip, least squares on log(measured / predicted).
Residuals (measured / fitted - 1) are printed per term, links also by latency.

- step overhead: what those two terms leave of the measured step times, a fixed time per step (the
  optimizer's update, the step boundary): the median of measured minus predicted.
Then every window of every run is predicted from announced figures alone (announced TFLOPS, the topology's
links), with the fitted terms (the overhead fitted on the other plan kinds' windows only, so that no kind's
error is fitted to itself) and without them, against its measured seconds per step; and beside that the
coordinator's own prediction from measurements. Goal: within 15% for every plan kind with the fitted terms.
`--json` prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from testbed import KINDS, world_wide  # noqa: E402  (the testbed benchmark's topology)

from hetpeer.coordinator.planner import PlannerConfig, Problem  # noqa: E402
from hetpeer.coordinator.planner.efficiency import Efficiency, fit_compute, fit_link, fit_overhead  # noqa: E402
from hetpeer.coordinator.policy import running_report  # noqa: E402
from hetpeer.protocol.plan import Plan  # noqa: E402
from hetpeer.protocol.topology import Topology  # noqa: E402
from hetpeer.protocol.modelspec import preset  # noqa: E402
from hetpeer.protocol.workload import Workload  # noqa: E402
from hetpeer.testbed.project import TestbedConfig, peer_name  # noqa: E402

GOAL = 0.15  # |measured / predicted - 1| for every plan kind
LATENCY_BUCKETS_MS = (0, 10, 50, 100, 200, np.inf)
BANDWIDTH_BUCKETS_MB_S = (0, 1, 2, 5, 10, np.inf)  # far links are narrow too: the two views tell them apart


class Run:
    """One testbed run's folder: its topology, the peers' records, the plans and the windows measured."""

    def __init__(self, folder: Path) -> None:
        try:
            windows = json.loads((folder / "windows.json").read_text())
            plans = json.loads((folder / "plans.json").read_text())
        except (OSError, ValueError) as error:
            raise SystemExit(f"{folder}: not the --out folder of a benchmarks/testbed.py run ({error})") from None
        self.folder = folder
        self.scale = windows["scale"]
        self.topology: Topology = world_wide(windows["per_region"])
        defaults = TestbedConfig(topology=self.topology, out=folder)
        self.workload = Workload(preset(defaults.model), batch=windows["batch"], micro_batch=defaults.micro_batch,
                                 dtype=defaults.dtype)
        # the benchmark's own output, read as written (the peers' keys, which bind the ids, are not kept)
        self.records = [raw for raw in windows["records"] if raw["state"] != "leaving"]
        self.plans = {kind: Plan.from_wire(raw) for kind, raw in plans["plans"].items()}
        self.windows = windows["windows"]
        by_name = {peer_name(d.id): d for d in self.topology.devices}
        self.device = {r["device_id"]: by_name[r["device_id"].rsplit("-", 1)[0]] for r in self.records}

    def link_samples(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(announced bytes/s, announced one-way latency s, measured bytes/s, measured latency s) per probed link."""
        rows = []
        for record in self.records:
            links = record["links"]
            for peer, latency_s, bandwidth in zip(links["peers"], links["latency_s"], links["bandwidth_bytes_per_s"]):
                if peer in self.device:
                    link = self.topology.link(self.device[record["device_id"]], self.device[peer])
                    rows.append((link.bandwidth_gbps * 1e9 / 8 * self.scale, link.latency_ms / 1e3, bandwidth, latency_s))
        return tuple(np.array(column) for column in zip(*rows))

    def announced_problem(self) -> Problem:
        """The planner's problem from announced figures only: each peer's probe TFLOPS, the topology's links."""
        ids = tuple(sorted(self.device))
        devices = [self.device[d] for d in ids]
        n = len(ids)
        latency, bandwidth = np.zeros((n, n)), np.full((n, n), np.inf)
        for i, a in enumerate(devices):
            for j, b in enumerate(devices):
                if i != j:
                    link = self.topology.link(a, b)
                    latency[i, j], bandwidth[i, j] = link.latency_ms / 1e3, link.bandwidth_gbps * 1e9 / 8 * self.scale
        tflops = {r["device_id"]: r["tflops"] for r in self.records}
        return Problem(device_ids=ids, latency_s=latency, bandwidth_bytes_per_s=bandwidth, workload=self.workload,
                       tflops=np.array([tflops[d] for d in ids]))


def spread(residuals: np.ndarray) -> str:
    a = np.abs(residuals)
    return f"median |r| {np.median(a):.1%}, 90th percentile {np.quantile(a, 0.9):.1%}, worst {residuals[np.argmax(a)]:+.1%} ({len(a)} samples)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="--out folders of benchmarks/testbed.py runs")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    runs = [Run(folder) for folder in args.runs]
    trained = [r for run in runs for r in run.records if r["achieved_tflops"] is not None]
    compute = fit_compute(np.array([r["tflops"] for r in trained]), np.array([r["achieved_tflops"] for r in trained]))
    bandwidth, latency, measured, measured_latency = (np.concatenate(c) for c in zip(*(run.link_samples() for run in runs)))
    links, link_residuals = fit_link(bandwidth, latency, measured)
    terms = Efficiency(compute=compute.value, link=links.link, window_bytes=links.window_bytes)
    window = "none binds" if not np.isfinite(terms.window_bytes) else f"{terms.window_bytes / 1e6:.3g} MB"
    print(f"fit on {len(runs)} run(s): compute {terms.compute:.3f} of announced TFLOPS; one stream gets {terms.link:.3f} "
          f"of a link; stream window {window}")
    print(f"  compute residuals: {spread(compute.residuals)}")
    print(f"  link residuals:    {spread(link_residuals)}")
    for low, high in zip(LATENCY_BUCKETS_MS, LATENCY_BUCKETS_MS[1:]):
        inside = (latency * 1e3 >= low) & (latency * 1e3 < high)
        if inside.any():
            share = np.median(measured[inside] / bandwidth[inside])
            span = f"{low:g}-{high:g} ms" if np.isfinite(high) else f"{low:g} ms and more"
            print(f"    one-way {span}: measured/announced median {share:.3f}, residuals {spread(link_residuals[inside])}")
    for low, high in zip(BANDWIDTH_BUCKETS_MB_S, BANDWIDTH_BUCKETS_MB_S[1:]):
        inside = (bandwidth / 1e6 >= low) & (bandwidth / 1e6 < high)
        if inside.any():
            span = f"{low:g}-{high:g} MB/s" if np.isfinite(high) else f"{low:g} MB/s and more"
            print(f"    announced {span}: measured/announced median {np.median(measured[inside] / bandwidth[inside]):.3f}, "
                  f"residuals {spread(link_residuals[inside])}")
    print(f"  latency: measured minus announced one-way, median {np.median(measured_latency - latency) * 1e3:+.2f} ms "
          f"(the probes' own overhead; not fitted)")
    config = PlannerConfig(cost_model="time")
    # every window predicted from announced figures: with the compute and link terms, and with none
    windows = []
    for run in runs:
        problem = run.announced_problem()
        for window_ in run.windows:
            plan = run.plans[window_["kind"]]
            windows.append((window_["kind"], window_["measured_s"], window_["predicted_s"],
                            running_report(terms.apply(problem), config, plan).cost["total_s"], running_report(problem, config, plan).cost["total_s"]))
    kinds = [kind for kind in KINDS if any(w[0] == kind for w in windows)]
    # the step overhead: what the other terms leave of measured steps; each kind is predicted with the overhead
    # fitted on the other kinds' windows only (held out), so the errors below are not fitted to themselves
    overhead = fit_overhead(np.array([w[1] for w in windows]), np.array([w[3] for w in windows]))
    terms = replace(terms, step_overhead_s=overhead.value)
    print(f"  step overhead: {overhead.value * 1e3:.1f} ms (median of measured minus predicted steps); "
          f"residuals {spread(overhead.residuals)}")
    result: dict = {"terms": {"compute": terms.compute, "link": terms.link, "window_bytes": terms.window_bytes,
                              "step_overhead_s": terms.step_overhead_s},
                    "compute_residuals": compute.residuals.tolist(), "link_residuals": link_residuals.tolist(),
                    "overhead_residuals": overhead.residuals.tolist(), "kinds": {}}
    print("\nseconds per step, measured against predicted (median over windows; the overhead held out per kind):")
    print(f"  {'plan':<12} {'measured':>9} {'announced+fit':>14} {'error':>7} {'announced':>10} {'error':>7} {'from measurements':>18} {'error':>7}")
    ok = True
    for kind in kinds:
        mine = [w for w in windows if w[0] == kind]
        others = [w for w in windows if w[0] != kind]
        held_out = fit_overhead(np.array([w[1] for w in others]), np.array([w[3] for w in others])).value if others else 0.0
        row = {"measured_s": statistics.median(w[1] for w in mine), "fitted_s": statistics.median(w[3] + held_out for w in mine),
               "nominal_s": statistics.median(w[4] for w in mine), "coordinator_s": statistics.median(w[2] for w in mine),
               "held_out_overhead_s": held_out}
        errors = {name: row["measured_s"] / row[name] - 1 for name in ("fitted_s", "nominal_s", "coordinator_s")}
        ok &= abs(errors["fitted_s"]) <= GOAL
        result["kinds"][kind] = {**row, "errors": errors}
        print(f"  {kind:<12} {row['measured_s']:>9.3f} {row['fitted_s']:>14.3f} {errors['fitted_s']:>+7.1%} {row['nominal_s']:>10.3f} "
              f"{errors['nominal_s']:>+7.1%} {row['coordinator_s']:>18.3f} {errors['coordinator_s']:>+7.1%}")
    print(f"\nas `hetpeer plan --efficiency`: compute={terms.compute:.3g},link={terms.link:.3g}"
          + (f",window_mb={terms.window_bytes / 1e6:.3g}" if np.isfinite(terms.window_bytes) else "")
          + f",overhead_ms={terms.step_overhead_s * 1e3:.3g}")
    print(f"\ngoal: every plan kind within {GOAL:.0%} from announced figures with the fitted terms: {'met' if ok else 'NOT met'}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
