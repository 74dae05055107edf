"""Line charts as PNG bytes, with numpy and zlib only: the run report must not need a plotting stack.

`chart_pixels` draws into an (height, width, 3) uint8 array; `encode_png` turns any such array into an
8-bit RGB PNG; `line_chart` does both. Drawing is O(width * height) for the canvas plus O(points) for
the lines; text uses a built-in 5x7 bitmap font (letters print in capitals).
"""

from __future__ import annotations

import math
import struct
import zlib
from typing import Sequence

import numpy as np

Series = tuple[str, Sequence[float], Sequence[float]]  # (name, xs, ys)
Marker = tuple[float, str]  # (x, label): a vertical dashed line

WHITE, BLACK, GRID, MARKER = (255, 255, 255), (0, 0, 0), (225, 225, 225), (110, 110, 110)
PALETTE = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75))

# 5x7 glyphs: seven rows, each a byte whose low five bits are the pixels left to right.
_FONT_HEX = {
    "0": "0e11131519110e", "1": "040c040404040e", "2": "0e11010204081f", "3": "1f02040201110e",
    "4": "02060a121f0202", "5": "1f101e0101110e", "6": "0608101e11110e", "7": "1f010204080808",
    "8": "0e11110e11110e", "9": "0e11110f01020c", "A": "0e11111f111111", "B": "1e11111e11111e",
    "C": "0e11101010110e", "D": "1c12111111121c", "E": "1f10101e10101f", "F": "1f10101e101010",
    "G": "0e11101711110f", "H": "1111111f111111", "I": "0e04040404040e", "J": "0702020202120c",
    "K": "11121418141211", "L": "1010101010101f", "M": "111b1515111111", "N": "11111915131111",
    "O": "0e11111111110e", "P": "1e11111e101010", "Q": "0e11111115120d", "R": "1e11111e141211",
    "S": "0f10100e01011e", "T": "1f040404040404", "U": "1111111111110e", "V": "11111111110a04",
    "W": "1111111515150a", "X": "11110a040a1111", "Y": "1111110a040404", "Z": "1f01020408101f",
    ".": "000000000c0c00", "-": "0000001f000000", "+": "0004041f040400", ":": "000c0c000c0c00",
    " ": "00000000000000", "/": "00010204081000", "(": "02040808080402", ")": "08040202020408",
    "_": "0000000000001f", "%": "18190204081303", "=": "00001f001f0000", ",": "000000000c0408",
    "?": "0e110102040004", "#": "0a0a1f0a1f0a0a", "<": "02040810080402", ">": "08040201020408",
}
FONT = {ch: bytes.fromhex(code) for ch, code in _FONT_HEX.items()}


def encode_png(pixels: np.ndarray) -> bytes:
    """An 8-bit RGB PNG of an (height, width, 3) uint8 array, every row with filter type 0."""
    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype != np.uint8:
        raise ValueError(f"encode_png needs an (h, w, 3) uint8 array, got {pixels.shape} {pixels.dtype}")
    height, width = pixels.shape[:2]
    rows = np.concatenate([np.zeros((height, 1), np.uint8), pixels.reshape(height, width * 3)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(rows.tobytes(), 9)) + chunk(b"IEND", b""))  # fmt: skip


def text_mask(text: str, scale: int = 1) -> np.ndarray:
    """The pixels of `text` as a boolean (7 * scale, 6 * scale * len - scale) array; '?' for unknown glyphs."""
    glyphs = [FONT.get(ch.upper(), FONT["?"]) for ch in text]
    mask = np.zeros((7, max(6 * len(glyphs) - 1, 0)), bool)
    for i, rows in enumerate(glyphs):
        for r, bits in enumerate(rows):
            mask[r, 6 * i : 6 * i + 5] = [(bits >> (4 - c)) & 1 for c in range(5)]
    return mask.repeat(scale, 0).repeat(scale, 1)


