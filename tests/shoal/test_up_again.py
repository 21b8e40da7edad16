"""`shoal up` on a run directory an earlier cluster left: it runs with today's interpreter and
says which port another program took, instead of starting replicas that die at bind."""

from __future__ import annotations

import socket
import sys
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from shoal.cli import main
from shoal.commands.up import _with_this_interpreter
from shoal.local import LocalCluster, coordinator_specs


def test_a_recorded_interpreter_gives_way_to_the_running_one(tmp_path: Path) -> None:
    (spec,) = coordinator_specs(tmp_path, 1)
    old = replace(spec, argv=["/gone/venv/bin/python", *spec.argv[1:]])
    assert _with_this_interpreter(old).argv == [sys.executable, *spec.argv[1:]]
    wrapped = replace(spec, argv=["ip", "netns", "exec", "h1", "/gone/python", *spec.argv[1:]])
    assert _with_this_interpreter(wrapped).argv[:5] == ["ip", "netns", "exec", "h1", sys.executable]


def test_a_port_taken_since_is_named_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    local = LocalCluster(run_dir)
    (spec,) = coordinator_specs(local.run_dir, 1)
    local.create([replace(spec, argv=["/gone/venv/bin/python", *spec.argv[1:]])])
    api = urlsplit(spec.api_url or "")
    with socket.socket() as squatter:
        squatter.bind((api.hostname or "127.0.0.1", api.port or 0))
        squatter.listen()
        code = main(["up", "--replicas", "1", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{api.hostname}:{api.port}" in err
    assert "another program" in err
    assert "Traceback" not in err
    assert local.pid("c1") is None  # nothing started
