"""The run report of `hetpeer swarm`: the PNG encoder and chart, the summary figures, and the files."""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np
import pytest

from hetpeer.swarm.png import chart_pixels, encode_png, format_tick, line_chart, nice_ticks
from hetpeer.swarm.report import (
    Event, LaneStep, PeerInfo, PlanUse, RunReport, Sample, lane_step, samples_from_lanes, summarize, write_report,
)


def decode_png(data: bytes) -> np.ndarray:
    """The (h, w, 3) pixels of an 8-bit RGB PNG with filter 0 rows, checking every chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, at = [], 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length : at + 12 + length])
        assert crc == zlib.crc32(kind + body), f"bad CRC in {kind!r}"
        chunks.append((kind, body))
        at += 12 + length
    assert [k for k, _ in chunks][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color, interlace) == (8, 2, 0)
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    rows = np.frombuffer(raw, np.uint8).reshape(height, 1 + 3 * width)
    assert (rows[:, 0] == 0).all()
    return rows[:, 1:].reshape(height, width, 3)


def test_encode_png_round_trips_pixels():
    pixels = np.random.default_rng(0).integers(0, 256, (7, 11, 3), dtype=np.uint8)
    assert (decode_png(encode_png(pixels)) == pixels).all()
    with pytest.raises(ValueError, match="uint8"):
        encode_png(pixels.astype(np.float32))


def test_line_chart_has_the_size_asked_and_draws_the_line():
    img = decode_png(line_chart([("loss", [0, 10], [0.0, 1.0])], width=300, height=200, title="t"))
    assert img.shape == (200, 300, 3)
    blue = (img == (31, 119, 180)).all(axis=2)
    ys, xs = np.nonzero(blue)
    assert len(xs) > 100  # a diagonal across the plot, two pixels wide
    # it rises left to right: the leftmost line pixels sit lower on the image than the rightmost
    assert ys[xs == xs.min()].mean() > ys[xs == xs.max()].mean()
    assert (img[0, :] == 255).all()  # the background is white


def non_white(img: np.ndarray) -> int:
    return int((img != 255).any(axis=2).sum())


@pytest.mark.parametrize(
    "series",
    [[], [("one", [3], [2.0])], [("flat", [0, 1, 2], [4.0, 4.0, 4.0])], [("nan", [0, 1, 2], [math.nan] * 3)],
     [("zero", [0, 0], [0.0, 0.0])]],
    ids=["empty", "single", "constant", "all-nan", "zero"],
)  # fmt: skip
def test_degenerate_series_still_give_a_chart(series):
    img = decode_png(line_chart(series, width=200, height=120))
    assert img.shape == (120, 200, 3) and non_white(img) > 0


def test_single_point_is_a_visible_dot():
    img = chart_pixels([("one", [3], [2.0])], width=200, height=120)
    assert (img == (31, 119, 180)).all(axis=2).sum() >= 9


def test_nan_breaks_the_line():
    xs = np.arange(11.0)
    whole = chart_pixels([("a", xs, xs)], 300, 200)
    ys = xs.copy()
    ys[5] = math.nan
    broken = chart_pixels([("a", xs, ys)], 300, 200)
    blue = (31, 119, 180)
    assert (broken == blue).all(axis=2).sum() < (whole == blue).all(axis=2).sum()


def test_markers_are_drawn_as_dashed_vertical_lines():
    plain = chart_pixels([("a", [0, 10], [0, 1])], 300, 200)
    marked = chart_pixels([("a", [0, 10], [0, 1])], 300, 200, markers=[(5.0, "plan 2")])
    grey = (marked == (110, 110, 110)).all(axis=2)
    assert grey.sum() > 0 and (plain == (110, 110, 110)).all(axis=2).sum() == 0
    column = np.bincount(np.nonzero(grey)[1]).argmax()
    assert 0 < grey[:, column].sum() < 200 / 2 + 20  # dashed: about half the plot's height


@pytest.mark.parametrize("lo,hi", [(0, 1), (813.7, 847.9), (-3e-6, 2e-6), (0, 199), (2.95, 3.05), (1e5, 9e6)])
def test_nice_ticks_give_four_to_six_round_values(lo, hi):
    ticks = nice_ticks(lo, hi)
    assert 4 <= len(ticks) <= 6
    step = ticks[1] - ticks[0]
    assert np.allclose(np.diff(ticks), step)
    assert ticks[0] <= lo + step and ticks[-1] >= hi - step


def test_tick_labels():
    assert [format_tick(v, 0.25) for v in (0, 0.25, 1.5)] == ["0", "0.25", "1.50"]
    assert format_tick(250000, 250000) == "250000" and format_tick(2e6, 1e6) == "2e6"


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


def test_summarize_takes_medians_within_each_epoch():
    first, second = summarize(samples(), plans())
    assert first.measured_step_s == pytest.approx(0.5)  # median of 1, 0.5, 0.5
    assert first.tokens_per_s == pytest.approx(300.0)
    assert first.steps == 4 and first.ratio == pytest.approx(1.0)
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
        peers=[PeerInfo("p0", 1.0, None, 19.5, "cpu"), PeerInfo("p1", 3.0, 100.0, None, "cpu")],
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


def test_write_report_gives_three_files_with_the_figures(tmp_path):
    paths = write_report(report(), tmp_path / "run")
    assert {p.name for p in paths.values()} == {"report.md", "report.json", "loss.png"}
    assert all(p.exists() for p in paths.values())
    md = paths["md"].read_text()
    assert "| p0 | cpu | 1x | none | 19.5 |" in md and "| p1 | cpu | 3x | 100 | - |" in md
    assert "| 1 | 0 | 0.5 | 4 | L0-2: p0 p1; L2-4: p2 p3 | - | 0.500 | 0.500 | 1.00 | 300 |" in md
    assert "| 2 | 4 | 3.0 | 4 | L0-4: p0 | p1 | 0.800 | 2.000 | 2.50 | 55 |" in md
    assert "first 10.0000, last 6.0000" in md
    assert "- 6.0 s: peer p3 killed" in md and "(loss.png)" in md
    assert "throughput: 150 tokens/s" in md  # median of the rates
    assert RunReport.from_json(paths["json"].read_text()).plans == report().plans
    img = decode_png(paths["png"].read_bytes())
    assert img.shape[1] == 800 and non_white(img) > 1000


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