def draw_text(img: np.ndarray, x: int, y: int, text: str, color=BLACK, scale: int = 1, anchor: str = "lt",
              vertical: bool = False, background=None) -> None:
    """Text with its anchor ('l'/'c'/'r' then 't'/'m'/'b') at (x, y); vertical reads bottom to top;
    a background colour fills the text's box (and a pixel around it) first."""
    mask = text_mask(text, scale)
    if vertical:
        mask = np.rot90(mask)
    h, w = mask.shape
    x -= {"l": 0, "c": w // 2, "r": w}[anchor[0]]
    y -= {"t": 0, "m": h // 2, "b": h}[anchor[1]]
    if background is not None:
        img[max(y - 1, 0) : max(y + h + 1, 0), max(x - 1, 0) : max(x + w + 1, 0)] = background
    _paint(img, *np.nonzero(mask), color, dy=y, dx=x)


def _paint(img: np.ndarray, ys: np.ndarray, xs: np.ndarray, color, dy: int = 0, dx: int = 0) -> None:
    ys, xs = np.asarray(ys) + dy, np.asarray(xs) + dx
    inside = (ys >= 0) & (ys < img.shape[0]) & (xs >= 0) & (xs < img.shape[1])
    img[ys[inside], xs[inside]] = color


def draw_line(img: np.ndarray, x0: float, y0: float, x1: float, y1: float, color, width: int = 1,
              dash: int = 0) -> None:
    """A straight line through every pixel a Bresenham walk visits; dashes of `dash` pixels on and off."""
    n = int(max(abs(round(x1) - round(x0)), abs(round(y1) - round(y0)))) + 1
    xs = np.rint(np.linspace(x0, x1, n)).astype(int)
    ys = np.rint(np.linspace(y0, y1, n)).astype(int)
    if dash:
        keep = (np.arange(n) // dash) % 2 == 0
        xs, ys = xs[keep], ys[keep]
    for offset in range(width):  # thicken across the line's minor axis
        if abs(x1 - x0) >= abs(y1 - y0):
            _paint(img, ys + offset, xs, color)
        else:
            _paint(img, ys, xs + offset, color)


def nice_ticks(lo: float, hi: float) -> list[float]:
    """4 to 6 round values (1, 2, 2.5 or 5 times a power of ten apart) inside [lo, hi], or where no
    spacing allows that, reaching one spacing past either end (the axis then grows to the outer ticks)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        raise ValueError(f"nice_ticks needs finite lo < hi, got {lo}, {hi}")
    best: tuple[float, list[float]] = (math.inf, [lo, hi])
    power = math.floor(math.log10(hi - lo)) - 1
    for step in (m * 10.0**p for p in (power, power + 1) for m in (1, 2, 2.5, 5)):
        for outer in (False, True):
            first = math.floor(lo / step + 1e-9) if outer else math.ceil(lo / step - 1e-9)
            last = math.ceil(hi / step - 1e-9) if outer else math.floor(hi / step + 1e-9)
            ticks = [k * step for k in range(first, last + 1)]
            score = abs(len(ticks) - 5) + (0 if 4 <= len(ticks) <= 6 else 10) + 1.5 * outer
            if score < best[0]:
                best = (score, ticks)
    return best[1]


def format_tick(value: float, step: float) -> str:
    """`value` with as many decimals as the tick spacing `step` needs; scientific when very large or small."""
    if value == 0:
        return "0"
    if abs(value) >= 1e6 or step < 1e-4:
        return f"{value:.3g}".replace("e+0", "e").replace("e-0", "e-")
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    if abs(step * 10**decimals - round(step * 10**decimals)) > 1e-6:  # 0.25, 2.5: one digit more
        decimals += 1
    return f"{value:.{decimals}f}"


def _range(values: np.ndarray) -> tuple[float, float]:
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return 0.0, 1.0
    lo, hi = float(finite.min()), float(finite.max())
    if hi - lo <= 1e-12 * max(abs(lo), abs(hi), 1.0):  # constant: centre it with a band of +-10%
        pad = abs(lo) * 0.1 or 1.0
        return lo - pad, hi + pad
    return lo, hi


def chart_pixels(series: Sequence[Series], width: int = 800, height: int = 400, title: str = "",
                 x_label: str = "", y_label: str = "", markers: Sequence[Marker] = ()) -> np.ndarray:
    """A line chart as an (height, width, 3) uint8 array: axes, ticks, one polyline per series, legend,
    and a dashed vertical line per marker. NaN points break a line; a lone point is drawn as a dot."""
    if width < 120 or height < 80:
        raise ValueError(f"chart of {width}x{height} px is too small to draw, need at least 120x80")
    img = np.full((height, width, 3), WHITE, np.uint8)
    data = [(name, np.asarray(xs, float), np.asarray(ys, float)) for name, xs, ys in series]
    all_x = np.concatenate([xs for _, xs, _ in data] + [np.array([x for x, _ in markers], float)])
    all_y = np.concatenate([ys for _, _, ys in data] + [np.empty(0)])
    x_lo, x_hi = _range(all_x)
    y_lo, y_hi = _range(all_y)
    y_pad = (y_hi - y_lo) * 0.05
    y_lo, y_hi = y_lo - y_pad, y_hi + y_pad
    x_ticks, y_ticks = nice_ticks(x_lo, x_hi), nice_ticks(y_lo, y_hi)
    x_lo, x_hi = min(x_lo, x_ticks[0]), max(x_hi, x_ticks[-1])
    y_lo, y_hi = min(y_lo, y_ticks[0]), max(y_hi, y_ticks[-1])
    left, right, top, bottom = 70, width - 20, 34 if title else 14, height - (40 if x_label else 26)

    def px(x):
        return left + (np.asarray(x, float) - x_lo) / (x_hi - x_lo) * (right - left)

    def py(y):
        return bottom - (np.asarray(y, float) - y_lo) / (y_hi - y_lo) * (bottom - top)

    for ticks, along_x in ((x_ticks, True), (y_ticks, False)):
        step = ticks[1] - ticks[0] if len(ticks) > 1 else abs(ticks[0]) or 1.0
        for t in ticks:
            label = format_tick(t, step)
            if along_x:
                x = int(round(float(px(t))))
                draw_line(img, x, top, x, bottom - 1, GRID)
                draw_line(img, x, bottom, x, bottom + 4, BLACK)
                draw_text(img, x, bottom + 7, label, anchor="ct")
            else:
                y = int(round(float(py(t))))
                draw_line(img, left + 1, y, right, y, GRID)
                draw_line(img, left - 4, y, left, y, BLACK)
                draw_text(img, left - 7, y, label, anchor="rm")
    draw_line(img, left, top, left, bottom, BLACK)
    draw_line(img, left, bottom, right, bottom, BLACK)
    if title:
        draw_text(img, (left + right) // 2, 8, title, scale=2, anchor="ct")
    if x_label:
        draw_text(img, (left + right) // 2, height - 4, x_label, anchor="cb")
    if y_label:
        draw_text(img, 4, (top + bottom) // 2, y_label, anchor="lm", vertical=True)

    shown = [(int(round(float(px(x)))), label) for x, label in markers if math.isfinite(x) and x_lo <= x <= x_hi]
    for xp, _ in shown:
        draw_line(img, xp, top, xp, bottom - 1, MARKER, dash=4)

    for i, (name, xs, ys) in enumerate(data):
        color = PALETTE[i % len(PALETTE)]
        if xs.shape != ys.shape:
            raise ValueError(f"series {name!r}: {xs.size} xs but {ys.size} ys")
        ok = np.isfinite(xs) & np.isfinite(ys)
        cx, cy = px(np.where(ok, xs, x_lo)), py(np.where(ok, ys, y_lo))
        for j in range(len(xs) - 1):
            if ok[j] and ok[j + 1]:
                draw_line(img, cx[j], cy[j], cx[j + 1], cy[j + 1], color, width=2)
        alone = ok & ~np.r_[False, ok[:-1]] & ~np.r_[ok[1:], False]
        for x, y in zip(np.rint(cx[alone]).astype(int), np.rint(cy[alone]).astype(int)):
            _paint(img, *np.mgrid[y - 2 : y + 3, x - 2 : x + 3].reshape(2, -1), color)

    for i, (xp, label) in enumerate(shown):  # labels over the lines, so that they stay legible
        draw_text(img, xp + 3, top + 2 + 10 * (i % 3), label, MARKER, background=WHITE)
    if not any(np.isfinite(xs).any() and np.isfinite(ys).any() for _, xs, ys in data):
        draw_text(img, (left + right) // 2, (top + bottom) // 2, "no data", MARKER, scale=2, anchor="cm")
    names = [name for name, _, _ in data if name]
    if names:
        box_w = 6 * max(map(len, names)) + 34
        x0, y0 = right - box_w - 6, top + 6
        img[y0 : y0 + 12 * len(names) + 6, x0 : x0 + box_w] = WHITE
        for i, (name, _, _) in enumerate(data):
            y = y0 + 9 + 12 * i
            draw_line(img, x0 + 5, y, x0 + 23, y, PALETTE[i % len(PALETTE)], width=2)
            draw_text(img, x0 + 29, y, name, anchor="lm")
    return img


def line_chart(series: Sequence[Series], width: int = 800, height: int = 400, title: str = "",
               x_label: str = "", y_label: str = "", markers: Sequence[Marker] = ()) -> bytes:
    """`chart_pixels` encoded as PNG bytes."""
    return encode_png(chart_pixels(series, width, height, title, x_label, y_label, markers))
