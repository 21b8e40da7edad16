"""The verdict is a pure function of the server's facts: whatever the child wrote, it is bounded."""

from __future__ import annotations

import errno
import json
import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.envs.errors import SandboxError
from shoal.envs.sandbox_channel import ErrorInfo
from shoal.envs.sandbox_verdict import Facts, Status, TestCase, classify_error, judge

NO_DEADLINE = settings(deadline=None)  # no wall-clock bound: the machine may be loaded
RUN = b'{"phase": "run"}\n'

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=6,
)
error_infos = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["ValueError", "MemoryError", "OSError", "SyntaxError"]),
        "errno": st.none() | st.sampled_from([errno.EFBIG, errno.EAGAIN, errno.EACCES]),
        "message": st.text(max_size=5),
    }
)
records = st.one_of(
    st.fixed_dictionaries(
        {"event": st.just("test"), "index": st.integers(-2, 6), "value": json_values}
    ),
    st.fixed_dictionaries(
        {"event": st.just("test"), "index": st.integers(0, 6), "error": error_infos}
    ),
    st.fixed_dictionaries({"event": st.just("error"), "error": error_infos}),
    st.just({"event": "done"}),
    st.dictionaries(st.text(max_size=3), json_values, max_size=2),
)
controls = st.one_of(
    st.just(RUN),
    st.just(b""),
    st.builds(
        lambda phase, error: _line({"phase": phase, "error": error}),
        st.sampled_from(["setup", "compile"]),
        error_infos,
    ),
    st.binary(max_size=20),
)
tests = st.lists(st.builds(TestCase, st.text(max_size=5), json_values), max_size=6)


def _line(record: object) -> bytes:
    return json.dumps(record).encode() + b"\n"


def _facts(events: bytes = b"", control: bytes = RUN, **changes: object) -> Facts:
    wire = {
        "control": control.decode("latin-1"),
        "events": events.decode("latin-1"),
        "events_overflow": False,
        "stdout": "",
        "stderr": "",
        "output_dropped": 0,
        "timed_out": False,
        "exit_code": 0,
        "signal": None,
        "duration_s": 0.01,
        **changes,
    }
    return Facts.from_wire(wire)


@NO_DEADLINE
@given(
    st.lists(records, max_size=10),
    st.binary(max_size=20),
    controls,
    st.booleans(),
    st.booleans(),
    st.none() | st.sampled_from([int(s) for s in (signal.SIGSEGV, signal.SIGXCPU, signal.SIGKILL)]),
    tests,
)
def test_reward_is_a_fraction_and_zero_unless_ok(
    written, garbage, control, timed_out, overflow, signum, cases
):
    events = b"".join(_line(r) for r in written) + garbage
    facts = _facts(events, control, timed_out=timed_out, events_overflow=overflow, signal=signum)
    result = judge(facts, cases)
    assert 0.0 <= result.reward <= 1.0
    assert 0 <= result.passed <= result.total == len(cases)
    assert len(result.tests) == len(cases)
    assert result.message
    if result.status is not Status.OK:
        assert result.reward == 0.0
    if timed_out or overflow or signum is not None or control != RUN:
        assert result.status is not Status.OK


@NO_DEADLINE
@given(st.lists(json_values, min_size=1, max_size=6))
def test_matching_values_and_done_earn_full_reward(values):
    cases = [TestCase(f"t{i}", v) for i, v in enumerate(values)]
    reported = [{"event": "test", "index": i, "value": v} for i, v in enumerate(values)]
    events = b"".join(_line(r) for r in [*reported, {"event": "done"}])
    result = judge(_facts(events), cases)
    assert result.status is Status.OK
    assert result.reward == 1.0


def test_a_missing_done_means_the_code_left_early():
    result = judge(_facts(b""), [TestCase("f()", 1)])
    assert result.status is Status.EXITED
    assert result.tests[0].error == "not run"


