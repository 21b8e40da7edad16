"""The files a process task and its node daemon exchange: published state and peers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal import boundedjson
from shoal.task_exchange import (
    MAX_PUBLISHED_BYTES,
    PEERS,
    PUBLISHED,
    NodeExchange,
    PublishedStateError,
    check_published,
    host_of,
    parse_peers,
    parse_published,
    publish,
    read_peers,
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**53), 2**53),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=64),
)
states = st.dictionaries(st.text(min_size=1, max_size=16), scalars, max_size=8)


@given(states)
def test_a_flat_state_within_the_limits_round_trips(state: dict[str, object]) -> None:
    assert parse_published(json.dumps(state).encode()) == state


@given(st.binary(max_size=2 * MAX_PUBLISHED_BYTES))
def test_any_bytes_are_a_state_or_a_specific_refusal(data: bytes) -> None:
    try:
        state = parse_published(data)
    except (PublishedStateError, boundedjson.JsonRefused):
        return
    assert isinstance(state, dict)
    assert len(json.dumps(state).encode()) <= MAX_PUBLISHED_BYTES


@given(st.integers(3, 10_000))
def test_nesting_is_refused_before_parsing(depth: int) -> None:
    with pytest.raises(boundedjson.JsonRefused):
        parse_published(b'{"a":' + b"[" * depth + b"]" * depth + b"}")


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ([1, 2], "must be a JSON object"),
        ({"a": [1]}, "a list"),
        ({"a": {"b": 1}}, "a dict"),
        ({"": 1}, "key ''"),
        ({"k" * 65: 1}, "1 to 64"),
        ({"a": "x" * 1025}, "longer than 1024"),
        ({f"k{i}": i for i in range(33)}, "at most 32"),
        ({f"k{i}": "x" * 1000 for i in range(8)}, "bytes encoded"),
        ({"a": float("nan")}, "not a finite number"),
    ],
)
def test_a_state_that_breaks_a_rule_names_it(state: object, message: str) -> None:
    with pytest.raises(PublishedStateError, match=message):
        check_published(state)


def test_peers_of_the_wrong_shape_are_left_out() -> None:
    good = {"id": "j-learner-0", "generation": 2, "node": "n1", "published": {"rank": 0}}
    data = json.dumps(
        {"tasks": [good, {"id": 3}, "x", {"id": "a", "generation": "2", "published": {}}]}
    ).encode()
    assert parse_peers(data) == [good]
    assert parse_peers(b"[]") == []


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("shoal://10.1.2.3:7000", "10.1.2.3"),
        ("shoal://127.0.0.1:1", "127.0.0.1"),
        ("shoal://[::1]:9", "::1"),
        ("", "127.0.0.1"),
    ],
)
def test_host_of_an_address(address: str, host: str) -> None:
    assert host_of(address) == host


def test_a_new_generation_starts_with_nothing_published_and_sees_known_peers(
    tmp_path: Path,
) -> None:
    exchange = NodeExchange(tmp_path / "jobs", "10.0.0.2")
    env = exchange.prepare("job", "job-learner-0", (3, 5))
    directory = Path(env["SHOAL_TASK_DIR"])
    assert env["SHOAL_TASK_GPUS"] == "3,5"
    assert env["SHOAL_NODE_HOST"] == "10.0.0.2"
    assert env["SHOAL_JOB_DIR"] == str(tmp_path / "jobs" / "job")
    assert publish({"rank": 0, "address": "shoal://10.0.0.2:1"}, directory)
    data = exchange.fresh("job-learner-0", 1, directory)
    assert data is not None
    assert parse_published(data)["rank"] == 0
    assert exchange.fresh("job-learner-0", 1, directory) is None  # taken once
    exchange.retry("job-learner-0", 1)
    assert exchange.fresh("job-learner-0", 1, directory) == data  # not forwarded: again
    peers = {"job": [{"id": "job-learner-0", "generation": 1, "published": {"rank": 0}}]}
    exchange.show_peers(peers, {directory: "job"})
    assert read_peers(directory)[0]["published"] == {"rank": 0}
    exchange.prepare("job", "job-learner-0", ())  # the next generation, same directory
    assert not (directory / PUBLISHED).exists()
    assert read_peers(directory)[0]["id"] == "job-learner-0"  # what the node knows, at once


def test_without_a_node_daemon_publishing_is_a_no_op(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("SHOAL_TASK_DIR", raising=False)
    assert publish({"a": 1}) is False
    assert read_peers() == []
    (tmp_path / PEERS).write_bytes(b"{" * 100_000)
    assert read_peers(tmp_path) == []
