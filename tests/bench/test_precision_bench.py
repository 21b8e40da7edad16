"""Smoke test of `shoal bench precision`: every case gives an act row and an update row, and
the smallest causal LM an SFT step row, each beside float32 from the same run, and says
whether shoal applies the autocast (timings are never asserted)."""

import importlib.util
import json

import pytest

from shoal.bench.precision import CASES
from shoal.cli import main
from shoal.learner.cpu_features import native_bf16


@pytest.mark.timeout(300)
def test_quick_run_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "precision", "--quick", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    lm_rows = importlib.util.find_spec("transformers") is not None
    assert len(rows) == 2 * len(CASES) + lm_rows
    for row in rows:
        assert row["unit"] == "CPU ms"
        assert row["baseline_name"] == "float32"
        assert row["higher_is_better"] is False
        assert row["shoal"] > 0
        assert row["baseline"] > 0
    updates = [row["metric"] for row in rows if "PPO epoch" in row["metric"]]
    applied = [metric for metric in updates if "(applied by shoal here)" in metric]
    cnns = [metric for metric in updates if "CNN" in metric]
    assert applied == (cnns if native_bf16() else [])
    sft = [row["metric"] for row in rows if "SFT step" in row["metric"]]
    assert len(sft) == lm_rows
    said = "where it measures faster" if native_bf16() else "not"
    assert all(metric.endswith(f"(applied by the pipeline here: {said})") for metric in sft)
