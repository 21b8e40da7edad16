"""What chaos needs of a cluster of processes, as a Protocol: `shoal.local.LocalCluster` is the
implementation, handed in from above (chaos sits below shoal/ and never imports it)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol


class ProcessSpec(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def api_url(self) -> str | None: ...

    @property
    def raft(self) -> str | None: ...


class Cluster(Protocol):
    """Blocking methods over a run directory's processes; failures raise a ShoalError."""

    @property
    def run_dir(self) -> Path: ...

    @property
    def token(self) -> str: ...

    def specs(self) -> Sequence[ProcessSpec]: ...

    def spec(self, name: str) -> ProcessSpec: ...

    def pid(self, name: str) -> int | None: ...

    def start(self, name: str) -> int: ...

    def start_all(self) -> None: ...

    def kill(self, name: str) -> None: ...

    def stop_all(self) -> list[str]: ...

    def wait_ready(self, names: list[str] | None = None, timeout: float = 30.0) -> str: ...

    def get(self, url: str, timeout: float = 2.0) -> Any: ...
