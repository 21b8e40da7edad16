"""The SVG plots are well-formed XML, stay inside their canvas and escape every label."""

from __future__ import annotations

import itertools
import re
import xml.etree.ElementTree as ET

from hypothesis import given
from hypothesis import strategies as st

from shoal.envs import report_html
from shoal.envs.report_html import HEIGHT, WIDTH, Point

any_float = st.floats(allow_nan=True, allow_infinity=True)
finite = st.floats(-1e9, 1e9)
label = st.text(max_size=30)


def _coordinates(svg: str) -> list[float]:
    found = re.findall(r'\b(?:x|y|x1|x2|y1|y2|cx|cy)="([-0-9.e+]+)"', svg)
    for points in re.findall(r'points="([^"]*)"', svg):
        found.extend(v for pair in points.split() for v in pair.split(","))
    return [float(v) for v in found]


def _check(svg: str) -> None:
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    for value in _coordinates(svg):
        assert -1 <= value <= max(WIDTH, HEIGHT) + 1


@given(st.lists(any_float, max_size=40), label, label)
def test_histogram_is_valid_svg(values, title, x_label):
    _check(report_html.histogram_svg(values, title, x_label))


@given(st.lists(st.builds(Point, finite, finite, st.floats(0, 1e6)), max_size=10), label)
def test_line_plot_is_valid_svg(points, title):
    _check(report_html.line_svg(points, title, "σ", "return"))


@given(st.lists(st.tuples(label, any_float), max_size=8), label)
def test_bar_chart_is_valid_svg(pairs, title):
    _check(report_html.bar_svg([p[0] for p in pairs], [p[1] for p in pairs], title, "return"))


def test_histogram_counts_every_value_once():
    svg = report_html.histogram_svg([1.0, 1.0, 2.0, 3.0], "t", "x", bins=3)
    counts = [int(c) for c in re.findall(r"<title>(\d+)</title>", svg)]
    assert sum(counts) == 4
    assert counts == [2, 1, 1]


def test_page_escapes_markup_in_labels():
    page = report_html.page("<b>x</b>", [("<i>", report_html.table_html(["<h>"], [["<td>"]]))])
    assert "<b>x</b>" not in page
    assert "&lt;b&gt;" in page
    assert "<td>&lt;td&gt;</td>" in page


@given(finite, finite)
def test_round_ticks_span_the_data_evenly_and_few(a, b):
    lo, hi = min(a, b), max(a, b)
    ticks = report_html.nice_ticks(lo, hi)
    assert 2 <= len(ticks) <= 8
    steps = [y - x for x, y in itertools.pairwise(ticks)]
    assert ticks[0] <= lo
    assert ticks[-1] >= hi - 1e-6 * steps[0]
    assert all(s > 0 for s in steps)
    assert max(steps) - min(steps) <= 1e-6 * max(steps)


@given(
    st.floats(1e-4, 1e15, exclude_max=True)
    | st.floats(-1e15, -1e-4, exclude_min=True)
    | st.integers(-(10**14), 10**14)
)
def test_plain_numbers_have_no_exponent(value):
    text = report_html.plain(float(value))
    assert "e" not in text
    assert len(text) <= 12


def test_plain_numbers_read_as_people_write_them():
    assert report_html.plain(86370.0) == "86,370"
    assert report_html.plain(0.0312) == "0.0312"
    assert report_html.plain(1_500_000.0) == "1.5M"
    assert report_html.plain(-0.5) == "-0.5"


def _labels_fit(svg: str) -> None:
    """Every label lies inside the canvas by its estimated width (nothing clipped)."""
    root = ET.fromstring(svg)
    for text in root.iter("{http://www.w3.org/2000/svg}text"):
        if text.get("transform"):
            continue  # the rotated y-axis title, centred on the axis
        x, width = float(text.get("x", 0)), len(text.text or "") * report_html._CHAR_PX
        anchor = text.get("text-anchor", "start")
        left = {"start": x, "middle": x - width / 2, "end": x - width}[anchor]
        if (text.text or "").strip() and text.get("font-size") == "10":
            assert left >= 0, (text.text, anchor, x)
            assert left + width <= WIDTH + 0.5, (text.text, anchor, x)


@given(
    st.lists(st.tuples(st.floats(0, 1e12), st.floats(-1e9, 1e9)), min_size=1, max_size=50),
    label,
)
def test_learning_curve_ticks_stay_inside_the_chart(points, title):
    svg = report_html.series_svg([sorted(points)], title, "env steps", "return")
    _check(svg)
    _labels_fit(svg)


@given(st.lists(any_float, max_size=40))
def test_histogram_ticks_stay_inside_the_chart(values):
    _labels_fit(report_html.histogram_svg(values, "Episode returns", "return"))
