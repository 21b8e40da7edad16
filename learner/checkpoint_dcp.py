"""Where shoal meets torch.distributed.checkpoint (DCP): what it refuses of DCP, and how it words
DCP's failures.

DCP would pickle anything that is not a tensor and unpickles its `.metadata` and any "bytes"
entry it finds, so a checkpoint written or changed by someone else could run code on load. The
classes here close those doors (tensors only in, metadata only from bytes the manifest vouches
for, no pickled objects out); checkpoint.py uses them for every save and load. DCP also wraps a
rank's failure in per-rank tracebacks; `reason` digs out the one line a user needs.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from shoal.learner.checkpoint_files import METADATA_FILE, read_metadata
from shoal.learner.errors import CheckpointError


def check_tensors(tree: object, where: str) -> None:
    """Only tensors (plain or DTensor) in nested dicts: DCP would pickle anything else, and
    loading a pickle is what checkpoints never do."""
    if isinstance(tree, torch.Tensor):
        return
    if not isinstance(tree, Mapping):
        raise CheckpointError(
            f"{where} is a {type(tree).__name__}: checkpoint tensors must be tensors in dicts "
            "(put numbers and strings in the trainer state)"
        )
    for key, value in tree.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{where} has key {key!r}: tensor dict keys must be strings")
        check_tensors(value, f"{where}[{key!r}]")


def causes(exc: BaseException) -> list[BaseException]:
    """`exc`, what DCP wrapped into it (per-rank failures) and its causes, breadth first."""
    found: list[BaseException] = []
    todo = [exc]
    while todo and len(found) < 32:
        item = todo.pop(0)
        found.append(item)
        if isinstance(item, CheckpointException):
            todo.extend(failure for failure, _ in item.failures.values())
        for nested in (item.__cause__, item.__context__):
            if nested is not None:
                todo.append(nested)
    return found


def reason(exc: BaseException) -> str:
    """A one-line cause: the innermost meaningful failure, not DCP's per-rank tracebacks."""
    for item in causes(exc):
        if not isinstance(item, CheckpointException):
            return f"{type(item).__name__}: {item}".splitlines()[0][:400]
    return type(exc).__name__


class VerifiedReader(dcp.FileSystemReader):
    """DCP's file reader, except that `.metadata` is unpickled only from bytes that match the
    manifest, and only DCP's own metadata classes; its storage entries may name only files the
    manifest lists."""

    def __init__(self, path: Path, metadata_sha256: str, names: frozenset[str]) -> None:
        super().__init__(path)
        self._metadata_sha256 = metadata_sha256
        self._names = names
        self.refused: CheckpointError | None = None
        """Why the metadata was refused (DCP turns the exception into text)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        try:
            metadata = read_metadata(Path(self.path) / METADATA_FILE, self._metadata_sha256)
            for info in (getattr(metadata, "storage_data", None) or {}).values():
                if getattr(info, "relative_path", None) not in self._names:
                    raise CheckpointError(
                        f"{self.path}'s metadata points at a file its manifest does not list"
                    )
        except CheckpointError as exc:
            self.refused = exc
            raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's planner, refusing a pickled object (DCP loads those with weights_only=False)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"the checkpoint stores {read_item.dest_index.fqn} as a pickled object, not a "
            "tensor: refused; it was not written by this shoal"
        )
