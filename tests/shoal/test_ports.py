"""Ports handed out for a later bind: outside the ephemeral range, never twice while reserved,
and never one that someone holds."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal import ports
from shoal.ports import PortError, free_port, unclaimed_ranges


@pytest.fixture(autouse=True)
def _private_reservations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test reserves in a folder of its own, so it neither sees nor blocks other tests'."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(ports.tempfile, "tempdir", None)


@given(st.text(max_size=80))
def test_any_range_text_gives_ports_a_server_may_bind(text: str) -> None:
    ranges = unclaimed_ranges(text)
    assert ranges
    assert all(r.start >= 1024 and r.stop <= 65536 and len(r) > 0 for r in ranges)


@given(st.integers(1, 65535), st.integers(1, 65535))
def test_the_ranges_never_overlap_the_ephemeral_one_when_room_is_left(a: int, b: int) -> None:
    low, high = sorted((a, b))
    ranges = unclaimed_ranges(f"{a}\t{b}\n")
    if ranges != [range(1024, 65536)]:
        assert all(p < low or p > high for r in ranges for p in (r.start, r.stop - 1))


def test_this_machines_ports_come_from_outside_its_ephemeral_range() -> None:
    low, high = map(int, ports.RANGE_FILE.read_text().split())
    for _ in range(50):
        port = free_port()
        assert not low <= port <= high or unclaimed_ranges(f"{low} {high}") == [range(1024, 65536)]


def test_no_port_is_handed_out_twice_across_processes() -> None:
    code = "from shoal.ports import free_port\nprint(*(free_port() for _ in range(100)))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    seen = [int(p) for proc in procs for p in proc.communicate()[0].split()]
    assert [proc.returncode for proc in procs] == [0] * 4
    assert len(seen) == 400
    assert len(set(seen)) == 400


def _unheld_port(*avoid: int) -> int:
    span = unclaimed_ranges(ports._read_range())[0]
    return next(
        p for p in range(span.start, span.stop)
        if p not in avoid and ports._bindable("127.0.0.1", p, False)
    )  # fmt: skip


def test_a_port_someone_holds_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", _unheld_port()))
        busy = held.getsockname()[1]
        spare = _unheld_port(busy)
        picks = iter([busy, busy, spare])
        monkeypatch.setattr(ports.random, "randrange", lambda start, stop: next(picks))
        assert free_port() == spare


def test_a_reservation_expires(monkeypatch: pytest.MonkeyPatch) -> None:
    port = _unheld_port()
    monkeypatch.setattr(ports.random, "randrange", lambda start, stop: port)
    first = free_port()
    with pytest.raises(PortError, match="no free TCP port"):
        free_port()
    folder = Path(ports.tempfile.gettempdir()) / f"shoal-ports-{os.getuid()}"
    old = ports.time.time() - ports.RESERVE_S - 1
    os.utime(folder / str(first), (old, old))
    assert free_port() == first


def test_a_reservation_folder_of_someone_else_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / f"shoal-ports-{os.getuid()}"
    folder.symlink_to(tmp_path)
    with pytest.raises(PortError, match="not a directory of yours"):
        free_port()


def test_udp_ports_are_reserved_too() -> None:
    port = free_port(udp=True)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", port))
