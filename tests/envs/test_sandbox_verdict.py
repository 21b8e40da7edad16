"""The verdict is a pure function of the server's facts: whatever the child wrote, it is bounded."""

from __future__ import annotations

import errno
import json
import signal

from hypothesis import given
from hypothesis import strategies as st

from shoal.envs.sandbox_verdict import Status, TestCase, classify_error, judge

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=6,
)
events = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"event": st.just("test"), "index": st.integers(-2, 6), "value": json_values}
        ),
        st.fixed_dictionaries(
            {
                "event": st.just("test"),
                "index": st.integers(0, 6),
                "error": st.fixed_dictionaries(
                    {
                        "type": st.sampled_from(["ValueError", "MemoryError", "OSError"]),
                        "errno": st.none()
                        | st.sampled_from([errno.EFBIG, errno.EAGAIN, errno.EACCES]),
                    }
                ),
            }
        ),
        st.fixed_dictionaries(
            {
                "event": st.just("error"),
                "phase": st.sampled_from(["compile", "module", "setup"]),
                "type": st.sampled_from(["SyntaxError", "KeyError", "SystemExit", "MemoryError"]),
            }
        ),
        st.just({"event": "done"}),
        st.dictionaries(st.text(max_size=3), json_values, max_size=2),
    ),
    max_size=10,
)
facts = st.fixed_dictionaries(
    {
        "events": events,
        "timed_out": st.booleans(),
        "events_overflow": st.booleans(),
        "signal": st.none() | st.sampled_from([signal.SIGSEGV, signal.SIGXCPU, signal.SIGKILL]),
        "exit_code": st.none() | st.integers(0, 255),
    }
)
tests = st.lists(st.builds(TestCase, st.text(max_size=5), json_values), max_size=6)


def _text(events):
    """The result channel as the child writes it: one JSON object a line."""
    return "\n".join(json.dumps(e) for e in events)


@given(facts, tests, st.text(max_size=20))
def test_reward_is_a_fraction_and_zero_unless_ok(f, cases, garbage):
    result = judge({**f, "events": _text(f["events"]) + "\n" + garbage}, cases)
    assert 0.0 <= result.reward <= 1.0
    assert 0 <= result.passed <= result.total == len(cases)
    assert len(result.tests) == len(cases)
    if result.status is not Status.OK:
        assert result.reward == 0.0
    if f["timed_out"] or f["events_overflow"] or f["signal"] is not None:
        assert result.status is not Status.OK


@given(st.lists(json_values, min_size=1, max_size=6))
def test_matching_values_and_done_earn_full_reward(values):
    cases = [TestCase(f"t{i}", v) for i, v in enumerate(values)]
    reported = [{"event": "test", "index": i, "value": v} for i, v in enumerate(values)]
    result = judge({"events": _text([*reported, {"event": "done"}]), "exit_code": 0}, cases)
    assert result.status is Status.OK
    assert result.reward == 1.0


def test_a_missing_done_means_the_code_left_early():
    result = judge({"events": "", "exit_code": 0}, [TestCase("f()", 1)])
    assert result.status is Status.EXITED
    assert result.tests[0].error == "not run"


def test_a_tuple_result_matches_a_list_and_int_matches_float():
    cases = [TestCase("a", (1, 2)), TestCase("b", 2.0)]
    events = [
        {"event": "test", "index": 0, "value": [1, 2]},
        {"event": "test", "index": 1, "value": 2},
        {"event": "done"},
    ]
    assert judge({"events": _text(events)}, cases).reward == 1.0


def test_exceptions_map_to_the_limit_they_reveal():
    table = {
        ("MemoryError", None): Status.MEMORY_LIMIT,
        ("BlockingIOError", errno.EAGAIN): Status.PROCESS_LIMIT,
        ("OSError", errno.EFBIG): Status.FILE_SIZE_LIMIT,
        ("OSError", errno.ENOSPC): Status.DISK_LIMIT,
        ("OSError", errno.ENETUNREACH): Status.NETWORK_BLOCKED,
        ("PermissionError", errno.EACCES): Status.FORBIDDEN,
        ("SystemExit", None): Status.EXITED,
        ("KeyError", None): None,
        ("FileNotFoundError", errno.ENOENT): None,
    }
    for (kind, code), status in table.items():
        assert classify_error({"type": kind, "errno": code}) is status
