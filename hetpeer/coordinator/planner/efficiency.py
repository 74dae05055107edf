"""What training gets of announced figures: the time model's efficiency terms, and their fit to measurements.

A topology file, or a device's spec sheet, announces TFLOPS and link bandwidths; training gets less. Three terms
map the announced figures to what the time model should use:

- compute: achieved TFLOPS over announced (a training step runs slower than its kernels timed alone: the
  framework's overheads, the transport's threads beside it);
- a link as one TCP stream uses it: `link` times its bandwidth (headers, acknowledgements, the shaper's
  accounting), and no more than `window_bytes` per round trip (2 x the one-way latency): a stream that keeps
  at most W bytes in flight gets W / RTT however wide the link. The window is inf where nothing limits it;
- a fixed overhead every step takes beyond compute and transfers (the optimizer's update, the step's
  boundary): what is left of measured step times once the other terms are in (`fit_overhead`).

The coordinator plans from measurements (what each peer's training achieved, what its probes got of each
link), which already hold these terms; `hetpeer plan --efficiency` applies them to a topology file's figures.
`fit_compute`, `fit_link` and `fit_overhead` find them from measurements (`benchmarks/timemodel_fit.py`, on testbed runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from hetpeer.coordinator.planner.problem import Problem


@dataclass(frozen=True, slots=True)
class Efficiency:
    compute: float = 1.0  # achieved / announced TFLOPS
    link: float = 1.0  # one stream's share of a link's bandwidth, where its window does not bind
    window_bytes: float = math.inf  # bytes one stream keeps in flight
    step_overhead_s: float = 0.0  # fixed seconds a step takes beyond compute and transfers (optimizer, step boundary)

    def __post_init__(self) -> None:
        if not (0 < self.compute <= 10 and 0 < self.link <= 10):
            raise ValueError(f"compute and link efficiency must be in (0, 10], got {self.compute} and {self.link}")
        if not self.window_bytes > 0:
            raise ValueError(f"the stream window must be a positive number of bytes, got {self.window_bytes}")
        if not 0 <= self.step_overhead_s < 3600:
            raise ValueError(f"the step overhead must be 0 to 3600 s, got {self.step_overhead_s}")

    @staticmethod
    def parse(text: str) -> "Efficiency":
        """From `compute=0.6,link=0.93,window_mb=4,overhead_ms=45` (any subset); ValueError naming what is wrong."""
        fields: dict[str, float] = {}
        names = {"compute": "compute", "link": "link", "window_mb": "window_bytes", "overhead_ms": "step_overhead_s"}
        scale = {"window_mb": 1e6, "overhead_ms": 1e-3}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, eq, value = part.partition("=")
            if not eq or key.strip() not in names:
                raise ValueError(f"efficiency terms are compute=X, link=X, window_mb=X and overhead_ms=X; got {part!r}")
            try:
                number = float(value)
            except ValueError:
                raise ValueError(f"{key.strip()} must be a number, got {value!r}") from None
            fields[names[key.strip()]] = number * scale.get(key.strip(), 1.0)
        return Efficiency(**fields)

    def stream_bytes_per_s(self, bandwidth_bytes_per_s: np.ndarray, latency_s: np.ndarray) -> np.ndarray:
        """What one stream gets of links of these bandwidths and one-way latencies."""
        with np.errstate(divide="ignore"):
            windowed = np.where(latency_s > 0, self.window_bytes / (2 * latency_s), np.inf)
        return np.minimum(self.link * bandwidth_bytes_per_s, windowed)

    def apply(self, problem: Problem) -> Problem:
        """The problem as training would see it: compute and every link scaled by these terms."""
        bandwidth = self.stream_bytes_per_s(problem.bandwidth_bytes_per_s, problem.latency_s)
        np.fill_diagonal(bandwidth, np.inf)
        tflops = None if problem.tflops is None else problem.tflops * self.compute
        return replace(problem, bandwidth_bytes_per_s=bandwidth, tflops=tflops, step_overhead_s=self.step_overhead_s)


@dataclass(frozen=True, slots=True)
class Fit:
    value: float
    residuals: np.ndarray  # measured / fitted - 1, per sample


def fit_compute(announced_tflops: np.ndarray, achieved_tflops: np.ndarray) -> Fit:
    """The compute term: the median of achieved over announced (robust to a device that stalled)."""
    if len(announced_tflops) == 0:
        raise ValueError("no device both announced and achieved TFLOPS: nothing to fit")
    _positive("announced TFLOPS", announced_tflops)
    _positive("achieved TFLOPS", achieved_tflops)
    ratio = np.asarray(achieved_tflops, dtype=float) / np.asarray(announced_tflops, dtype=float)
    value = float(np.median(ratio))
    return Fit(value, ratio / value - 1)


def fit_link(bandwidth_bytes_per_s: np.ndarray, latency_s: np.ndarray, measured_bytes_per_s: np.ndarray) -> tuple[Efficiency, np.ndarray]:
    """The link terms (link share, stream window) that best explain what streams measured on links of these
    announced bandwidths and one-way latencies, least squares on log(measured / predicted); and the residuals
    (measured / predicted - 1). The window is searched from 4 kB to 4 GB; where no window below that explains
    the measurements better than none, it is inf (nothing limited the streams). O(samples) per trial."""
    from scipy.optimize import minimize_scalar  # here, not above: every planner import would pay for it

    bandwidth, latency, measured = (np.asarray(v, dtype=float) for v in (bandwidth_bytes_per_s, latency_s, measured_bytes_per_s))
    if len(measured) == 0:
        raise ValueError("no link measurement to fit")
    _positive("link bandwidth", bandwidth)
    _positive("measured stream bandwidth", measured)
    bad_latency = latency[~(np.isfinite(latency) & (latency >= 0))]
    if len(bad_latency):
        raise ValueError(f"link latencies must be finite and not negative, got {bad_latency[:3].tolist()}")

    def error(link: float, window: float) -> float:
        predicted = Efficiency(link=link, window_bytes=window).stream_bytes_per_s(bandwidth, latency)
        return float(np.sum(np.log(measured / predicted) ** 2))

    def fitted(window: float) -> tuple[Efficiency, float]:
        share = minimize_scalar(lambda log_share: error(math.exp(log_share), window), bounds=(math.log(0.01), math.log(10)),
                                method="bounded")
        return Efficiency(link=math.exp(share.x), window_bytes=window), float(share.fun)

    best, best_error = fitted(math.inf)
    search = minimize_scalar(lambda log_w: fitted(math.exp(log_w))[1], bounds=(math.log(4e3), math.log(4e9)), method="bounded")
    windowed, windowed_error = fitted(math.exp(search.x))
    if windowed_error < best_error * (1 - 1e-6):
        best = windowed
    return best, measured / best.stream_bytes_per_s(bandwidth, latency) - 1


def fit_overhead(measured_s: np.ndarray, predicted_s: np.ndarray) -> Fit:
    """The step overhead: the median of measured minus predicted step times (predicted with the other terms, no
    overhead), at least 0; residuals as measured / (predicted + overhead) - 1."""
    measured, predicted = np.asarray(measured_s, dtype=float), np.asarray(predicted_s, dtype=float)
    if len(measured) == 0:
        raise ValueError("no step measured: nothing to fit")
    _positive("measured step time", measured)
    _positive("predicted step time", predicted)
    value = max(0.0, float(np.median(measured - predicted)))
    return Fit(value, measured / (predicted + value) - 1)


def _positive(what: str, values: np.ndarray) -> None:
    """Raise ValueError naming `what` unless every value is positive and finite (a zero or a NaN would fit
    inf or nan)."""
    values = np.asarray(values, dtype=float)
    bad = values[~(np.isfinite(values) & (values > 0))]
    if len(bad):
        raise ValueError(f"every {what} must be positive and finite, got {bad[:3].tolist()}")