def test_a_tuple_result_matches_a_list_and_int_matches_float():
    cases = [TestCase("a", (1, 2)), TestCase("b", 2.0)]
    events = [
        {"event": "test", "index": 0, "value": [1, 2]},
        {"event": "test", "index": 1, "value": 2},
        {"event": "done"},
    ]
    assert judge(_facts(b"".join(map(_line, events))), cases).reward == 1.0


def test_only_the_control_channel_says_setup_failed_or_the_source_does_not_compile():
    error = {"type": "SyntaxError", "errno": None, "message": "invalid syntax"}
    compiled = judge(_facts(control=_line({"phase": "compile", "error": error})), [])
    assert (compiled.status, compiled.message) == (
        Status.SYNTAX_ERROR,
        "SyntaxError: invalid syntax",
    )
    setup = judge(_facts(control=_line({"phase": "setup", "error": error})), [])
    assert setup.status is Status.SANDBOX_ERROR
    assert "could not confine" in setup.message
    forged = judge(_facts(_line({"event": "error", "phase": "setup", **error})), [])
    assert forged.status is Status.CHANNEL_VIOLATION
    silent = judge(_facts(control=b"", exit_code=70), [])
    assert silent.status is Status.SANDBOX_ERROR
    assert "before it was confined" in silent.message


def test_what_the_server_saw_comes_before_what_the_program_wrote():
    garbage = b"\xff not json\n"
    assert judge(_facts(garbage, timed_out=True), []).status is Status.TIMEOUT
    assert judge(_facts(garbage, signal=int(signal.SIGXCPU)), []).status is Status.CPU_LIMIT
    assert judge(_facts(garbage, events_overflow=True), []).status is Status.OUTPUT_LIMIT
    violated = judge(_facts(garbage), [TestCase("f()", 1)])
    assert violated.status is Status.CHANNEL_VIOLATION
    assert "byte 0 is not ASCII" in violated.message
    assert violated.tests[0].error.startswith("not judged: ")


def test_a_line_cut_short_by_a_kill_is_not_held_against_the_program():
    events = _line({"event": "test", "index": 0, "value": 1}) + b'{"event": "te'
    killed = judge(_facts(events, signal=int(signal.SIGXCPU)), [TestCase("f()", 1)] * 2)
    assert killed.status is Status.CPU_LIMIT
    assert killed.tests[0].passed
    exited = judge(_facts(events), [TestCase("f()", 1)] * 2)
    assert exited.status is Status.CHANNEL_VIOLATION
    assert "no newline" in exited.message


GOOD_WIRE = {
    "control": "",
    "events": "",
    "events_overflow": False,
    "stdout": "",
    "stderr": "",
    "output_dropped": 0,
    "timed_out": False,
    "exit_code": 0,
    "signal": None,
    "duration_s": 0.0,
}
MALFORMED_WIRE = {
    "not an object": [],
    "a missing key": {k: v for k, v in GOOD_WIRE.items() if k != "control"},
    "an unknown key": {**GOOD_WIRE, "extra": 1},
    "events of the wrong type": {**GOOD_WIRE, "events": 1},
    "events that are not bytes": {**GOOD_WIRE, "events": "\u0100"},
    "a bool for a number": {**GOOD_WIRE, "exit_code": True},
    "a duration that is not a number": {**GOOD_WIRE, "duration_s": float("nan")},
    "a negative count": {**GOOD_WIRE, "output_dropped": -1},
}


@pytest.mark.parametrize("case", sorted(MALFORMED_WIRE))
def test_malformed_facts_mean_a_broken_server(case):
    with pytest.raises(SandboxError, match="malformed facts from the sandbox server"):
        Facts.from_wire(MALFORMED_WIRE[case])


@NO_DEADLINE
@given(st.dictionaries(st.sampled_from(["control", "events", "signal", "x"]), json_values))
def test_any_facts_are_checked_or_refused(raw):
    try:
        Facts.from_wire(raw)
    except SandboxError:
        pass


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
        assert classify_error(ErrorInfo(kind, code, "")) is status
