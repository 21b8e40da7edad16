"""Progress on long work: `shoal bench` and `shoal chaos run` draw a bar on stderr only when it is
a terminal (a real pty here) and never with --json, whose stdout stays one clean JSON document.
The bench suite is `precision`, the quickest that runs long enough (seconds) for the bar to be
redrawn; every suite goes through the same `shoal bench` code."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from shoal.progress import ProgressLine, Ticker

pytestmark = pytest.mark.timeout(180)

TINY_SCENARIO = """
name = "tiny"
replicas = 1
duration_s = 2
clients = 1
keys = 1
recover_within_s = 5
invariants = ["linearizable", "digests_equal"]
"""


def _drain(fd: int, into: bytearray) -> None:
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO once the child closed its end of the pty
            return
        if not chunk:
            return
        into.extend(chunk)


def _shoal(argv: list[str], stderr_tty: bool, cwd: Path) -> tuple[int, str, str]:
    """Run `python -m shoal ARGV` with stderr on a real pty (or a pipe); (rc, stdout, stderr)."""
    command = [sys.executable, "-m", "shoal", *argv]
    if not stderr_tty:
        done = subprocess.run(command, capture_output=True, text=True, timeout=150, cwd=cwd)
        return done.returncode, done.stdout, done.stderr
    master, slave = os.openpty()
    err = bytearray()
    reader = threading.Thread(target=_drain, args=(master, err), daemon=True)
    try:
        with subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, cwd=cwd
        ) as proc:
            os.close(slave)
            slave = -1
            reader.start()
            try:
                out, _ = proc.communicate(timeout=150)
            finally:
                if proc.poll() is None:
                    proc.kill()
        reader.join(timeout=10)
    finally:
        if slave != -1:
            os.close(slave)
        os.close(master)
    return proc.returncode, out.decode(), err.decode(errors="replace")


@pytest.mark.parametrize(
    ("argv", "drawn"),
    [
        (["bench", "precision", "--quick"], "shoal bench precision:"),
        (["chaos", "run", "{scenario}"], "chaos tiny "),
    ],
)
def test_a_terminal_gets_a_progress_line_and_json_stays_clean(
    tmp_path: Path, argv: list[str], drawn: str
) -> None:
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(TINY_SCENARIO)
    argv = [a.replace("{scenario}", str(scenario)) for a in argv]

    rc, out, err = _shoal(argv, stderr_tty=True, cwd=tmp_path)
    assert rc == 0, err
    assert drawn in err
    assert "\r" in err  # redrawn in place

    rc, out, err = _shoal([*argv, "--json"], stderr_tty=True, cwd=tmp_path)
    assert rc == 0, err
    assert drawn not in err
    json.loads(out, parse_constant=pytest.fail)


def test_a_pipe_gets_no_progress_line(tmp_path: Path) -> None:
    rc, out, err = _shoal(["bench", "precision", "--quick"], stderr_tty=False, cwd=tmp_path)
    assert rc == 0, err
    assert "shoal bench precision:" not in err
    assert "shoal bench precision" in out


class Terminal(io.StringIO):
    """A text stream that says it is a terminal, to see exactly what a bar writes to one."""

    def isatty(self) -> bool:
        return True


def test_a_line_without_a_fraction_has_no_bar_and_a_shorter_redraw_is_padded() -> None:
    stream = Terminal()
    line = ProgressLine(stream)
    line.update("working 10 s", None)
    line.update("done", 0.5)
    line.update("ok", None)
    assert stream.getvalue() == "\rworking 10 s\r[##########----------] done\rok" + " " * 25


def test_the_ticker_redraws_with_the_latest_note_and_ends_the_line() -> None:
    stream = Terminal()
    seen = threading.Event()

    def render(elapsed: float, message: str) -> tuple[str, float | None]:
        if message == "phase 2":
            seen.set()
        return f"{message or 'start'}", None

    with Ticker(ProgressLine(stream), render, every_s=0.01) as ticker:
        ticker.note("phase 2")
        assert seen.wait(timeout=10)
    text = stream.getvalue()
    assert "phase 2" in text
    assert text.endswith("\n")


def test_a_disabled_ticker_starts_no_thread_and_writes_nothing() -> None:
    stream = Terminal()
    with Ticker(ProgressLine(stream, enabled=False), lambda t, m: (m, None)) as ticker:
        ticker.note("hidden")
        assert not any(t.name == "progress" for t in threading.enumerate())
    assert stream.getvalue() == ""


def test_chaos_soak_json_is_one_report_per_line_and_nothing_else(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(TINY_SCENARIO)
    argv = ["chaos", "soak", "--hours", "0.0003", "--scenario", str(scenario), "--json"]
    rc, out, err = _shoal(argv, stderr_tty=False, cwd=tmp_path)
    assert rc == 0, err
    reports = [json.loads(line, parse_constant=pytest.fail) for line in out.splitlines()]
    assert reports
    assert all(r["scenario"] == "tiny" for r in reports)
    assert "every invariant held" in err
