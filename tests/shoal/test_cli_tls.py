"""`shoal tls init`: the directory `$SHOAL_TLS_DIR` names, made once, never overwritten."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from shoal.cli import main
from shoal.runtime.tls import TlsFiles


def test_init_writes_a_directory_the_transport_can_use(tmp_path: Path) -> None:
    directory = tmp_path / "tls"
    assert main(["tls", "init", str(directory), "--name", "10.0.0.1", "--name", "gpu01"]) == 0
    files = TlsFiles(directory)
    files.server_context()
    files.client_context()
    assert stat.S_IMODE((directory / "key.pem").stat().st_mode) == 0o600


def test_init_never_replaces_a_ca(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "tls"
    assert main(["tls", "init", str(directory)]) == 0
    before = (directory / "ca.pem").read_bytes()
    assert main(["tls", "init", str(directory)]) == 2
    assert "already holds a ca.pem" in capsys.readouterr().err
    assert (directory / "ca.pem").read_bytes() == before
