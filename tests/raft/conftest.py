"""Fixtures of the control-plane tests: one real in-process replica shared per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .inprocess import InProcessReplica


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessReplica]:
    rep = InProcessReplica(tmp_path_factory.mktemp("replica"))
    try:
        rep.start()
        yield rep
    finally:
        rep.close()
