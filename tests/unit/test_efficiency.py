"""The time model's efficiency terms: applied to a problem, parsed from the command line, fitted to measurements."""

from __future__ import annotations

import numpy as np
import pytest

from hetpeer.coordinator.planner import Problem, synthetic
from hetpeer.coordinator.planner.efficiency import Efficiency, fit_compute, fit_link, fit_overhead
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload


def test_a_stream_gets_its_share_of_a_link_and_no_more_than_its_window_per_round_trip():
    terms = Efficiency(link=0.9, window_bytes=1e6)
    bandwidth = np.array([1e8, 1e8, 1e6, 1e8])
    latency = np.array([0.001, 0.05, 0.05, 0.0])
    got = terms.stream_bytes_per_s(bandwidth, latency)
    assert got.tolist() == pytest.approx([0.9e8, 1e6 / 0.1, 0.9e6, 0.9e8])  # a zero latency: no window limit


def test_applied_terms_scale_compute_and_links_and_leave_the_rest():
    raw = synthetic.random_topology(6, 2, np.random.default_rng(0))
    problem = Problem.from_topology(Topology.from_wire(raw), Workload(preset("tiny"), batch=8))
    seen = Efficiency(compute=0.5, link=0.8).apply(problem)
    off = ~np.eye(6, dtype=bool)
    assert seen.tflops == pytest.approx(problem.tflops * 0.5)
    assert seen.bandwidth_bytes_per_s[off] == pytest.approx(problem.bandwidth_bytes_per_s[off] * 0.8)
    assert np.all(np.isinf(np.diag(seen.bandwidth_bytes_per_s)))
    assert seen.latency_s is problem.latency_s and seen.device_ids == problem.device_ids
    assert Efficiency().apply(problem).tflops == pytest.approx(problem.tflops)


@pytest.mark.parametrize("text, terms", [
    ("compute=0.6", Efficiency(compute=0.6)),
    ("link=0.93, window_mb=4", Efficiency(link=0.93, window_bytes=4e6)),
    ("", Efficiency()),
])
def test_terms_parse_from_words(text, terms):
    assert Efficiency.parse(text) == terms


@pytest.mark.parametrize("text, words", [
    ("speed=1", "efficiency terms are"), ("compute", "efficiency terms are"), ("compute=fast", "must be a number"),
    ("compute=0", r"in \(0, 10\]"), ("link=-1", r"in \(0, 10\]"), ("window_mb=0", "positive number of bytes"),
    ("compute=nan", r"in \(0, 10\]"),
])
def test_bad_terms_are_refused_naming_them(text, words):
    with pytest.raises(ValueError, match=words):
        Efficiency.parse(text)


def test_the_compute_fit_is_the_median_ratio_with_residuals_around_it():
    found = fit_compute(np.array([10.0, 10.0, 20.0, 5.0]), np.array([6.0, 5.0, 12.0, 0.5]))
    assert found.value == pytest.approx(0.55)
    assert found.residuals == pytest.approx([0.6 / 0.55 - 1, 0.5 / 0.55 - 1, 0.6 / 0.55 - 1, 0.1 / 0.55 - 1])
    with pytest.raises(ValueError, match="nothing to fit"):
        fit_compute(np.array([]), np.array([]))


def test_the_link_fit_finds_a_window_where_one_limits_the_streams():
    rng = np.random.default_rng(1)
    bandwidth, latency = rng.uniform(1e6, 1e8, 300), rng.uniform(0.001, 0.2, 300)
    measured = Efficiency(link=0.9, window_bytes=2e6).stream_bytes_per_s(bandwidth, latency) * np.exp(rng.normal(0, 0.03, 300))
    terms, residuals = fit_link(bandwidth, latency, measured)
    assert terms.link == pytest.approx(0.9, rel=0.03) and terms.window_bytes == pytest.approx(2e6, rel=0.05)
    assert np.median(np.abs(residuals)) < 0.05


def test_the_link_fit_leaves_the_window_unlimited_where_latency_does_not_matter():
    rng = np.random.default_rng(2)
    bandwidth, latency = rng.uniform(1e6, 1e8, 200), rng.uniform(0.001, 0.2, 200)
    measured = 0.93 * bandwidth * np.exp(rng.normal(0, 0.02, 200))
    terms, _ = fit_link(bandwidth, latency, measured)
    assert terms.link == pytest.approx(0.93, rel=0.02)
    assert np.allclose(terms.stream_bytes_per_s(bandwidth, latency), terms.link * bandwidth)  # no window binds


def test_a_step_overhead_adds_to_every_step_and_shows_in_the_cost():
    from hetpeer.coordinator.planner import PlannerConfig, Shape, make_model

    raw = synthetic.random_topology(4, 2, np.random.default_rng(0))
    problem = Problem.from_topology(Topology.from_wire(raw), Workload(preset("tiny"), batch=8))
    grid = np.array([[0, 1], [2, 3]])
    plain = make_model(problem, PlannerConfig(), Shape(2, 2)).report(grid)
    slowed = make_model(Efficiency(step_overhead_s=0.05).apply(problem), PlannerConfig(), Shape(2, 2)).report(grid)
    assert slowed.cost["total_s"] == pytest.approx(plain.cost["total_s"] + 0.05)
    # the objective is a time to loss: the overhead counts once a step, times what a step is worth
    assert slowed.sync == plain.sync and slowed.steps_factor == plain.steps_factor
    assert slowed.objective == pytest.approx(plain.objective + 0.05 * plain.steps_factor) and slowed.cost["overhead_s"] == 0.05
    assert "overhead_s" not in plain.cost
    assert Efficiency.parse("overhead_ms=45").step_overhead_s == pytest.approx(0.045)
    with pytest.raises(ValueError, match="step overhead"):
        Efficiency(step_overhead_s=-1.0)


def test_the_overhead_fit_is_what_the_other_terms_leave_of_measured_steps():
    found = fit_overhead(np.array([0.30, 0.80, 0.55]), np.array([0.25, 0.74, 0.51]))
    assert found.value == pytest.approx(0.05)
    assert found.residuals == pytest.approx([0.0, 0.8 / 0.79 - 1, 0.55 / 0.56 - 1])
    assert fit_overhead(np.array([1.0]), np.array([2.0])).value == 0.0  # never a negative overhead
    with pytest.raises(ValueError, match="nothing to fit"):
        fit_overhead(np.array([]), np.array([]))


@pytest.mark.parametrize("fit, arguments, words", [
    (fit_compute, ([100.0, 0.0], [80.0, 70.0]), "announced TFLOPS"),
    (fit_compute, ([100.0, 50.0], [80.0, float("nan")]), "achieved TFLOPS"),
    (fit_link, ([1e9, 0.0], [0.01, 0.02], [8e8, 5e8]), "link bandwidth"),
    (fit_link, ([1e9, 1e9], [0.01, -0.02], [8e8, 5e8]), "latencies"),
    (fit_link, ([1e9, 1e9], [0.01, 0.02], [8e8, 0.0]), "measured stream bandwidth"),
    (fit_overhead, ([0.3, 0.0], [0.25, 0.2]), "measured step time"),
    (fit_overhead, ([0.3, 0.2], [0.25, float("inf")]), "predicted step time"),
])
def test_fits_refuse_measurements_that_are_not_positive_and_finite(fit, arguments, words):
    with pytest.raises(ValueError, match=words):
        fit(*(np.array(a) for a in arguments))
