"""The SVG plots are well-formed XML, stay inside their canvas and escape every label."""

from __future__ import annotations

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
