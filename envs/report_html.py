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

WIDTH = 420
HEIGHT = 240
_MARGIN_LEFT = 56
_MARGIN_RIGHT = 16
_MARGIN_TOP = 28
_MARGIN_BOTTOM = 40


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
    """A non-empty axis range, so a constant series still gets a readable axis."""
    if hi - lo < 1e-12:
        pad = max(abs(lo) * 0.1, 1.0)
        return lo - pad, hi + pad
    return lo, hi


class _Axes:
    """Maps data coordinates onto the plot area of one SVG."""

    def __init__(self, x_range: tuple[float, float], y_range: tuple[float, float]) -> None:
        self.x0, self.x1 = _span(*x_range)
        self.y0, self.y1 = _span(*y_range)
        self.left = _MARGIN_LEFT
        self.right = WIDTH - _MARGIN_RIGHT
        self.top = _MARGIN_TOP
        self.bottom = HEIGHT - _MARGIN_BOTTOM

    def px(self, x: float) -> float:
        return self.left + (x - self.x0) / (self.x1 - self.x0) * (self.right - self.left)

    def py(self, y: float) -> float:
        return self.bottom - (y - self.y0) / (self.y1 - self.y0) * (self.bottom - self.top)

    def frame(self, title: str, x_label: str, y_label: str) -> list[str]:
        parts = [
            f'<text x="{WIDTH / 2:.1f}" y="18" text-anchor="middle" font-size="13">'
            f"{_esc(title)}</text>",
            f'<line x1="{self.left}" y1="{self.bottom}" x2="{self.right}" y2="{self.bottom}" '
            'stroke="#333"/>',
            f'<line x1="{self.left}" y1="{self.top}" x2="{self.left}" y2="{self.bottom}" '
            'stroke="#333"/>',
            f'<text x="{(self.left + self.right) / 2:.1f}" y="{HEIGHT - 6}" '
            f'text-anchor="middle" font-size="11">{_esc(x_label)}</text>',
            f'<text x="12" y="{(self.top + self.bottom) / 2:.1f}" font-size="11" '
            f'text-anchor="middle" transform="rotate(-90 12 {(self.top + self.bottom) / 2:.1f})">'
            f"{_esc(y_label)}</text>",
        ]
        for value in (self.y0, (self.y0 + self.y1) / 2, self.y1):
            parts.append(
                f'<text x="{self.left - 4}" y="{self.py(value) + 4:.1f}" text-anchor="end" '
                f'font-size="10">{_tick(value)}</text>'
            )
        return parts

    def x_ticks(self, values: Sequence[float]) -> list[str]:
        return [
            f'<text x="{self.px(v):.1f}" y="{self.bottom + 14}" text-anchor="middle" '
            f'font-size="10">{_tick(v)}</text>'
            for v in values
        ]


def _tick(value: float) -> str:
    return f"{value:.3g}"


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
    axes = _Axes((lo, hi), (0.0, float(max(counts))))
    parts = axes.frame(title, x_label, "episodes")
    width = (axes.right - axes.left) / bins
    for i, count in enumerate(counts):
        top = axes.py(count)
        parts.append(
            f'<rect x="{axes.left + i * width:.1f}" y="{top:.1f}" width="{max(width - 1, 0.5):.1f}" '
            f'height="{axes.bottom - top:.1f}" fill="#4a7ab5"><title>{count}</title></rect>'
        )
    parts.extend(axes.x_ticks((lo, hi)))
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
            f"<title>{_tick(p.x)}: {_tick(p.y)} ± {_tick(p.spread)}</title></circle>"
        )
    parts.extend(axes.x_ticks(sorted({p.x for p in pts})))
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
            f"{_tick(value)}</title></rect>"
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
            return "-" if not math.isfinite(value) else f"{value:.4g}"
        return _esc("-" if value is None else str(value))

    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:60em}"
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
