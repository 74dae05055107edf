"""The run report of `hetpeer swarm`: the summary figures, and the files (markdown, JSON, the self-contained
HTML page, matplotlib's PNG)."""

from __future__ import annotations

import io
import json
import math
import re

import pytest

from hetpeer.swarm import plots
from hetpeer.swarm.report import (
    Event, LaneStep, PeerInfo, PlanUse, RunReport, Sample, lane_step, samples_from_lanes, summarize, write_report,
)


def plans() -> list[PlanUse]:
    return [
        PlanUse(1, 0, 0.5, [(0, 2, ["p0", "p1"]), (2, 4, ["p2", "p3"])], [], predicted_step_s=0.5),
        PlanUse(2, 4, 3.0, [(0, 4, ["p0"])], ["p1"], predicted_step_s=0.8),
    ]


def samples() -> list[Sample]:
    # epoch 1: steps 0-3 at 1 s, 0.5 s, 0.5 s apart (first step slow); epoch 2: steps 4-7 every 2 s
    return [
        Sample(1.0, 0, 10.0, 100.0, 1), Sample(2.0, 1, 9.0, 200.0, 1), Sample(2.5, 2, 8.5, 400.0, 1),
        Sample(3.0, 3, math.nan, 400.0, 1), Sample(5.0, 4, 7.0, None, 2), Sample(7.0, 5, 6.5, 50.0, 2),
        Sample(11.0, 7, 6.0, 60.0, 2),
    ]  # fmt: skip


def test_summarize_measures_each_epoch_as_the_dashboard_does():
    first, second = summarize(samples(), plans())
    assert first.measured_step_s == pytest.approx(2 / 3)  # under a window of ten steps: the mean of the steps run
    assert first.tokens_per_s == pytest.approx(300.0)
    assert first.steps == 4 and first.ratio == pytest.approx(4 / 3)
    assert second.measured_step_s == pytest.approx(2.0)  # 2 s, then 4 s over two steps
    assert second.tokens_per_s == pytest.approx(55.0)  # the sample without a rate is left out
    assert second.steps == 4 and second.ratio == pytest.approx(2.5)


def test_summarize_keeps_a_plan_without_samples_and_does_not_change_its_input():
    given = plans()
    out = summarize([s for s in samples() if s.epoch == 1], given)
    assert out[1] == given[1] and given[0].measured_step_s is None


def report() -> RunReport:
    return RunReport(
        swarm="4 peers on one host", model="tiny", steps=8, wall_s=11.5,
        peers=[PeerInfo("p0", 1.0, None, 19.5, "cpu"), PeerInfo("p1", 3.0, 100.0, None, "cpu", latency_ms=5.0)],
        plans=summarize(samples(), plans()), samples=samples(),
        events=[Event(3.0, "plan epoch 2 published"), Event(6.0, "peer p3 killed")],
    )  # fmt: skip


def test_json_round_trip_keeps_everything():
    original = report()
    back = RunReport.from_json(original.to_json())
    assert math.isnan(back.samples[3].loss)
    nan_free = [s for i, s in enumerate(original.samples) if i != 3]
    assert [s for i, s in enumerate(back.samples) if i != 3] == nan_free
    assert (back.peers, back.plans, back.events) == (original.peers, original.plans, original.events)
    assert back.plans[0].stages[1].devices == ("p2", "p3")
    assert (back.swarm, back.model, back.steps, back.wall_s) == (original.swarm, original.model, original.steps, original.wall_s)
    with pytest.raises(ValueError, match="version"):
        RunReport.from_json('{"version": 99}')


def test_write_report_gives_four_files_with_the_figures(tmp_path):
    paths = write_report(report(), tmp_path / "run")
    assert {p.name for p in paths.values()} == {"report.md", "report.json", "report.html", "loss.png"}
    assert all(p.exists() for p in paths.values())
    md = paths["md"].read_text()
    assert "| p0 | cpu | 1x | none | 0 | 19.5 |" in md and "| p1 | cpu | 3x | 100 | 5 | - |" in md
    assert "| 1 | 0 | 0.5 | 4 | L0-2: p0 p1; L2-4: p2 p3 | - | 0.500 | 0.667 | 1.33 | 300 |" in md
    assert "| 2 | 4 | 3.0 | 4 | L0-4: p0 | p1 | 0.800 | 2.000 | 2.50 | 55 |" in md
    assert "first 10.0000, last 6.0000" in md
    assert "- 6.0 s: peer p3 killed" in md and "(loss.png)" in md and "report.html" in md
    assert "throughput: 150 tokens/s" in md  # median of the rates
    assert RunReport.from_json(paths["json"].read_text()).plans == report().plans
    import matplotlib.image

    img = matplotlib.image.imread(io.BytesIO(paths["png"].read_bytes()), format="png")
    assert img.shape[:2] == (720, 1000) and (img[..., :3] < 0.9).any(axis=-1).sum() > 1000  # lines drawn, not blank


