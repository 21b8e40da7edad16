"""What a checkpoint's manifest says and the checks that make its files safe to read.

Everything here reads bytes that came from storage, which another process, a crash or a person
may have changed: manifests are bounded in size and nesting depth before they are parsed, their
file tables name only plain files directly inside the checkpoint directory, and a file is
hashed before anything parses it. DCP's `.metadata` is a pickle, so it is unpickled only from
bytes whose sha256 matched the manifest, and then only into the few classes DCP's metadata is
made of (`read_metadata`).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import io
import json
import math
import os
import pickle
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shoal import boundedjson
from shoal.learner.errors import CheckpointError

FORMAT = 2
LEGACY_FORMAT = 1
MAX_MANIFEST_BYTES = 4 << 20
MAX_MANIFEST_DEPTH = 4
"""{"files": [{...}]} is three levels deep; nothing legitimate nests further."""
MAX_FILES = 16384
"""Enough for 16k ranks; a table this long is ~1.6 MB, within MAX_MANIFEST_BYTES."""
MAX_META_KEYS = 64
MAX_TRAINER_BYTES = 256 << 20
MAX_TRAINER_DEPTH = 32
MAX_METADATA_BYTES = 1 << 30
TRAINER_FILE = "trainer.json"
METADATA_FILE = ".metadata"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$|^\.metadata$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
MetaValue = str | int | float | bool


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: its name inside the checkpoint directory, size and sha256."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """A parsed, shape-checked manifest (format 2: `files`; format 1: the single `file`)."""

    format: int
    step: int
    created_unix: float
    meta: dict[str, MetaValue]
    files: tuple[FileEntry, ...] = ()
    sha256: str = ""
    """Format 2: the digest of the file table; format 1: the data file's sha256."""
    file: str = ""
    size: int = 0
    world_size: int = 1


def table_digest(files: tuple[FileEntry, ...] | list[FileEntry]) -> str:
    """The sha256 that names a checkpoint: of its file table, canonical and sorted by path."""
    rows = sorted([f.path, f.size, f.sha256] for f in files)
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def parse_manifest(data: bytes, step: int) -> Manifest:
    """The manifest of checkpoint `step` from its bytes; CheckpointError on anything else."""
    try:
        raw = boundedjson.loads(data, max_bytes=MAX_MANIFEST_BYTES, max_depth=MAX_MANIFEST_DEPTH)
    except boundedjson.JsonRefused as exc:
        raise CheckpointError(f"manifest refused: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointError("manifest is not a JSON object")
    fmt = raw.get("format")
    if raw.get("step") != step or isinstance(raw.get("step"), bool):
        raise CheckpointError(f"manifest names step {raw.get('step')!r}, its file name {step}")
    created = _number(raw.get("created_unix"), "created_unix")
    meta = _meta(raw.get("meta", {}))
    if fmt == LEGACY_FORMAT:
        name = raw.get("file")
        if name != f"ckpt-{step:012d}.pt":
            raise CheckpointError(f"format 1 manifest names file {name!r}, not this step's .pt")
        return Manifest(
            format=LEGACY_FORMAT,
            file=name,
            sha256=_sha256(raw.get("sha256"), "sha256"),
            size=_count(raw.get("size"), "size"),
            step=step,
            created_unix=created,
            meta=meta,
        )
    if fmt != FORMAT or isinstance(fmt, bool):
        raise CheckpointError(
            f"manifest format {fmt!r} is not one this shoal reads (1 or 2); "
            "use the shoal version that wrote it"
        )
    files = _files(raw.get("files"))
    digest = _sha256(raw.get("sha256"), "sha256")
    if digest != table_digest(files):
        raise CheckpointError("manifest's sha256 does not match its own file table: tampered")
    return Manifest(
        format=FORMAT,
        files=files,
        sha256=digest,
        size=sum(f.size for f in files),
        world_size=_count(raw.get("world_size", 1), "world_size"),
        step=step,
        created_unix=created,
        meta=meta,
    )


def manifest_json(manifest: Manifest) -> bytes:
    """The bytes of a format-2 manifest (what `parse_manifest` reads back)."""
    body = {
        "format": FORMAT,
        "step": manifest.step,
        "files": [dataclasses.asdict(f) for f in sorted(manifest.files, key=lambda f: f.path)],
        "sha256": manifest.sha256,
        "size": manifest.size,
        "world_size": manifest.world_size,
        "created_unix": manifest.created_unix,
        "meta": manifest.meta,
    }
    return json.dumps(body, indent=1).encode()


def _files(value: object) -> tuple[FileEntry, ...]:
    if not isinstance(value, list) or not value:
        raise CheckpointError("manifest has no file table")
    if len(value) > MAX_FILES:
        raise CheckpointError(f"manifest lists {len(value)} files, more than {MAX_FILES}")
    entries = []
    for row in value:
        if not isinstance(row, dict) or set(row) != {"path", "size", "sha256"}:
            raise CheckpointError("manifest file entry is not {path, size, sha256}")
        entries.append(
            FileEntry(
                check_name(row["path"]),
                _count(row["size"], "size"),
                _sha256(row["sha256"], "file sha256"),
            )
        )
    names = [e.path for e in entries]
    if len(set(names)) != len(names):
        raise CheckpointError("manifest lists a file twice")
    for needed in (METADATA_FILE, TRAINER_FILE):
        if needed not in names:
            raise CheckpointError(f"manifest does not list {needed}")
    return tuple(entries)


def check_name(value: object) -> str:
    """A file name directly inside the checkpoint directory: no '/', no '..', not absolute."""
    if not isinstance(value, str) or not _NAME.match(value) or value in (".", ".."):
        shown = repr(value)[:80]
        raise CheckpointError(
            f"manifest names file {shown}: only plain names inside the checkpoint directory "
            "are allowed"
        )
    return value


def _meta(value: object) -> dict[str, MetaValue]:
    if not isinstance(value, dict) or len(value) > MAX_META_KEYS:
        raise CheckpointError(f"manifest meta must be an object of at most {MAX_META_KEYS} keys")
    for key, item in value.items():
        if not isinstance(item, str | int | float | bool):
            raise CheckpointError(f"manifest meta {key[:40]!r} is not a string, number or bool")
    return dict(value)


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CheckpointError(f"manifest {what} is not a number")
    return float(value)


def _count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"manifest {what} is not an integer >= 0")
    return value


