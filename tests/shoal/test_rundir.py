"""RunDir names a run's files; RankStatus is the status record readers get, bounded and checked."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.boundedjson import JsonTooDeep, JsonTooLarge
from shoal.learner.config import TrainConfig
from shoal.learner.events import append_event
from shoal.run_status import RunStatus
from shoal.rundir import MAX_STATUS_BYTES, RankStatus, RunDir, StatusRefused, TrainError

RECORD = {
    "rank": 0,
    "pid": 4242,
    "version": 7,
    "env_steps": 1200,
    "sps": 350.5,
    "returns": [10.0, 12, 14.5],
    "policy_lag_median": math.nan,
    "metrics": {"loss": 0.5, "policy_loss": 0.1},
    "intake": {"received": 9, "trained": 8, "dropped_stale": 1},
    "checkpoint": "/runs/x/checkpoints/ckpt-000000000007",
    "checkpoint_step": 7,
    "checkpoint_error": None,
    "ledger": {"trained": {"actor-0": [[0, 9]]}},
    "phases": {"process": 1.0},
}


def test_a_rank_status_round_trips_through_the_run_dir(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.write_status(0, RECORD)
    assert run.status(0) == tmp_path / "status-0.json"
    status = run.read_status(0)
    assert (status.version, status.env_steps, status.sps) == (7, 1200, 350.5)
    assert status.returns == (10.0, 12.0, 14.5)
    assert status.policy_lag_median is None  # NaN: not measured yet
    assert status.checkpoint_step == 7
    assert status.checkpoint_error is None
    assert dict(status.intake) == {"received": 9, "trained": 8, "dropped_stale": 1}
    assert status.get("pid") == 4242
    assert status.get("absent", 3) == 3
    assert status.final is False


def test_a_new_run_clears_the_statuses_of_the_run_before_it(tmp_path: Path) -> None:
    """A stale status-1.json of an earlier 2-rank run would add its env_steps to this run's."""
    run = RunDir(tmp_path)
    for rank in (0, 1):
        run.write_status(rank, RECORD)
    run.append_event({"event": "run"})
    run.clear_statuses()
    assert not any(tmp_path.glob("status-*.json"))
    assert run.events.exists()  # the history stays
    run.clear_statuses()  # nothing to clear is fine


def test_a_partial_record_takes_defaults() -> None:
    status = RankStatus.from_json(b'{"checkpoint_step": 3}')
    assert (status.version, status.returns, status.checkpoint_step) == (0, (), 3)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"[1, 2]", "is an object, not list"),
        (b'{"version": "7"}', "status field version = '7' is not a int"),
        (b'{"version": true}', "status field version = True is not a int"),
        (b'{"returns": [1, "x"]}', "returns holds something that is not a float"),
        (b'{"intake": {"received": 1.5}}', "intake holds something that is not a int"),
        (b'{"sps": 1', "not JSON"),
        (b"\xff\xfe", "not JSON"),
    ],
)
def test_a_malformed_status_is_refused_by_name(data: bytes, message: str) -> None:
    with pytest.raises(StatusRefused, match=message) as info:
        RankStatus.from_json(data)
    assert isinstance(info.value, TrainError | ValueError)


def test_size_and_depth_are_bounded_before_parsing() -> None:
    with pytest.raises(JsonTooLarge):
        RankStatus.from_json(b" " * (MAX_STATUS_BYTES + 1))
    with pytest.raises(JsonTooDeep):
        RankStatus.from_json(b"[" * 100_000 + b"]" * 100_000)


@st.composite
def nested_json(draw: st.DrawFn) -> bytes:
    depth = draw(st.integers(0, 40))
    leaf = draw(st.sampled_from([b"1", b'"x"', b"null", b"{}", b"[]", b"NaN"]))
    opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"version":', b"}")]))
    return opener * depth + leaf + closer * depth


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.binary(max_size=300), nested_json()))
def test_any_bytes_give_a_status_or_a_value_error(data: bytes) -> None:
    try:
        RankStatus.from_json(data)
    except ValueError:
        pass  # JsonRefused and StatusRefused both are; nothing else may escape


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["version", "env_steps", "sps", "returns", "intake", "metrics", "x"]),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
            max_leaves=10,
        ),
    )
)
def test_any_record_shape_gives_a_status_or_a_refusal(record: dict) -> None:
    try:
        status = RankStatus.from_mapping(record)
    except StatusRefused:
        return
    assert isinstance(status.version, int)
    assert isinstance(status.returns, tuple)


def test_run_status_keeps_the_last_good_record_over_a_torn_one(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.write_status(0, RECORD)
    status = RunStatus(TrainConfig(), "CartPole-v1", tmp_path, None)
    status.read()
    assert status.version() == 7
    run.status(0).write_text('{"version": 8, "env_steps": "lots"}')  # foreign
    status.read()
    assert status.version() == 7
    assert status.env_steps() == 1200
    run.status(0).write_text("[" * 50_000)  # hostile
    status.read()
    assert status.version() == 7


def test_a_published_count_of_returns_is_capped_at_the_window(tmp_path: Path) -> None:
    status = RunStatus(TrainConfig(), "CartPole-v1", tmp_path, None)
    status.take_published({"version": 3, "returns": 10**12, "recent_return": 5.0})
    assert len(status.statuses[0].returns) == TrainConfig().target_window
    assert status.recent_return() == 5.0
    status.take_published({"version": "x"})  # malformed: the one before stays
    assert status.version() == 3


def test_a_run_dir_is_laid_out_and_named(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path, "gym:ALE/Pong-v5")
    again = RunDir.create(tmp_path, "gym:ALE/Pong-v5")
    assert run.path != again.path
    assert again.checkpoints.is_dir()
    assert run.path.name.endswith("gym_ALE_Pong-v5")
    assert run.checkpoints.is_dir()
    assert run.reports.is_dir()
    names = {
        run.job_record: "job.json",
        run.result: "result.json",
        run.events: "events.jsonl",
        run.accounting: "accounting",
        run.cluster_record: "cluster.json",
        run.api_token: "api-token",
        run.logs: "logs",
        run.address(1): "learner-1.addr",
    }
    assert all(path == run.path / name for path, name in names.items())


def test_a_run_dir_that_cannot_be_made_is_a_train_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(TrainError, match="cannot create run directory"):
        RunDir.lay_out(tmp_path / "file" / "run")


def test_events_append_one_line_each(tmp_path: Path) -> None:
    append_event(tmp_path, {"event": "start", "pid": 1})
    RunDir(tmp_path).append_event({"event": "stop"})
    lines = [json.loads(line) for line in RunDir(tmp_path).events.read_text().splitlines()]
    assert [line["event"] for line in lines] == ["start", "stop"]
    assert all(isinstance(line["time"], float) for line in lines)
