"""Line charts as PNG files with matplotlib, an optional extra (`pip install -e '.[plots]'`): the run
report's loss.png and the benchmarks' pictures. Nothing else in hetpeer needs it: the report's HTML
draws the same charts in the browser.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot, no display, safe off the main thread).
"""

from __future__ import annotations

import importlib.util
import io
import math
from typing import Sequence

Series = tuple[str, Sequence[float], Sequence[float]]  # (name, xs, ys)
Marker = tuple[float, str]  # (x, label): a vertical dashed line


class PlotsMissing(RuntimeError):
    """matplotlib is not installed."""


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def charts_png(panels: Sequence[dict], width_in: float = 10.0, panel_height_in: float = 3.6) -> bytes:
    """PNG bytes of panels stacked top to bottom; each panel: {"series": [Series], "title", "x_label",
    "y_label", "markers": [Marker]}. NaN and None values leave gaps."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotsMissing("matplotlib is not installed: pip install -e '.[plots]'") from None
    figure = Figure(figsize=(width_in, panel_height_in * len(panels)), layout="constrained")
    FigureCanvasAgg(figure)
    for axes, panel in zip(figure.subplots(len(panels), 1, squeeze=False)[:, 0], panels):
        for name, xs, ys in panel["series"]:
            ys = [math.nan if y is None else y for y in ys]
            axes.plot(xs, ys, label=name, linewidth=1.6, marker="o" if len(xs) < 30 else None, markersize=3)
        for x, label in panel.get("markers", ()):
            axes.axvline(x, color="0.55", linestyle="--", linewidth=0.9)
            axes.annotate(label, (x, 1), xycoords=("data", "axes fraction"), xytext=(3, -3), textcoords="offset points",
                          rotation=90, va="top", fontsize=7, color="0.35")
        axes.set_title(panel.get("title", ""), fontsize=11)
        axes.set_xlabel(panel.get("x_label", ""))
        axes.set_ylabel(panel.get("y_label", ""))
        axes.grid(True, color="0.9")
        if len(panel["series"]) > 1:
            axes.legend(fontsize=8)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()
