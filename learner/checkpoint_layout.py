"""The names in a checkpoint directory and the only code that deletes from it.

`ckpt-<step>/` (format 2, a DCP directory), `ckpt-<step>.pt` (format 1), the manifest
`ckpt-<step>.json` that makes either complete, and `.ckpt-<step>.<nonce>.partial` staging
directories. Finding (checkpoint.py) and writing (checkpoint_write.py) both go by these names, so
they live here once; removal is here too because its order (manifest first) is what keeps a
half-deleted checkpoint from ever looking complete.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

MANIFEST = re.compile(r"^ckpt-(\d{12})\.json$")
DATA = re.compile(r"^ckpt-(\d{12})\.pt$")
DIR = re.compile(r"^ckpt-(\d{12})$")
STALE = re.compile(r"^\.ckpt-\d{12}\..*(\.tmp|\.partial)$")


def dir_name(step: int) -> str:
    return f"ckpt-{step:012d}"


def manifest_name(step: int) -> str:
    return f"ckpt-{step:012d}.json"


def partial_name(step: int, nonce: str) -> str:
    """The staging directory of one save, renamed to `dir_name(step)` once every rank wrote."""
    return f".ckpt-{step:012d}.{nonce}.partial"


def remove_tree(path: Path) -> None:
    """Delete a checkpoint directory (a symlink is unlinked, never followed)."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def manifest_steps(directory: Path) -> list[int]:
    """The steps that have a manifest (complete unless a file no longer matches it)."""
    return [int(m.group(1)) for p in directory.iterdir() if (m := MANIFEST.match(p.name))]


def prune(directory: Path, keep: int, newest: int, spare: int | None = None) -> None:
    """Drop checkpoints beyond `keep` except `spare` (the best, checkpoint_best.py), staging
    leftovers of crashed writers and orphans older than `newest` (writer thread, rank 0 only:
    a manager opened just to read must never delete what the owning writer is filling)."""
    steps = sorted(manifest_steps(directory), reverse=True)
    for old in steps[keep:]:
        if old != spare:
            remove(directory, old)
    kept = {*steps[:keep], spare}
    for entry in directory.iterdir():
        orphan = DIR.match(entry.name) or DATA.match(entry.name)
        if STALE.match(entry.name) or (
            orphan and int(orphan.group(1)) < newest and int(orphan.group(1)) not in kept
        ):
            remove_tree(entry)


def remove(directory: Path, step: int) -> None:
    """Manifest first: from then on the step is incomplete, whatever is left of it."""
    (directory / manifest_name(step)).unlink(missing_ok=True)
    remove_tree(directory / dir_name(step))
    (directory / f"{dir_name(step)}.pt").unlink(missing_ok=True)
