"""Published task state, GPUs and pending reasons in the pure state machine: what a task's
generation published is its own (stale copies refused, cleared on every new generation, an
incoming copy's carried over when it is promoted), the heartbeat's peers list it, placements
record their GPUs, and the validator of a published state (hypothesis: sizes, depth, types)
accepts exactly what the node daemon's own check accepts."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.raft.commands import (
    MAX_PUBLISHED_BYTES,
    MAX_PUBLISHED_KEY_CHARS,
    MAX_PUBLISHED_KEYS,
    MAX_PUBLISHED_TEXT,
    make_command,
    validate_args,
)
from shoal.raft.errors import RuleViolation, ValidationError
from shoal.raft.machine import StateMachine
from shoal.task_exchange import PublishedStateError, check_published
from tests.raft.test_scheduling import add_node, run, submit


def machine() -> StateMachine:
    m = StateMachine()
    add_node(m, "a", gpus=4, island_size=2)
    add_node(m, "b", gpus=4, island_size=2)
    submit(m, "j", rollouts=2, ranks=1, gpus=2, mode="manual")
    return m


def place(m: StateMachine, task: str, node: str | None, gpus: list[int] | None = None) -> Any:
    row: dict[str, Any] = {"task_id": task, "node_id": node}
    if gpus is not None:
        row["gpus"] = gpus
    return run(m, "place_tasks", {"placements": [row]})


def publish(
    m: StateMachine, task: str, state: dict[str, Any], generation: int | None = None
) -> Any:
    g = m.tasks[task].generation if generation is None else generation
    return run(m, "publish_task_state", {"task_id": task, "generation": g, "state": state})


# -- published state ---------------------------------------------------------------------------


def test_a_placed_task_publishes_and_its_jobs_nodes_see_it_as_peers() -> None:
    m = machine()
    assert place(m, "j-l0", "a", [2, 3])["ok"]
    assert place(m, "j-r0", "b")["ok"]
    result = publish(m, "j-l0", {"transport": "10.0.0.2:4000", "rank": 0, "ok": True})
    assert result == {
        "ok": True,
        "task_id": "j-l0",
        "generation": 1,
        "published": {"transport": "10.0.0.2:4000", "rank": 0, "ok": True},
    }
    peer = {
        "id": "j-l0",
        "generation": 1,
        "node": "a",
        "state": "pending",
        "published": {"transport": "10.0.0.2:4000", "rank": 0, "ok": True},
    }
    assert m.peers("b") == {"j": [peer]}  # b runs only a rollout of j: it sees the learner
    assert m.peers("a") == {"j": [peer]}
    assert publish(m, "j-l0", {"transport": "10.0.0.2:4001"})["ok"]  # replaces, not merges
    assert m.tasks["j-l0"].published == {"transport": "10.0.0.2:4001"}
    assert publish(m, "j-l0", {})["ok"]
    assert m.peers("a") == {"j": []}


def test_a_stale_or_unplaced_or_unknown_publisher_is_refused_and_changes_nothing() -> None:
    m = machine()
    unplaced = publish(m, "j-r0", {"x": 1}, generation=0)
    assert (unplaced["ok"], unplaced["error"]) == (False, "conflict")
    assert "placed on no node" in unplaced["message"]
    assert place(m, "j-r0", "a")["ok"]
    assert place(m, "j-r0", "b")["ok"]
    stale = publish(m, "j-r0", {"x": 1}, generation=1)
    assert (stale["ok"], stale["error"], stale["field"]) == (False, "conflict", "generation")
    assert "generation 1, but the task is at generation 2" in stale["message"]
    missing = run(m, "publish_task_state", {"task_id": "nope", "generation": 1, "state": {}})
    assert (missing["ok"], missing["error"]) == (False, "not_found")
    assert m.tasks["j-r0"].published == {}


def test_every_new_generation_clears_what_the_old_one_published() -> None:
    m = machine()
    assert place(m, "j-r0", "a")["ok"]
    assert publish(m, "j-r0", {"p": 1})["ok"]
    assert place(m, "j-r0", "b")["ok"]  # placed anew
    assert m.tasks["j-r0"].published == {}
    assert m.peers("b") == {"j": []}
    assert publish(m, "j-r0", {"p": 2})["ok"]
    restart = {
        "job_id": "j",
        "cause": "j-r0",
        "generation": m.tasks["j-r0"].generation,
        "tasks": ["j-r0"],
        "reason": "test",
        "counted": False,
    }
    assert run(m, "restart_tasks", restart)["ok"]
    assert (m.tasks["j-r0"].published, m.tasks["j-r0"].gpus) == ({}, [])


def test_an_incoming_copy_publishes_its_own_state_which_becomes_the_tasks_when_promoted() -> None:
    m = machine()
    assert place(m, "j-r0", "a")["ok"]
    g = m.tasks["j-r0"].generation
    assert run(m, "set_task_state", {"task_id": "j-r0", "state": "running", "generation": g})["ok"]
    assert publish(m, "j-r0", {"at": "a"})["ok"]
    assert run(m, "migrate_task", {"task_id": "j-r0", "node_id": "b", "gpus": [1]})["ok"]
    incoming = m.tasks["j-r0"].incoming
    assert incoming is not None
    assert incoming.gpus == [1]
    assert publish(m, "j-r0", {"at": "b"}, generation=incoming.generation)["ok"]
    assert m.peers("a")["j"][0]["published"] == {"at": "a"}  # the current copy's, still
    assert publish(m, "j-r0", {"at": "a2"})["ok"]  # the current copy may still publish too
    report = {"task_id": "j-r0", "state": "running", "generation": incoming.generation}
    assert run(m, "set_task_state", report)["ok"]
    task = m.tasks["j-r0"]
    assert (task.node, task.generation, task.gpus) == ("b", incoming.generation, [1])
    assert task.published == {"at": "b"}
    assert m.peers("b")["j"][0]["published"] == {"at": "b"}


def test_peers_list_only_running_jobs_with_a_task_on_the_node() -> None:
    m = machine()
    submit(m, "k", rollouts=1, mode="manual")
    assert place(m, "j-r0", "a")["ok"]
    assert place(m, "k-r0", "b")["ok"]
    assert publish(m, "j-r0", {"j": 1})["ok"]
    assert publish(m, "k-r0", {"k": 1})["ok"]
    assert set(m.peers("a")) == {"j"}
    assert set(m.peers("b")) == {"k"}
    assert run(m, "stop_job", {"job_id": "k"})["ok"]
    assert m.peers("b") == {}


# -- GPUs --------------------------------------------------------------------------------------


def test_a_placement_records_its_gpus_and_one_by_hand_gets_the_lowest_free() -> None:
    m = machine()
    assert place(m, "j-l0", "a", [1, 3])["ok"]
    assert m.tasks["j-l0"].gpus == [1, 3]
    submit(m, "k", ranks=2, gpus=2, mode="manual")
    assert place(m, "k-l0", "a")["ok"]  # names none: the lowest free ones j-l0 does not hold
    assert m.tasks["k-l0"].gpus == [0, 2]
    assert place(m, "k-l1", "a")["ok"]  # none left free: it gets none rather than a held one
    assert m.tasks["k-l1"].gpus == []
    assert place(m, "j-l0", None)["ok"]
    assert m.tasks["j-l0"].gpus == []
    events = [e for e in m.events if e.kind == "task_placed"]
    assert events[0].fields["gpus"] == [1, 3]


def test_gpus_the_node_lacks_are_refused_and_a_bad_list_never_reaches_the_machine() -> None:
    m = machine()
    refused = place(m, "j-l0", "a", [4])
    assert (refused["ok"], refused["error"], refused["field"]) == (
        False,
        "conflict",
        "placements[0].gpus",
    )
    assert "registered GPUs [0, 1, 2, 3], not GPU 4" in refused["message"]
    assert m.tasks["j-l0"].node is None
    with pytest.raises(RuleViolation, match="names GPU 1 twice"):
        make_command(
            "place_tasks",
            {"placements": [{"task_id": "j-l0", "node_id": "a", "gpus": [1, 1]}]},
            "x",
            1.0,
        )
    with pytest.raises(RuleViolation, match="placed on no node holds no GPUs"):
        make_command(
            "place_tasks",
            {"placements": [{"task_id": "j-l0", "node_id": None, "gpus": [0]}]},
            "x",
            1.0,
        )
    with pytest.raises(ValidationError, match="must be integer"):
        make_command("migrate_task", {"task_id": "j-l0", "node_id": "a", "gpus": ["0"]}, "x", 1.0)


# -- pending reasons ---------------------------------------------------------------------------


def test_a_pending_reason_is_set_once_per_reason_and_cleared_by_a_placement() -> None:
    m = machine()
    args = {"task_id": "j-l0", "generation": 0, "reason": "needs 64 GPUs"}
    assert run(m, "set_pending_reason", args) == {"ok": True, "changed": True}
    assert run(m, "set_pending_reason", args) == {"ok": True, "changed": False}
    refused = [e for e in m.events if e.kind == "refused"]
    assert [e.message for e in refused] == ["j-l0 stays pending: needs 64 GPUs"]
    assert refused[0].fields == {
        "task": "j-l0",
        "job": "j",
        "reason": "j-l0 stays pending: needs 64 GPUs",
    }
    stale = run(m, "set_pending_reason", {**args, "generation": 3})
    assert (stale["ok"], stale["error"]) == (False, "conflict")
    assert place(m, "j-l0", "a", [0, 1])["ok"]
    assert m.tasks["j-l0"].pending_reason == ""


def test_stopping_a_job_clears_its_pending_reasons() -> None:
    m = machine()
    assert run(m, "set_pending_reason", {"task_id": "j-l0", "generation": 0, "reason": "r"})["ok"]
    assert run(m, "stop_job", {"job_id": "j"})["ok"]
    assert m.tasks["j-l0"].pending_reason == ""


# -- the validator of what a task publishes ----------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=MAX_PUBLISHED_TEXT + 40)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)
keys = st.text(max_size=MAX_PUBLISHED_KEY_CHARS + 8)
states = (
    st.dictionaries(keys, scalars, max_size=MAX_PUBLISHED_KEYS + 6)
    | st.dictionaries(keys, values, max_size=6)
    | values
)


def deep(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = {"k": value}
    return value


def within_rules(state: Any) -> bool:
    """The rules written out once more, independently of either implementation."""
    if not isinstance(state, dict) or len(state) > MAX_PUBLISHED_KEYS:
        return False
    for key, value in state.items():
        if not 1 <= len(key) <= MAX_PUBLISHED_KEY_CHARS:
            return False
        if isinstance(value, str) and len(value) > MAX_PUBLISHED_TEXT:
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if not (value is None or isinstance(value, str | int | float)):
            return False
    return len(json.dumps(state, separators=(",", ":")).encode()) <= MAX_PUBLISHED_BYTES


def coordinator_accepts(state: Any) -> bool:
    try:
        validate_args("publish_task_state", {"task_id": "t", "generation": 1, "state": state})
    except ValidationError:
        return False
    return True


def node_accepts(state: Any) -> bool:
    try:
        check_published(state)
    except PublishedStateError:
        return False
    return True


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(states, st.integers(0, 200).map(deep)))
def test_the_coordinator_accepts_exactly_the_flat_small_states_the_node_accepts(state: Any) -> None:
    expected = within_rules(state)
    assert coordinator_accepts(state) == expected
    assert node_accepts(state) == expected


@settings(max_examples=100, deadline=None)
@given(st.integers(1, MAX_PUBLISHED_KEYS), st.integers(0, MAX_PUBLISHED_TEXT))
def test_the_size_limit_falls_exactly_at_4_kib(count: int, length: int) -> None:
    state = {f"k{i:02d}": "v" * length for i in range(count)}
    size = len(json.dumps(state, separators=(",", ":")).encode())
    assert coordinator_accepts(state) == (size <= MAX_PUBLISHED_BYTES)


def test_each_broken_rule_is_named() -> None:
    cases = {
        "must be object": ["a list"],
        "at most 32 keys": {f"k{i}": i for i in range(33)},
        "as a key, must have at most 64 characters": {"k" * 65: 1},
        "as a key, must have at least 1 characters": {"": 1},
        "must have at most 1024 characters": {"k": "v" * 1025},
        "must be string or number or boolean or null, got object": {"k": {"nested": 1}},
        "must be a finite number": {"k": math.inf},
        "more than 4096": {f"k{i}": "v" * 1000 for i in range(5)},
    }
    for needle, state in cases.items():
        with pytest.raises(ValidationError, match=needle) as info:
            validate_args("publish_task_state", {"task_id": "t", "generation": 1, "state": state})
        assert info.value.field.startswith("args.state")
