"""A real `shoal train cartpole --embedded` run leaves learning curves you can look at:
curves.csv rows, TensorBoard event files that TensorBoard itself reads back, and the charts
in the final report; `shoal eval` of the run then writes reports of its own beside it, and
an evaluation shows its progress."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from shoal.cli import main
from shoal.learning_curves import CURVES_FILE, read_curves
from shoal.progress import ProgressLine
from shoal.train import evaluate_checkpoint


class _Terminal(io.StringIO):
    """A stream that says it is a terminal, so the progress line is redrawn in place."""

    def isatty(self) -> bool:
        return True


@pytest.mark.timeout(240)
def test_a_run_writes_curves_and_eval_never_replaces_its_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHOAL_EVAL_EPISODES", "2")
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "home"))
    run_dir = tmp_path / "run"
    argv = ["train", "cartpole", "--embedded", "--json", "--quiet", "--target-return", "1e9"]
    argv += ["--max-env-steps", "30000", "--time-limit", "180", "--run-dir", str(run_dir)]
    assert main(argv) == 1  # not solved: the step budget stops it, as asked
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    curves = read_curves(run_dir / CURVES_FILE)
    assert curves.skipped == 0
    assert len(curves.rows) >= 2
    steps = [r["env_steps"] for r in curves.rows]
    assert steps == sorted(steps)
    assert len(set(steps)) == len(steps)
    assert steps[-1] == summary["env_steps"]
    assert all(r["run"] == 1 for r in curves.rows)
    assert any(r["policy_loss"] is not None for r in curves.rows)

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    sps = events.Scalars("train/sps")
    assert [e.step for e in sps] == steps
    assert "losses/value_loss" in events.Tags()["scalars"]

    report = Path(summary["report_html"])
    page = report.read_text()
    assert "<h2>Learning curves</h2>" in page
    assert page.count('aria-label="Return"') == 1
    assert "Throughput" in page
    assert "Policy lag" in page
    assert "Value loss" in page
    before = report.read_bytes()

    reports = set()
    for _ in range(2):
        assert main(["eval", str(run_dir), "--episodes", "2", "--quiet", "--json"]) == 0
        evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        reports.add(evaluated["report_html"])
        assert Path(evaluated["report_html"]).parent == report.parent
        assert "<h2>Learning curves</h2>" in Path(evaluated["report_html"]).read_text()
    assert len(reports) == 2
    assert str(report) not in reports
    assert report.read_bytes() == before

    terminal = _Terminal()
    evaluate_checkpoint(
        Path(summary["checkpoint"]),
        "CartPole-v1",
        2,
        tmp_path / "more",
        label="progress",
        progress=ProgressLine(terminal),
    )
    drawn = terminal.getvalue()
    assert "\r[" in drawn
    assert "evaluating CartPole-v1" in drawn
    assert "14/14 episodes" in drawn  # 2 episodes × (clean + 3 + 3 noise levels)
    assert drawn.endswith("\n")
