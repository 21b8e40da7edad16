"""MuJoCo's per-model warnings reach the log once, never the terminal (the progress line)."""

from __future__ import annotations

import logging

import pytest

from shoal.envs.registry import make

pytest.importorskip("mujoco", reason="mujoco (the envs extra) is not installed")


def test_each_mujoco_warning_is_logged_once_and_stderr_stays_clean(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shoal.envs.engine_warnings")
    for _ in range(3):  # every copy compiles its model, and each compile used to print
        env = make("gym:HalfCheetah-v5")
        env.reset()
        env.close()
    # MuJoCo's own print (a log record may still reach stderr through a handler other tests left)
    assert "WARNING: compiler attribute" not in capfd.readouterr().err
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("mujoco: ")]
    assert len(logged) == len(set(logged))
