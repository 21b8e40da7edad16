"""Static HTML evaluation pages with plots drawn as inline SVG.

A report must open on an air-gapped cluster node years later, so the page carries no script,
no stylesheet link and no CDN: every plot is a handful of SVG elements computed here. The
functions are pure (numbers in, markup out) so their output can be tested without a browser.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

WIDTH = 480
HEIGHT = 270
_MARGIN_LEFT = 72
_MARGIN_RIGHT = 28
_MARGIN_TOP = 28
_MARGIN_BOTTOM = 42
_CHAR_PX = 6.2
"""The width of one character of the 10 px tick font, roughly: enough to keep a label inside."""
_MAX_TICKS = 6


@dataclass(frozen=True)
class Point:
    """One plotted value with its spread (drawn as an error bar)."""

    x: float
    y: float
    spread: float = 0.0


_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff\ufffe\uffff]")


def _esc(text: str) -> str:
    """Escape for HTML and drop characters XML forbids, so an odd env id can't break the SVG."""
    return html.escape(_CONTROL.sub("", text))


# Beyond this magnitude the axis arithmetic (differences, padding) would overflow to inf; such
# values stay in the JSON report but are left out of the plots.
_PLOTTABLE = 1e300


def _plottable(value: float) -> bool:
    return math.isfinite(value) and abs(value) <= _PLOTTABLE


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if _plottable(v)]


def _span(lo: float, hi: float) -> tuple[float, float]:
    """A non-empty axis range, so a constant series still gets a readable axis (and one too
    narrow for its magnitude to split into distinct ticks counts as constant)."""
    if hi - lo < 1e-12 or hi - lo <= max(abs(lo), abs(hi)) * 1e-9:
        pad = max(abs(lo) * 0.1, 1.0)
        return lo - pad, hi + pad
    return lo, hi


def nice_ticks(lo: float, hi: float, count: int = 5, whole: bool = False) -> list[float]:
    """Round tick values (1, 2, 2.5 or 5 times a power of ten apart) from at or below `lo` to
    at or above `hi`, about `count` of them: the axis spans exactly the ticks, so every
    gridline is a number a reader can say. `whole`: counts, so no step below 1."""
    lo, hi = _span(lo, hi)
    raw = (hi - lo) / max(count - 1, 1)
    magnitude = 10.0 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw * (1 - 1e-9))
    step = max(step, 1.0) if whole else step
    start = math.floor(lo / step) * step
    ticks = [float(f"{start + i * step:.12g}") for i in range(_MAX_TICKS + 2)]
    last = next((i for i, t in enumerate(ticks) if t >= hi - step * 1e-9), len(ticks) - 1)
    return ticks[: last + 1]


def plain(value: float, digits: int = 4) -> str:
    """A number as people write it: `86,370`, `0.0312`, `1.5M` (never `8.637e+04`); only
    the very large or very small fall back to an exponent."""
    if not math.isfinite(value):
        return str(value)
    size = abs(value)
    if size >= 1e6 and size < 1e15:
        for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
            if size >= scale:
                return f"{value / scale:.{digits}g}{unit}"
    if value == round(value) and size < 1e6:
        return f"{int(value):,}"
    if 1e-4 <= size < 1e6:
        decimals = max(0, digits - 1 - math.floor(math.log10(size)))
        return f"{value:,.{decimals}f}".rstrip("0").rstrip(".")
    return f"{value:.{digits}g}"


