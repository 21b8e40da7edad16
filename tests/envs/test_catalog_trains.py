"""`shoal envs list`'s "trains" column: the probe also runs the learner's pre-flight (the auto
preset's wrappers and the auto model built for the spaces), so an id that steps but cannot
train is listed as such, with the reason."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from shoal.cli import main
from shoal.commands.envs import TRAINS_CHECK, family
from shoal.envs.catalog import probe

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_the_probe_tells_stepping_from_training() -> None:
    ids = ["CartPole-v1", "gym:ALE/Pong-v5", "gym:ShoalOdd/SwitchBoard-v0", "NoSuch-v1"]
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    results = probe(
        ids, workers=1, imports=["tests.support.odd_envs"], env=environ, check=TRAINS_CHECK
    )
    by_id = {r.id: r for r in results}
    assert (by_id["CartPole-v1"].trains, by_id["gym:ALE/Pong-v5"].trains) == (True, True)
    switches = by_id["gym:ShoalOdd/SwitchBoard-v0"]
    assert switches.ok
    assert switches.trains is False
    assert "acts in MultiBinary(3)" in switches.trains_detail
    assert not by_id["NoSuch-v1"].ok
    assert by_id["NoSuch-v1"].trains is None  # never asked: it does not even make
    assert probe(["CartPole-v1"], workers=1, env=environ)[0].trains is None  # no check given


@pytest.mark.timeout(240)
def test_envs_list_shows_the_column_and_both_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    assert main(["envs", "list", "--no-gym", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {"CartPole-v1", "GridWorld-v1", "CodeGen-v1"} <= {e["id"] for e in listed}
    assert all(entry["trains"] is True for entry in listed), listed
    assert main(["envs", "list", "--no-gym"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("CartPole-v1") and line.endswith("ok  trains") for line in out)
    training = [line.split()[0] for line in out if line.endswith(" ok  trains")]
    distinct = len({family(env_id) for env_id in training})
    assert out[-1].endswith(
        f"{len(training)} of them train with the default model ({distinct} distinct)"
    )
