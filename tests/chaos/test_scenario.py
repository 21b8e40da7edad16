"""Scenario files: the shipped ones parse; every mistake names its field; junk never escapes
as anything but ScenarioError."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shoal.chaos
from shoal.chaos.errors import ScenarioError
from shoal.chaos.scenario import FAULT_KINDS, TRAINING_INVARIANTS, from_dict, parse

SCENARIOS = Path(shoal.chaos.__file__).parent / "scenarios"
TRAINED = "nodes = 1\n[training]\nenv = 'acrobot'\n"
HOSTS = "nodes = 3\n[training]\nenv = 'acrobot'\n"


@pytest.mark.parametrize("name", ["smoke", "stress", "hosts"])
def test_shipped_scenarios_parse(name: str) -> None:
    scenario = parse((SCENARIOS / f"{name}.toml").read_text(), name)
    assert scenario.name == name
    assert scenario.faults
    assert [f.at for f in scenario.faults] == sorted(f.at for f in scenario.faults)
    assert {f.kind for f in scenario.faults} <= set(FAULT_KINDS)


def test_defaults_and_params() -> None:
    scenario = parse(
        'duration_s = 10\n[[faults]]\nkind = "api-delay"\ntarget = "all"\nat = 1\ndelay_s = 0.1\n'
    )
    assert scenario.replicas == 3
    assert scenario.rate == 50
    assert parse("rate = 400").rate == 400
    (fault,) = scenario.faults
    assert fault.net_faults().delay_s == 0.1
    assert fault.recover_within_s == scenario.recover_within_s


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("replicas = 2", "replicas=2 must be odd"),
        ("replicas = 'x'", "replicas='x' must be an integer"),
        ("rate = 0", "rate=0 must be an integer in 1..10000"),
        ("rate = 2.5", "rate=2.5 must be an integer"),
        ("duration_s = -1", "duration_s=-1 is outside"),
        ("bogus = 1", "unknown keys \\['bogus'\\]"),
        ("invariants = ['fast']", "invariants=\\['fast'\\]"),
        ("faults = 3", "faults must be an array"),
        ("[[faults]]\nkind = 'melt'\ntarget = 'c1'\nat = 1", "faults\\[0\\].kind='melt'"),
        ("[[faults]]\nkind = 'kill'\ntarget = 'c9'\nat = 1", "faults\\[0\\].target='c9'"),
        ("[[faults]]\nkind = 'kill'\ntarget = 'all'\nat = 1", "target='all'"),
        ("[[faults]]\nkind = 'kill'\ntarget = 'c1'", "faults\\[0\\].at is required"),
        ("duration_s = 5\n[[faults]]\nkind = 'kill'\ntarget = 'c1'\nat = 9", "at=9 is outside"),
        ("[[faults]]\nkind = 'kill'\ntarget = 'c1'\nat = 1\ndelay_s = 1", "unknown keys"),
        (
            "[[faults]]\nkind = 'api-loss'\ntarget = 'all'\nat = 1\nloss = 2",
            "faults\\[0\\]: loss=2",
        ),
        ("[[faults]]\nkind = 'disk-full'\ntarget = 'rank0'\nat = 1", "add a \\[training\\]"),
        (f"{TRAINED}[[faults]]\nkind = 'disk-full'\ntarget = 'rank1'\nat = 1", "target='rank1'"),
        (
            f"{TRAINED}[[faults]]\nkind = 'disk-full'\ntarget = 'rank0'\nat = 1\nlimit_bytes = -1",
            "limit_bytes=-1",
        ),
        ("[[faults]]\nkind = 'gpu-xid'\ntarget = 'n1'\nat = 1", "needs nodes >= 1"),
        ("nodes = 1\n[[faults]]\nkind = 'gpu-xid'\ntarget = 'c1'\nat = 1", "target='c1'"),
        ("[[faults]]\nkind = 'learner-kill'\ntarget = 'rank0'\nat = 1", "add a \\[training\\]"),
        (f"{TRAINED}[[faults]]\nkind = 'learner-kill'\ntarget = 'rank2'\nat = 1", "target='rank2'"),
        (f"{TRAINED}[[faults]]\nkind = 'rollout-kill'\ntarget = 'w2'\nat = 1", "target='w2'"),
        (
            f"{TRAINED}[[faults]]\nkind = 'learner-kill'\ntarget = 'rank0'\nat = 1\nranks = 2",
            "unknown",
        ),
        ("nodes = 1\n[[faults]]\nkind = 'node-kill'\ntarget = 'learners'\nat = 1", "learners"),
        ("nodes = 1\n[training]\nranks = 9", "training.ranks=9 must be in 1..4"),
        ("nodes = 1\n[training]\nranks = 2\nworkers = 1", "training.workers=1"),
        ("nodes = 1\n[training]\nenv = 3", "training.env=3"),
        ("nodes = 1\n[training]\nbogus = 3", "training: unknown keys \\['bogus'\\]"),
        ("nodes = 1\n[training]\ncheckpoint_interval_s = 0", "checkpoint_interval_s=0"),
        ("nodes = 1\ntraining = 3", "training must be a table"),
        ("[training]\nenv = 'acrobot'", "needs nodes >= 1"),
        (
            "nodes = 1\n[[faults]]\nkind = 'clock-skew'\ntarget = 'n1'\nat = 1\noffset_s = 0.1",
            "too small",
        ),
        ("[[faults]]\nkind = 'clock-skew'\ntarget = 'c1'\nat = 1", "needs nodes >= 1"),
        ("[[faults]]\nkind = 'raft-loss'\ntarget = 'c1'\nat = 1\nloss = 2", "loss=2"),
        ("[[faults]]\nkind = 'raft-delay'\ntarget = 'c1'\nat = 1\ndelay_s = -1", "delay_s=-1"),
        ("[[faults]]\nkind = 'raft-delay'\ntarget = 'c1'\nat = 1\nloss = 0.1", "unknown keys"),
        ("[[faults]]\nkind = 'raft-partition'\ntarget = 'all'\nat = 1", "target='all'"),
        ("invariants = ['fragment_accounting']", "add a \\[training\\] table"),
        ("nodes = 1\n[[faults]]\nkind = 'gpu-xid'\ntarget = 'n1'\nat = 1\ngpu = 4", "gpu=4"),
        (
            "nodes = 1\nsim_gpus = 0\n[[faults]]\nkind = 'gpu-xid'\ntarget = 'n1'\nat = 1",
            "needs sim_gpus",
        ),
        ("nodes = 17", "nodes=17"),
        ("[[faults]]\nkind = 'coord-partition'\ntarget = 'n1'\nat = 1", "needs nodes >= 1"),
        ("nodes = 2\n[[faults]]\nkind = 'coord-delay'\ntarget = 'n3'\nat = 1", "target='n3'"),
        ("nodes = 1\n[[faults]]\nkind = 'coord-reset'\ntarget = 'leader'\nat = 1", "leader"),
        (
            "nodes = 1\n[[faults]]\nkind = 'coord-partition'\ntarget = 'n1'\nat = 1\n"
            "partition = 'sideways'",
            "partition='sideways'",
        ),
        (
            "nodes = 1\n[[faults]]\nkind = 'coord-loss'\ntarget = 'n1'\nat = 1\nloss = 1.5",
            "loss=1.5",
        ),
        (
            "nodes = 1\n[[faults]]\nkind = 'coord-delay'\ntarget = 'n1'\nat = 1\nloss = 0.1",
            "unknown keys",
        ),
        ("nodes = 1\n[[faults]]\nkind = 'coord-reset'\ntarget = 'learners'\nat = 1", "learners"),
        (f"{TRAINED}[[faults]]\nkind = 'host-cut'\ntarget = 'n1'\nat = 1", "needs nodes >= 2"),
        ("nodes = 2\n[[faults]]\nkind = 'host-kill'\ntarget = 'learners'\nat = 1", "learners"),
        ("nodes = 2\n[[faults]]\nkind = 'host-kill'\ntarget = 'c1'\nat = 1", "target='c1'"),
        ("nodes = 2\n[[faults]]\nkind = 'learner-move'\ntarget = 'n1'\nat = 1", "\\[training\\]"),
        (f"{HOSTS}[[faults]]\nkind = 'learner-move'\ntarget = 'n1'\nat = 1", "target='n1'"),
        (
            f"{HOSTS}[[faults]]\nkind = 'host-delay'\ntarget = 'n1'\nat = 1\ndelay_ms = 0",
            "delay_ms=0 is outside 1..60000",
        ),
        (f"{HOSTS}[[faults]]\nkind = 'host-cut'\ntarget = 'n1'\nat = 1\ndelay_ms = 5", "unknown"),
        (f"{HOSTS}spread = 'yes'", "training.spread='yes' must be true or false"),
        (f"{HOSTS}gpus_per_rank = -1", "training.gpus_per_rank=-1"),
        ("name = ", "not valid TOML"),
    ],
)
def test_mistakes_name_the_field(text: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse(text, "t.toml")


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
_keys = st.sampled_from(
    [
        *("replicas", "duration_s", "clients", "keys", "rate"),
        *("faults", "invariants", "nodes", "training"),
    ]
)
_fault = st.fixed_dictionaries(
    {"kind": st.sampled_from([*FAULT_KINDS, "x"]), "target": st.sampled_from(["leader", "all"])},
    optional={"at": _json | st.floats(0, 40), "duration": _json, "loss": _json},
)
_training = st.dictionaries(
    st.sampled_from(
        ["env", "ranks", "workers", "checkpoint_interval_s", "seed", "gpus_per_rank", "spread", "x"]
    ),
    _json,
)


@settings(deadline=None)  # parsing is fast; a loaded 2-core machine is not
@given(st.dictionaries(_keys, _json | st.lists(_fault, max_size=3) | _training, max_size=5))
def test_junk_is_refused_cleanly(data: dict[str, object]) -> None:
    try:
        from_dict(data)
    except ScenarioError:
        pass


def test_training_invariants_are_checked_by_default_only_with_a_training_job() -> None:
    plain = parse("[[faults]]\nkind = 'raft-partition'\ntarget = 'leader'\nat = 1")
    assert "training_progress" not in plain.invariants
    assert plain.training is None
    trained = parse(f"{TRAINED}[[faults]]\nkind = 'learner-kill'\ntarget = 'rank1'\nat = 1")
    assert set(TRAINING_INVARIANTS) <= set(trained.invariants)
    assert trained.training is not None
    assert trained.training.env == "acrobot"
    assert trained.faults[0].params == {}


def test_learners_is_a_node_target_with_a_training_job() -> None:
    scenario = parse(
        f"{TRAINED}[[faults]]\nkind = 'gpu-xid'\ntarget = 'learners'\nat = 1\n"
        "[[faults]]\nkind = 'clock-skew'\ntarget = 'n1'\nat = 2\noffset_s = -3"
    )
    assert [f.target for f in scenario.faults] == ["learners", "n1"]
    assert scenario.faults[1].params == {"offset_s": -3}


def test_raft_link_faults_take_the_proxy_settings() -> None:
    scenario = parse(
        "[[faults]]\nkind = 'raft-delay'\ntarget = 'leader'\nat = 1\ndelay_s = 0.05\n"
        "jitter_s = 0.01\n[[faults]]\nkind = 'raft-loss'\ntarget = 'c2'\nat = 2\nloss = 0.1\n"
        "loss_mode = 'drop'"
    )
    delay, loss = (f.net_faults() for f in scenario.faults)
    assert (delay.delay_s, delay.jitter_s) == (0.05, 0.01)
    assert (loss.loss, loss.loss_mode) == (0.1, "drop")


def test_coordinator_link_faults_target_nodes_and_take_the_proxy_settings() -> None:
    scenario = parse(
        f"{TRAINED}[[faults]]\nkind = 'coord-partition'\ntarget = 'learners'\nat = 1\n"
        "partition = 'blackhole'\nduration = 3\n"
        "[[faults]]\nkind = 'coord-delay'\ntarget = 'all'\nat = 2\ndelay_s = 0.1\njitter_s = 0.02\n"
        "[[faults]]\nkind = 'coord-bandwidth'\ntarget = 'n1'\nat = 3\nbandwidth_bps = 5000\n"
        "[[faults]]\nkind = 'coord-reset'\ntarget = 'n1'\nat = 4"
    )
    partition, delay, bandwidth, reset = scenario.faults
    assert partition.target == "learners"
    assert partition.net_faults().partition == "blackhole"
    assert (delay.target, delay.net_faults().delay_s, delay.net_faults().jitter_s) == (
        "all",
        0.1,
        0.02,
    )
    assert bandwidth.net_faults().bandwidth_bps == 5000
    assert reset.params == {}
    plain = parse("nodes = 1\n[[faults]]\nkind = 'coord-partition'\ntarget = 'n1'\nat = 1")
    assert plain.faults[0].net_faults().partition == "refuse"


def test_host_faults_name_a_host_or_the_learners_and_take_a_delay() -> None:
    scenario = parse(
        f"{HOSTS}gpus_per_rank = 1\nspread = true\n"
        "[[faults]]\nkind = 'host-cut'\ntarget = 'learners'\nat = 1\nduration = 5\n"
        "[[faults]]\nkind = 'host-kill'\ntarget = 'n3'\nat = 2\n"
        "[[faults]]\nkind = 'host-delay'\ntarget = 'n2'\nat = 3\ndelay_ms = 80\n"
        "[[faults]]\nkind = 'learner-move'\ntarget = 'learners'\nat = 4"
    )
    assert [(f.kind, f.target) for f in scenario.faults] == [
        ("host-cut", "learners"),
        ("host-kill", "n3"),
        ("host-delay", "n2"),
        ("learner-move", "learners"),
    ]
    assert scenario.faults[2].params == {"delay_ms": 80}
    assert scenario.training is not None
    assert (scenario.training.gpus_per_rank, scenario.training.spread) == (1, True)
    plain = parse("nodes = 2\n[[faults]]\nkind = 'host-cut'\ntarget = 'n2'\nat = 1")
    assert plain.faults[0].target == "n2"