class _Axes:
    """Maps data coordinates onto the plot area of one SVG; both axes span round ticks."""

    def __init__(
        self, x_range: tuple[float, float], y_range: tuple[float, float], counts: bool = False
    ) -> None:
        self.xticks = nice_ticks(*x_range)
        self.yticks = nice_ticks(*y_range, whole=counts)
        self.x0, self.x1 = self.xticks[0], self.xticks[-1]
        self.y0, self.y1 = self.yticks[0], self.yticks[-1]
        self.left = _MARGIN_LEFT
        self.right = WIDTH - _MARGIN_RIGHT
        self.top = _MARGIN_TOP
        self.bottom = HEIGHT - _MARGIN_BOTTOM

    def px(self, x: float) -> float:
        return self.left + (x - self.x0) / (self.x1 - self.x0) * (self.right - self.left)

    def py(self, y: float) -> float:
        return self.bottom - (y - self.y0) / (self.y1 - self.y0) * (self.bottom - self.top)

    def frame(self, title: str, x_label: str, y_label: str) -> list[str]:
        """Title, axes, axis labels and the y ticks with light gridlines."""
        middle = (self.top + self.bottom) / 2
        parts = [
            f'<text x="{WIDTH / 2:.1f}" y="18" text-anchor="middle" font-size="13">'
            f"{_esc(title)}</text>",
        ]
        for value in self.yticks:
            y = self.py(value)
            parts.append(
                f'<line x1="{self.left}" y1="{y:.1f}" x2="{self.right}" y2="{y:.1f}" '
                'stroke="#e4e4e4"/>'
                f'<text x="{self.left - 4}" y="{y + 3.5:.1f}" text-anchor="end" '
                f'font-size="10">{_fit(plain(value), self.left - 22)}</text>'
            )
        parts += [
            f'<line x1="{self.left}" y1="{self.bottom}" x2="{self.right}" y2="{self.bottom}" '
            'stroke="#333"/>',
            f'<line x1="{self.left}" y1="{self.top}" x2="{self.left}" y2="{self.bottom}" '
            'stroke="#333"/>',
            f'<text x="{(self.left + self.right) / 2:.1f}" y="{HEIGHT - 6}" '
            f'text-anchor="middle" font-size="11">{_esc(x_label)}</text>',
            f'<text x="12" y="{middle:.1f}" font-size="11" text-anchor="middle" '
            f'transform="rotate(-90 12 {middle:.1f})">{_esc(y_label)}</text>',
        ]
        return parts

    def x_ticks(self, values: Sequence[float] | None = None) -> list[str]:
        """Labels under the x axis (the round ticks unless `values` are given), each kept
        inside the canvas: one that would cross an edge is anchored at it instead."""
        parts = []
        for v in self.xticks if values is None else values:
            x, text = self.px(v), plain(v)
            half = len(text) * _CHAR_PX / 2
            anchor, at = "middle", x
            if x + half > WIDTH - 2:
                anchor, at = "end", WIDTH - 2
            elif x - half < 2:
                anchor, at = "start", 2
            parts.append(
                f'<line x1="{x:.1f}" y1="{self.bottom}" x2="{x:.1f}" y2="{self.bottom + 3}" '
                f'stroke="#333"/><text x="{at:.1f}" y="{self.bottom + 14}" '
                f'text-anchor="{anchor}" font-size="10">{_esc(text)}</text>'
            )
        return parts


def _fit(text: str, width_px: float) -> str:
    """`text` escaped, cut (with an ellipsis) to what fits in `width_px` of tick font."""
    most = max(1, int(width_px / _CHAR_PX))
    return _esc(text if len(text) <= most else text[: most - 1] + "…")


def _svg(parts: list[str], label: str) -> str:
    body = "".join(parts)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{_esc(label)}">'
        f"{body}</svg>"
    )


def histogram_svg(values: Sequence[float], title: str, x_label: str, bins: int = 12) -> str:
    """Bars counting how many values fall in each of `bins` equal-width bins."""
    data = _finite(values)
    if not data:
        return _empty_svg(title)
    lo, hi = _span(min(data), max(data))
    counts = [0] * bins
    for v in data:
        index = min(int((v - lo) / (hi - lo) * bins), bins - 1)
        counts[index] += 1
    axes = _Axes((lo, hi), (0.0, float(max(counts))), counts=True)
    parts = axes.frame(title, x_label, "episodes")
    edges = [axes.px(lo + (hi - lo) * i / bins) for i in range(bins + 1)]
    for i, count in enumerate(counts):
        top = axes.py(count)
        parts.append(
            f'<rect x="{edges[i]:.1f}" y="{top:.1f}" '
            f'width="{max(edges[i + 1] - edges[i] - 1, 0.5):.1f}" height="{axes.bottom - top:.1f}" '
            f'fill="#4a7ab5"><title>{count}</title></rect>'
        )
    parts.extend(axes.x_ticks())
    return _svg(parts, title)


def line_svg(points: Sequence[Point], title: str, x_label: str, y_label: str) -> str:
    """A polyline through the points' means with a vertical bar of ±spread at each."""
    pts = [p for p in points if _plottable(p.x) and _plottable(p.y)]
    if not pts:
        return _empty_svg(title)
    ys = [p.y - p.spread for p in pts] + [p.y + p.spread for p in pts]
    axes = _Axes((min(p.x for p in pts), max(p.x for p in pts)), (min(ys), max(ys)))
    parts = axes.frame(title, x_label, y_label)
    coords = " ".join(f"{axes.px(p.x):.1f},{axes.py(p.y):.1f}" for p in pts)
    parts.append(f'<polyline points="{coords}" fill="none" stroke="#c0392b" stroke-width="2"/>')
    for p in pts:
        x = axes.px(p.x)
        parts.append(
            f'<line x1="{x:.1f}" y1="{axes.py(p.y - p.spread):.1f}" x2="{x:.1f}" '
            f'y2="{axes.py(p.y + p.spread):.1f}" stroke="#c0392b" stroke-opacity="0.5"/>'
            f'<circle cx="{x:.1f}" cy="{axes.py(p.y):.1f}" r="3" fill="#c0392b">'
            f"<title>{plain(p.x)}: {plain(p.y)} ± {plain(p.spread)}</title></circle>"
        )
    parts.extend(axes.x_ticks(sorted({p.x for p in pts})))
    return _svg(parts, title)


