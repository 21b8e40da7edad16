"""Programs that attack the result channel, run for real: each fails its episode with a reason.

The episode's program shares its process with the harness, so it can write to the result
channel (fd 3) whatever it likes. Each case below is a real program in the real sandbox; the
episode must fail with a reason, and the same server must then serve an honest program.
"""

from __future__ import annotations

import pytest

from shoal.envs.sandbox import Limits, SandboxPool, Status, TestCase
from tests.envs.sandbox_cases import GOOD, SQUARE

LIMITS = Limits(
    cpu_s=2, memory_mb=256, file_size_mb=1, disk_mb=4, open_files=16, processes=8, timeout_s=20.0
)
ERROR = '{"type": "OSError", "errno": null, "message": ""}'


@pytest.fixture(scope="module")
def pool():
    """One server, so 'the next program works' is asked of the very server the attack hit."""
    with SandboxPool(workers=1, limits=LIMITS) as p:
        yield p


def _writes(payload: str) -> str:
    """A program that writes the bytes `payload` evaluates to on fd 3, then solves the task."""
    return f"import os\ndata = {payload}\nwhile data:\n    data = data[os.write(3, data):]\n" + GOOD


def _line(record: str) -> str:
    return repr(record.encode() + b"\n")


VIOLATION = Status.CHANNEL_VIOLATION
ATTACKS = {
    "a string for the error": (
        _line('{"event": "test", "index": 0, "error": "boom"}'),
        VIOLATION,
        "the error is not one the harness writes",
    ),
    "a 200,000-deep array": ("b'[' * 200000 + b'\\n'", VIOLATION, "200000 commas and brackets"),
    "a 60,000-deep array": ("b'[' * 60000 + b'\\n'", VIOLATION, "nests deeper than 33 levels"),
    "a 60,000-deep object in a record": (
        'b\'{"event": "test", "index": 0, "value": \' + b\'{"a": \' * 60000 + b\'\\n\'',
        VIOLATION,
        "nests deeper than 33 levels",
    ),
    "an int for the event": (_line('{"event": 7}'), VIOLATION, "not a record the harness writes"),
    "a string for the index": (
        _line('{"event": "test", "index": "0", "value": 4}'),
        VIOLATION,
        'reports test "0"',
    ),
    "a bool for the index": (
        _line('{"event": "test", "index": true, "value": 4}'),
        VIOLATION,
        "reports test true",
    ),
    "an int for the error's type": (
        _line('{"event": "test", "index": 0, "error": {"type": 1, "errno": null, "message": ""}}'),
        VIOLATION,
        "type and message must be text",
    ),
    "a string for the errno": (
        _line(
            '{"event": "test", "index": 0, "error": {"type": "E", "errno": "28", "message": ""}}'
        ),
        VIOLATION,
        'errno "28" is not an errno',
    ),
    "a list for the message": (
        _line('{"event": "error", "error": {"type": "E", "errno": null, "message": ["m"]}}'),
        VIOLATION,
        "type and message must be text",
    ),
    "null for the module's error": (
        _line('{"event": "error", "error": null}'),
        VIOLATION,
        "the error is not one the harness writes",
    ),
    "a done with a verdict of its own": (
        _line('{"event": "done", "passed": true}'),
        VIOLATION,
        "not a record the harness writes",
    ),
    "a 2 MiB line": ("b'\"' + b'x' * (2 << 20) + b'\"\\n'", VIOLATION, "more than the limit"),
    "100,000 empty lines": ("b'\\n' * 100000", VIOLATION, "line 1 is not JSON"),
    "5 MiB, past the channel's size": (
        "b'x' * (5 << 20)",
        Status.OUTPUT_LIMIT,
        "result channel's size limit",
    ),
    "invalid UTF-8": ('b\'\\xff\\xfe{"event": "done"}\\n\'', VIOLATION, "byte 0 is not ASCII"),
    "NaN": (
        _line('{"event": "test", "index": 0, "value": NaN}'),
        VIOLATION,
        "NaN is not a finite number",
    ),
    "Infinity": (
        _line('{"event": "test", "index": 0, "value": -Infinity}'),
        VIOLATION,
        "-Infinity is not a finite number",
    ),
    "a float that overflows": (
        _line('{"event": "test", "index": 0, "value": 1e999}'),
        VIOLATION,
        "a number too large for a float",
    ),
    "an integer of 100,000 digits": (
        'b\'{"event": "test", "index": 0, "value": \' + b\'9\' * 100000 + b\'}\\n\'',
        VIOLATION,
        "a number of more than 4300 digits",
    ),
    "a forged pass before the harness's own": (
        _line('{"event": "test", "index": 0, "value": 4}'),
        VIOLATION,
        "line 2 reports test 0, but the harness's next record is test 1",
    ),
    "a forged setup failure (old format)": (
        _line('{"event": "error", "phase": "setup", "type": "OSError", "errno": 1, "message": ""}'),
        VIOLATION,
        "not a record the harness writes",
    ),
    "a forged control record": (
        _line(f'{{"phase": "compile", "error": {ERROR}}}'),
        VIOLATION,
        "not a record the harness writes",
    ),
    "a done before the tests": (
        _line('{"event": "done"}'),
        VIOLATION,
        "says done after 0 of 2 tests",
    ),
    "a whole verdict, then the harness's": (
        _line('{"event": "test", "index": 0, "value": 4}')
        + "+"
        + _line('{"event": "test", "index": 1, "value": 9}')
        + "+"
        + _line('{"event": "done"}'),
        VIOLATION,
        "line 4 comes after the harness's last record",
    ),
    "a line without its newline": ('b\'{"event": "te\'', VIOLATION, "line 1 is not JSON"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(ATTACKS))
def test_a_program_writing_to_the_result_channel_fails_its_episode(pool, case):
    payload, status, needle = ATTACKS[case]
    result = pool.run(_writes(payload), SQUARE)
    assert result.status is status, result.message
    assert needle in result.message
    assert result.reward == 0.0
    assert result.passed == 0
    assert pool.run(GOOD, SQUARE).reward == 1.0


@pytest.mark.timeout(120)
def test_output_after_the_verdict_from_a_test_call_fails_the_episode(pool):
    source = 'import os\ndef f(x):\n    os.write(3, b\'{"event": "done"}\\n\')\n    return x * x\n'
    result = pool.run(source, SQUARE)
    assert result.status is Status.CHANNEL_VIOLATION
    assert "says done after 0 of 2 tests" in result.message
    assert pool.run(GOOD, SQUARE).reward == 1.0


@pytest.mark.timeout(120)
def test_the_control_channel_is_closed_before_the_program_runs(pool):
    probe = (
        "import os\n"
        "try:\n"
        "    os.fstat(4)\n"
        "    state = 'open'\n"
        "except OSError:\n"
        "    state = 'closed'\n"
        "def f():\n"
        "    return state\n"
    )
    assert pool.run(probe, [TestCase("f()", "closed")]).reward == 1.0
    record = '{"phase": "setup", "error": ' + ERROR + "}"
    forged = "import os\nos.write(4, " + _line(record) + ")\n"
    result = pool.run(forged, SQUARE)
    assert result.status is Status.RUNTIME_ERROR
    assert "Bad file descriptor" in result.message


@pytest.mark.timeout(120)
def test_odd_values_and_exceptions_fail_their_test_not_the_episode(pool):
    source = (
        "class Loud(Exception):\n"
        "    errno = 'not a number'\n"
        "    def __str__(self):\n"
        "        raise RuntimeError('no message for you')\n"
        "class Opaque:\n"
        "    def __repr__(self):\n"
        "        raise RuntimeError('no repr for you')\n"
        "def deep():\n"
        "    value = []\n"
        "    for _ in range(5000):\n"
        "        value = [value]\n"
        "    return value\n"
        "def loud():\n"
        "    raise Loud()\n"
    )
    cases = [
        TestCase("float('nan')", 0),
        TestCase("deep()", []),
        TestCase("10 ** 5000", 0),
        TestCase("Opaque()", 0),
        TestCase("loud()", 0),
        TestCase("'\\ud800'", 0),
        TestCase("'x' * (2 << 20)", 0),
        TestCase("1 + 1", 2),
    ]
    result = pool.run(source, cases)
    assert result.status is Status.OK, result.message
    assert result.passed == 1
    assert [t.actual for t in result.tests[:4]] == [
        {"__repr__": "nan"},
        {"__repr__": "<list that could not be shown>"},
        {"__repr__": "<int that could not be shown>"},
        {"__repr__": "<Opaque that could not be shown>"},
    ]
    assert result.tests[4].error == "Loud: <the exception's message could not be shown>"


@pytest.mark.timeout(120)
def test_an_attack_in_a_batch_costs_only_its_own_episode(pool):
    attack = _writes(_line('{"event": "test", "index": 0, "error": "boom"}'))
    deep = _writes("b'[' * 200000 + b'\\n'")
    results = pool.run_many([(GOOD, SQUARE), (attack, SQUARE), (deep, SQUARE), (GOOD, SQUARE)])
    assert [r.status for r in results] == [Status.OK, VIOLATION, VIOLATION, Status.OK]
    assert [r.reward for r in results] == [1.0, 0.0, 0.0, 1.0]
