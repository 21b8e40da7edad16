"""`shoal node --stream-port`: the node daemon's transport takes its frame streams on the port
given (seen in the kernel's socket table as the daemon's own listening socket); a bad or taken
port is one line and exit 2."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from shoal.chaos.sockets import holds_socket, listening_inode, tcp_table
from shoal.ports import free_port
from tests.shoal.test_node_daemon import node_argv, node_env, run_node, wait_for_lines
from tests.support.processes import logged_process

pytestmark = pytest.mark.timeout(120)


def test_the_node_listens_for_frame_streams_on_the_port_given(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "node.log"
    argv = node_argv(tmp_path / "data", "--stream-port", str(port))
    with logged_process(argv, log, node_env()) as process:
        wait_for_lines(log, r"cannot register node", 1)
        inode = listening_inode(("127.0.0.1", port), tcp_table())
        assert inode is not None
        assert holds_socket(process.pid, inode)


@pytest.mark.parametrize("value", ["-1", "70000"])
def test_a_bad_stream_port_is_one_line(tmp_path: Path, value: str) -> None:
    done = run_node(tmp_path / "data", "--stream-port", value)
    assert done.returncode == 2
    assert f"--stream-port={value} is invalid" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_taken_stream_port_is_refused(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_node(tmp_path / "data", "--stream-port", str(port))
    assert done.returncode == 2
    assert f"--stream-port={port} cannot be bound" in done.stderr
