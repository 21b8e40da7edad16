"""The probe runs each id in real worker subprocesses: a hang is killed at its deadline, a crash
or an exception costs only its own entry, and chatter on stdout cannot corrupt the answers."""

import os
import sys
import textwrap

import pytest

from shoal.envs.catalog import probe, probe_one
from shoal.envs.errors import EnvError

PLUGIN = textwrap.dedent(
    """
    import os, signal, time
    from shoal.envs import register
    from shoal.envs.cartpole import make_single


    def hang():
        time.sleep(3600)


    def crash():
        os.kill(os.getpid(), signal.SIGKILL)


    def broken():
        raise RuntimeError("no ROM for this game")


    def chatty():
        print("A.L.E: Arcade Learning Environment banner")
        return make_single()


    register("Hang-v1", hang)
    register("Crash-v1", crash)
    register("Broken-v1", broken)
    register("Chatty-v1", chatty)
    """
)


@pytest.fixture
def plugin_env(tmp_path):
    (tmp_path / "probe_plugin.py").write_text(PLUGIN)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *sys.path])
    return env


@pytest.mark.timeout(120)
def test_probe_survives_hangs_crashes_and_chatter(plugin_env):
    ids = ["CartPole-v1", "Hang-v1", "Crash-v1", "Broken-v1", "Chatty-v1", "GridWorld-v1"]
    results = probe(ids, workers=2, timeout=8.0, imports=["probe_plugin"], env=plugin_env)
    by_id = {r.id: r for r in results}
    assert [r.id for r in results] == ids
    assert by_id["CartPole-v1"].ok
    assert by_id["GridWorld-v1"].ok
    assert by_id["Chatty-v1"].ok
    assert not by_id["Hang-v1"].ok
    assert by_id["Hang-v1"].detail == "timed out after 8 s"
    assert by_id["Crash-v1"].detail == "the probe process died (exit status -9)"
    assert by_id["Broken-v1"].detail == "RuntimeError: no ROM for this game"


def test_probe_one_reports_an_unknown_id():
    result = probe_one("Nope-v1")
    assert not result.ok
    assert result.detail.startswith("UnknownEnvironment: no environment 'Nope-v1'")


def test_probe_refuses_bad_settings():
    with pytest.raises(EnvError, match="workers must be at least 1, got 0"):
        probe(["CartPole-v1"], workers=0)
    with pytest.raises(EnvError, match="timeout must be positive, got 0"):
        probe(["CartPole-v1"], timeout=0)