def series_svg(
    lines: Sequence[Sequence[tuple[float, float]]], title: str, x_label: str, y_label: str
) -> str:
    """One polyline per sequence of (x, y) points (a resumed run's segment apart from the
    one before), on shared round-tick axes; for learning curves with many points."""
    kept = [[(x, y) for x, y in line if _plottable(x) and _plottable(y)] for line in lines]
    kept = [line for line in kept if line]
    if not kept:
        return _empty_svg(title)
    xs = [x for line in kept for x, _ in line]
    ys = [y for line in kept for _, y in line]
    axes = _Axes((min(xs), max(xs)), (min(ys), max(ys)))
    parts = axes.frame(title, x_label, y_label)
    for line in kept:
        coords = " ".join(f"{axes.px(x):.1f},{axes.py(y):.1f}" for x, y in line)
        parts.append(
            f'<polyline points="{coords}" fill="none" stroke="#2c6fbb" stroke-width="1.5"/>'
        )
    last_x, last_y = kept[-1][-1]
    parts.append(
        f'<circle cx="{axes.px(last_x):.1f}" cy="{axes.py(last_y):.1f}" r="3" fill="#2c6fbb">'
        f"<title>{_esc(x_label)} {plain(last_x)}: {plain(last_y)}</title></circle>"
    )
    parts.extend(axes.x_ticks())
    return _svg(parts, title)


def bar_svg(labels: Sequence[str], values: Sequence[float], title: str, y_label: str) -> str:
    """One labelled bar per value, for comparing environment variants side by side."""
    pairs = [(name, v) for name, v in zip(labels, values) if _plottable(v)]
    if not pairs:
        return _empty_svg(title)
    heights = [v for _, v in pairs]
    axes = _Axes((0.0, float(len(pairs))), (min(0.0, *heights), max(0.0, *heights)))
    parts = axes.frame(title, "variant", y_label)
    width = (axes.right - axes.left) / len(pairs)
    base = axes.py(0.0)
    for i, (name, value) in enumerate(pairs):
        top = axes.py(value)
        y, height = min(top, base), abs(base - top)
        x = axes.left + i * width
        parts.append(
            f'<rect x="{x + 4:.1f}" y="{y:.1f}" width="{max(width - 8, 1):.1f}" '
            f'height="{height:.1f}" fill="#27ae60"><title>{_esc(name)}: '
            f"{plain(value)}</title></rect>"
            f'<text x="{x + width / 2:.1f}" y="{axes.bottom + 14}" text-anchor="middle" '
            f'font-size="10">{_esc(name[:18])}</text>'
        )
    return _svg(parts, title)


def _empty_svg(title: str) -> str:
    return _svg(
        [
            f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" font-size="12">'
            f"{_esc(title)}: no finite data</text>"
        ],
        title,
    )


def table_html(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain HTML table; cells are escaped, floats shortened."""

    def cell(value: object) -> str:
        if isinstance(value, float):
            return "-" if not math.isfinite(value) else plain(value)
        return _esc("-" if value is None else str(value))

    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:76em}"
    "svg{max-width:100%;height:auto}.note{color:#555}"
    "table{border-collapse:collapse;margin:1em 0}"
    "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}"
    "th{background:#f3f3f3}.plots{display:flex;flex-wrap:wrap;gap:1em}"
    "code{background:#f3f3f3;padding:0 .2em}"
)


def page(title: str, sections: Sequence[tuple[str, str]]) -> str:
    """A complete HTML document; `sections` are (heading, already-rendered HTML) pairs."""
    body = "".join(f"<h2>{_esc(head)}</h2>{content}" for head, content in sections)
    return (
        '<!DOCTYPE html><html><head><meta charset="utf-8">'
        f"<title>{_esc(title)}</title><style>{_STYLE}</style></head>"
        f"<body><h1>{_esc(title)}</h1>{body}</body></html>\n"
    )