def _sha256(value: object, what: str) -> str:
    if not isinstance(value, str) or not _SHA256.match(value):
        raise CheckpointError(f"manifest {what} is not a sha256 hex digest")
    return value


# -- files on disk ---------------------------------------------------------------------------


def read_bounded(path: Path, limit: int) -> bytes:
    """A regular file's bytes (not through a symlink), refused when larger than `limit`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise CheckpointError(f"{path} is not a regular file")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{path} is larger than the {limit} bytes a checkpoint allows")
    return data


def plain_directory(path: Path) -> None:
    """Refuse a checkpoint directory that is missing, a symlink or not a directory."""
    try:
        mode = os.lstat(path).st_mode
    except OSError as exc:
        raise CheckpointError(f"checkpoint directory {path} is missing ({exc.strerror})") from exc
    if not stat.S_ISDIR(mode):
        raise CheckpointError(f"{path} is not a plain directory (a symlink or a file)")


def file_sha256(path: Path) -> str:
    """The sha256 of a regular file, never through a symlink."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from exc
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise CheckpointError(f"{path} is not a regular file")
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def parse_trainer(data: bytes, where: Path) -> dict[str, Any]:
    """The JSON trainer state, bounded in size and depth."""
    try:
        value = boundedjson.loads(data, max_bytes=MAX_TRAINER_BYTES, max_depth=MAX_TRAINER_DEPTH)
    except boundedjson.JsonRefused as exc:
        raise CheckpointError(f"{where} refused: {exc}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{where} is not a JSON object")
    return value


# -- DCP's pickled metadata --------------------------------------------------------------------

_DCP = "torch.distributed.checkpoint."
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata dataclasses and enums, torch sizes, dtypes and layouts."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module.startswith(_DCP):
            found = super().find_class(module, name)
            if isinstance(found, type) and (
                dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)
            ):
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata")


def read_metadata(path: Path, expected_sha256: str) -> Any:
    """DCP's `.metadata` at `path`, unpickled only if its bytes match `expected_sha256`."""
    data = read_bounded(path, MAX_METADATA_BYTES)
    if hashlib.sha256(data).hexdigest() != expected_sha256:
        raise CheckpointError(
            f"{path} does not match its manifest's sha256: the checkpoint is corrupt; "
            "use latest() to find the newest intact one"
        )
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # any unpickling failure of verified-but-foreign bytes
        raise CheckpointError(f"{path} is not DCP metadata: {exc}") from exc


def meta_dict(meta: Mapping[str, Any] | None) -> dict[str, MetaValue]:
    """`meta` checked before it is written (the rules it is read with, and finite numbers)."""
    checked = _meta(dict(meta or {}))
    for key, item in checked.items():
        if not isinstance(key, str) or (isinstance(item, float) and not math.isfinite(item)):
            raise CheckpointError(
                f"checkpoint meta {key!r} = {item!r}: use str keys, finite numbers"
            )
    return checked