def inline_state(html: str) -> dict:
    found = re.search(r'<script type="application/json" id="state">(.*?)</script>', html, re.S)
    assert found is not None
    return json.loads(found.group(1))


def test_report_html_is_one_self_contained_page_with_the_run(tmp_path):
    html = write_report(report(), tmp_path)["html"].read_text()
    markup = re.sub(r"<(script|style)\b[^>]*>.*?</\1>", "", html, flags=re.S)  # what is left: the page's own tags
    assert "<script" not in markup and " src=" not in markup  # nothing loaded from elsewhere
    assert re.findall(r'<link [^>]*href="([^"]*)"', markup) == ["data:,"]  # not even an icon
    assert "Plotly" in html and "hetpeerCharts" in html  # plotly.js and the page's charts, inlined
    state = inline_state(html)
    assert state["clock"] == "run" and state["progress"]["step"] == 8
    fields = state["history"]["sample_fields"]
    rows = [dict(zip(fields, row)) for row in state["history"]["samples"]]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 7] and rows[3]["loss"] is None  # NaN: a gap
    assert [(p["epoch"], p["measured_step_s"]) for p in state["history"]["plans"]] == [(1, pytest.approx(2 / 3)), (2, 2.0)]
    assert state["plan"]["epoch"] == 2 and state["plan"]["standby"] == ["p1"]
    peers = {p["device_id"]: p for p in state["peers"]}
    assert peers["p0"]["stage"] == 0 and peers["p1"]["standby"] and "3x slower" in peers["p1"]["device_name"]
    assert "frames 5 ms on the way" in peers["p1"]["device_name"] and "ms" not in peers["p0"]["device_name"]


def test_report_html_keeps_text_that_looks_like_markup_as_data(tmp_path):
    run = report()
    hostile = "</script><script>alert(1)</script>"
    run = RunReport(run.swarm, run.model, run.steps, run.wall_s, run.peers, run.plans, run.samples, [Event(1.0, hostile)])
    html = write_report(run, tmp_path)["html"].read_text()
    assert hostile not in html  # it cannot close the data's script element
    assert inline_state(html)["history"]["events"][0]["text"] == hostile


def test_write_report_without_matplotlib_leaves_out_the_png(tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "available", lambda: False)
    paths = write_report(report(), tmp_path)
    assert "png" not in paths and not (tmp_path / "loss.png").exists()
    assert "loss.png" not in paths["md"].read_text() and paths["html"].exists()
    (tmp_path / "dashboard.png").write_bytes(b"\x89PNG")  # a screenshot taken before: linked
    assert "(dashboard.png)" in write_report(report(), tmp_path)["md"].read_text()


def test_charts_png_says_how_to_get_matplotlib(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(plots.PlotsMissing, match=r"pip install -e '\.\[plots\]'"):
        plots.charts_png([{"series": [("a", [0, 1], [0, 1])]}])


def test_write_report_of_a_run_without_samples(tmp_path):
    empty = RunReport("none", "tiny", 0, 0.0, [], [], [])
    md = write_report(empty, tmp_path)["md"].read_text()
    assert "first -, last -" in md and "- none" in md


def test_samples_from_lanes_average_the_lanes_of_each_step():
    points = [
        LaneStep(1.0, 1, 0, 0, 5.0, 100.0), LaneStep(1.2, 1, 1, 0, 4.0, 300.0),
        LaneStep(2.0, 1, 0, 1, 3.0, 200.0),  # lane 1 has not printed step 1 yet
        LaneStep(9.0, 2, 0, 7, 2.0, 500.0),  # a plan of one lane, from step 7
    ]  # fmt: skip
    samples = samples_from_lanes(points)
    assert [(s.step, s.time_s, s.loss, s.tokens_per_s, s.epoch) for s in samples] == [
        (0, 1.0, 4.5, 400.0, 1),  # mean loss; mean rate times the two lanes of the plan
        (1, 2.0, 3.0, 400.0, 1),
        (7, 9.0, 2.0, 500.0, 2),
    ]
    assert samples_from_lanes([]) == []


def test_validation_losses_are_read_from_step_lines_and_averaged():
    line = "e2 stage 2 lane 1  step 25/200  loss 2.9875  4,551 tok/s  0.11 s (compute 0.05, wait 0.06, sync 0.01)  val 3.1250"
    point = lane_step(line, 4.0)
    assert (point.step, point.loss, point.val_loss) == (24, 2.9875, 3.125)
    assert lane_step(line.rsplit("  val", 1)[0], 4.0).val_loss is None
    other = LaneStep(4.1, 2, 1, 24, 3.0, 4000.0, 3.25)
    sample = samples_from_lanes([point, other])[0]
    assert sample.val_loss == pytest.approx(3.1875) and sample.loss == pytest.approx(2.99375)
