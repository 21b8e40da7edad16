"""curves.csv and the TensorBoard event files from the ranks' status records (real RunStatus
over real status files), a resumed run appending after the last, and a hostile curves.csv
that never breaks the report."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from shoal.curves_report import MAX_POINTS, curves_section
from shoal.learner.config import TrainConfig
from shoal.learning_curves import (
    COLUMNS,
    CURVES_FILE,
    HEADER,
    MAX_CURVES_BYTES,
    CurvesError,
    LearningCurves,
    read_curves,
)
from shoal.run_status import RunStatus
from shoal.rundir import RunDir


def _report(tmp_path: Path, version: int, steps: int, **extra: Any) -> RunStatus:
    record = {
        "version": version,
        "env_steps": steps,
        "sps": 1000.0,
        "returns": [float(version)] * 20,
        "policy_lag_median": 1.0,
        "metrics": {"policy_loss": -0.01 * version, "value_loss": 3.0, "entropy": 0.6},
        **extra,
    }
    RunDir(tmp_path).write_status(0, record)
    status = RunStatus(TrainConfig(), "CartPole-v1", tmp_path, None)
    status.read()
    return status


def test_a_row_per_change_with_the_header_once(tmp_path: Path) -> None:
    curves = LearningCurves(tmp_path)
    assert not curves.record(0.2, _report(tmp_path, 0, 0))  # nothing trained yet
    assert curves.record(1.0, _report(tmp_path, 1, 512))
    assert not curves.record(1.25, _report(tmp_path, 1, 512))  # the same report polled again
    assert curves.record(2.0, _report(tmp_path, 2, 1024))
    curves.close()
    lines = (tmp_path / CURVES_FILE).read_text().splitlines()
    assert lines[0] == HEADER
    assert len(lines) == 3
    rows = read_curves(tmp_path / CURVES_FILE).rows
    assert [r["env_steps"] for r in rows] == [512, 1024]
    assert [r["version"] for r in rows] == [1, 2]
    assert rows[1]["return"] == 2.0
    assert rows[1]["policy_loss"] == pytest.approx(-0.02)
    assert rows[1]["approx_kl"] is None  # a metric the ranks did not report stays empty
    assert rows[1]["time_s"] == 2.0


def test_tensorboard_reads_back_every_scalar_at_its_env_step(tmp_path: Path) -> None:
    curves = LearningCurves(tmp_path)
    for version in range(1, 4):
        curves.record(float(version), _report(tmp_path, version, 100 * version))
    curves.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/return", "train/sps", "train/policy_lag", "losses/policy_loss"} <= tags
    returns = events.Scalars("train/return")
    assert [e.step for e in returns] == [100, 200, 300]
    assert [e.value for e in returns] == [1.0, 2.0, 3.0]


def test_a_resumed_run_appends_as_the_next_run_with_its_clock_going_on(tmp_path: Path) -> None:
    first = LearningCurves(tmp_path)
    first.record(10.0, _report(tmp_path, 5, 5000))
    first.close()
    second = LearningCurves(tmp_path)
    second.record(3.0, _report(tmp_path, 6, 6000))
    second.close()
    curves = read_curves(tmp_path / CURVES_FILE)
    assert [(r["run"], r["time_s"]) for r in curves.rows] == [(1, 10.0), (2, 13.0)]
    assert len(curves.series("env_steps", "return")) == 2  # one line per run
    assert (tmp_path / CURVES_FILE).read_text().count(HEADER) == 1


def test_a_foreign_curves_file_is_moved_aside_not_appended_to(tmp_path: Path) -> None:
    (tmp_path / CURVES_FILE).write_text("name,score\nalice,3\n")
    curves = LearningCurves(tmp_path)
    curves.record(1.0, _report(tmp_path, 1, 10))
    curves.close()
    assert (tmp_path / (CURVES_FILE + ".unreadable")).read_text() == "name,score\nalice,3\n"
    assert [r["run"] for r in read_curves(tmp_path / CURVES_FILE).rows] == [1]


def test_rows_that_do_not_parse_are_skipped_and_counted(tmp_path: Path) -> None:
    good = ",".join(["1", "2.5", "100", "1", "9", "50", "0", "", "", "", "", ""])
    bad = [
        "1,2",  # too few cells
        good.replace("2.5", "nan"),  # not finite
        good.replace("100", "1e999"),  # overflows to inf
        good.replace("9", "<script>"),  # not a number
        "," * (len(COLUMNS) - 1),  # no run, no time
        "9" * 5000,  # over the line bound
    ]
    (tmp_path / CURVES_FILE).write_text("\n".join([HEADER, good, *bad, good]) + "\n")
    curves = read_curves(tmp_path / CURVES_FILE)
    assert len(curves.rows) == 2
    assert curves.skipped == len(bad)
    title, body = curves_section(tmp_path) or ("", "")
    assert title == "Learning curves"
    assert f"{len(bad)} unreadable lines were skipped" in body
    assert "<script>" not in body


def test_a_file_over_the_bound_is_read_from_its_newest_rows(tmp_path: Path) -> None:
    row = "1,{t},{t},1,5,1,0,,,,,\n"
    with (tmp_path / CURVES_FILE).open("w") as handle:
        handle.write(HEADER + "\n")
        t = 0
        while handle.tell() <= MAX_CURVES_BYTES + 4096:
            t += 1
            handle.write(row.format(t=t))
    curves = read_curves(tmp_path / CURVES_FILE)
    assert curves.truncated
    assert curves.rows[-1]["time_s"] == t
    assert len(curves.rows) < t
    assert curves.skipped <= 1  # at most the row the cut went through
    _, body = curves_section(tmp_path) or ("", "")
    assert "only its newest rows are drawn" in body
    # a drawn line is thinned to MAX_POINTS however long the file
    drawn = [b.split('"')[0].count(",") for b in body.split('points="')[1:]]
    assert drawn
    assert max(drawn) <= MAX_POINTS + 1


def test_a_header_that_is_not_ours_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / CURVES_FILE).write_bytes(b"\x00\xff" * 10)
    with pytest.raises(CurvesError, match="not a shoal learning-curves file"):
        read_curves(tmp_path / CURVES_FILE)
    _title, body = curves_section(tmp_path) or ("", "")
    assert "could not be read" in body


def test_no_curves_file_is_no_section(tmp_path: Path) -> None:
    assert curves_section(tmp_path) is None


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=3000))
def test_any_bytes_after_the_header_give_a_well_formed_section(data: bytes) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(scratch)
        (run_dir / CURVES_FILE).write_bytes(HEADER.encode() + b"\n" + data)
        curves = read_curves(run_dir / CURVES_FILE)
        for row in curves.rows:
            assert all(v is None or math.isfinite(v) for v in row.values())
        section = curves_section(run_dir)
        assert section is not None
        ET.fromstring(f"<div>{section[1]}</div>")  # well-formed: every chart and note closes
