"""The admin API over HTTPS: a real coordinator process started with `$SHOAL_TLS_DIR` serves
only TLS, the client checks its certificate against the cluster CA, and a client trusting
another CA or speaking plain HTTP gets nowhere."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from shoal.ports import free_port
from shoal.raft.client import CoordinatorClient
from shoal.runtime.local_ca import make_local_ca
from shoal.runtime.tls import TLS_DIR_ENV
from tests.support.waiting import eventually

from .inprocess import SECRET, TOKEN

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def tls_replica(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A single replica serving its API over HTTPS; killed and reaped even if the test fails."""
    tls = make_local_ca(tmp_path / "tls")
    for name, text in (("token", TOKEN), ("secret", SECRET)):
        (tmp_path / name).write_text(text)
        os.chmod(tmp_path / name, 0o600)
    api = f"127.0.0.1:{free_port()}"
    argv = [
        sys.executable, "-m", "shoal", "coordinator", "--id", "c1",
        "--raft", f"127.0.0.1:{free_port()}", "--api", api,
        "--data-dir", str(tmp_path / "d"), "--token-file", str(tmp_path / "token"),
        "--secret-file", str(tmp_path / "secret"),
    ]  # fmt: skip
    log = (tmp_path / "c1.log").open("wb")
    proc = subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, TLS_DIR_ENV: str(tls.directory)},
    )
    try:
        yield api, tls.directory
    finally:
        proc.kill()
        proc.wait(timeout=30)
        log.close()


async def _leader(url: str) -> str | None:
    async with CoordinatorClient([url], TOKEN, timeout=5.0) as client:
        try:
            leader = (await client.cluster())["leader_id"]
        except Exception:  # not up yet: polled again
            return None
        return str(leader) if leader else None


def test_the_api_answers_over_https_checked_against_the_cluster_ca(
    tls_replica: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    api, tls_dir = tls_replica
    monkeypatch.setenv(TLS_DIR_ENV, str(tls_dir))
    leader = eventually(lambda: asyncio.run(_leader(f"https://{api}")), "an https answer")
    assert leader == "c1"


def test_plain_http_and_a_stranger_ca_get_nowhere(
    tls_replica: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api, tls_dir = tls_replica
    monkeypatch.setenv(TLS_DIR_ENV, str(tls_dir))
    eventually(lambda: asyncio.run(_leader(f"https://{api}")), "an https answer")

    async def plain() -> None:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.ClientError):
                await session.get(f"http://{api}/healthz")

    asyncio.run(plain())
    monkeypatch.setenv(TLS_DIR_ENV, str(make_local_ca(tmp_path / "stranger").directory))
    assert asyncio.run(_leader(f"https://{api}")) is None
    monkeypatch.setenv(TLS_DIR_ENV, str(tls_dir))
    eventually(lambda: asyncio.run(_leader(f"https://{api}")), "an https answer again")
    assert asyncio.run(_leader(f"https://{api}")) == "c1"
