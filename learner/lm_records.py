"""A pipeline run directory read back as hostile input: pipeline.json and the outputs it lists.

`shoal train --pipeline ... --from-stage N` reuses what RUN holds, and anyone who can edit RUN
can also rewrite the sha256s pipeline.json records, so a matching hash proves nothing about a
file's shape. Every file is therefore opened without blocking (a FIFO is refused, never waited
on) and must be a regular file; a file read whole is bounded in size first
(`shoal.files.read_limited`), one hashed or read line by line is streamed (never through a last
symlink, and an output tree holds only files and directories); JSON is bounded in nesting depth
before `json` (which recurses once per level) parses it; and a record's shape is checked
before anything indexes it. Every refusal is one `PipelineError` naming the file and what to
do.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import IO, Any

from shoal.boundedjson import within_depth
from shoal.files import UnreadableFile, read_limited
from shoal.learner.errors import PipelineError

MAX_MANIFEST_BYTES = 16 << 20
"""pipeline.json at most: four stages' outputs and metrics are a few tens of KB."""
MAX_MANIFEST_DEPTH = 32
"""The deepest record nests about eight levels (stages → metrics → policy → split → ...)."""
MAX_STAGES = 16
MAX_PATH_CHARS = 1024
CHUNK = 1 << 20
"""Bytes hashed per read: a file of any size is hashed in constant memory."""
RERUN_ALL = "run the whole pipeline again (without --from-stage)"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""Stage and output names: short, and safe to print."""
_SHA256 = re.compile(r"[0-9a-f]{64}")


def open_regular(path: Path, remedy: str) -> IO[bytes]:
    """`path` opened for reading if it is a regular file (not through a last symlink); a FIFO
    or device is refused without blocking on it. Else a PipelineError ending in `remedy`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise PipelineError(f"{path} is missing; {remedy}") from None
    except (OSError, ValueError) as exc:
        raise PipelineError(f"{path} cannot be read ({_reason(exc)}); {remedy}") from None
    handle = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        handle.close()
        raise PipelineError(f"{path} is not a regular file; {remedy}")
    return handle


def read_regular(path: Path, limit: int, remedy: str) -> bytes:
    """The bytes of the regular file `path`, refused unread past `limit` bytes."""
    try:
        return read_limited(path, limit)
    except UnreadableFile as exc:
        raise PipelineError(f"{exc}; {remedy}") from None


def parse_json(data: bytes, max_depth: int, where: Path, remedy: str) -> Any:
    """JSON of bounded depth, checked before `json` recurses into it. NaN is accepted: the
    pipeline writes a metric it could not measure as NaN."""
    if not within_depth(data, max_depth):
        raise PipelineError(
            f"{where} nests deeper than {max_depth} levels (or its brackets do not balance); "
            f"{remedy}"
        )
    try:
        return json.loads(data)
    except ValueError as exc:
        raise PipelineError(f"{where} is not JSON ({exc}); {remedy}") from None


def read_manifest(path: Path) -> dict[str, Any]:
    """The run's pipeline.json, its shape checked (`check_manifest`)."""
    data = read_regular(path, MAX_MANIFEST_BYTES, RERUN_ALL)
    return check_manifest(parse_json(data, MAX_MANIFEST_DEPTH, path, RERUN_ALL), path)


def check_manifest(manifest: Any, where: Path) -> dict[str, Any]:
    """`manifest` if it is what the pipeline's `Recorder` writes: an object with a `config`
    object and a list of stages, each with a printable name, a wall time, a metrics object
    and outputs whose paths stay inside the run directory and whose sha256s are digests."""
    if not isinstance(manifest, dict):
        raise _bad(where, f"is a JSON {type(manifest).__name__}, not an object")
    if not isinstance(manifest.get("config"), dict):
        raise _bad(where, "has no config object")
    stages = manifest.get("stages")
    if not isinstance(stages, list) or len(stages) > MAX_STAGES:
        raise _bad(where, f"has no list of at most {MAX_STAGES} stages")
    for index, stage in enumerate(stages):
        _check_stage(stage, where, f"stages[{index}]")
    return manifest


def _check_stage(stage: Any, where: Path, label: str) -> None:
    if not isinstance(stage, dict):
        raise _bad(where, f"{label} is not an object")
    name = stage.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad(where, f"{label} has no stage name")
    wall = stage.get("wall_s")
    if isinstance(wall, bool) or not isinstance(wall, int | float):
        raise _bad(where, f"stage {name}'s wall_s is not a number")
    for key in ("metrics", "outputs"):
        if not isinstance(stage.get(key), dict):
            raise _bad(where, f"stage {name}'s {key} is not an object")
    if not isinstance(stage.get("reused", False), bool):
        raise _bad(where, f"stage {name}'s reused is not true or false")
    if not isinstance(stage.get("config", {}), dict):
        raise _bad(where, f"stage {name}'s config is not an object")
    for key, output in stage["outputs"].items():
        _check_output(output, where, f"stage {name}'s output {key!r:.40}")


def _check_output(output: Any, where: Path, label: str) -> None:
    if not isinstance(output, dict) or set(output) != {"path", "sha256"}:
        raise _bad(where, f"{label} is not a {{path, sha256}} object")
    if not _SHA256.fullmatch(str(output["sha256"])):
        raise _bad(where, f"{label} has no sha256 digest")
    if not _is_inside(output["path"]):
        raise _bad(where, f"{label} has the path {output['path']!r:.60}, not one inside the run")


def _is_inside(path: Any) -> bool:
    """Whether `path` is a relative path that names something below a directory: no `..`,
    no NUL byte, not empty, not absolute."""
    if not isinstance(path, str) or not 0 < len(path) <= MAX_PATH_CHARS or "\0" in path:
        return False
    pure = PurePosixPath(path)
    return bool(pure.parts) and not pure.is_absolute() and ".." not in pure.parts


def _bad(where: Path, problem: str) -> PipelineError:
    return PipelineError(f"{where} is not a pipeline record: {problem}; {RERUN_ALL}")


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc)


# -- hashing -----------------------------------------------------------------------------------


def digest(path: Path, remedy: str = RERUN_ALL) -> str:
    """sha256 of a regular file, or of a directory: over its files' relative paths and sha256s.
    Anything else in the tree (a symlink, a FIFO, a device) is refused: a stage never writes
    one, and a reader would follow or block on it."""
    mode = _lstat(path, remedy).st_mode
    if stat.S_ISREG(mode):
        return _file_digest(path, remedy)
    if not stat.S_ISDIR(mode):
        raise PipelineError(f"{path} is not a regular file or directory; {remedy}")
    lines = [
        f"{p.relative_to(path).as_posix()}\0{_file_digest(p, remedy)}\n"
        for p in sorted(path.rglob("*"))
        if not _is_directory(p, remedy)
    ]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def _lstat(path: Path, remedy: str) -> os.stat_result:
    try:
        return path.lstat()
    except FileNotFoundError:
        raise PipelineError(f"{path} is missing; {remedy}") from None
    except (OSError, ValueError) as exc:
        raise PipelineError(f"{path} cannot be read ({_reason(exc)}); {remedy}") from None


def _is_directory(path: Path, remedy: str) -> bool:
    """True for a directory, False for a regular file; anything else is refused."""
    mode = _lstat(path, remedy).st_mode
    if stat.S_ISDIR(mode) or stat.S_ISREG(mode):
        return stat.S_ISDIR(mode)
    raise PipelineError(f"{path} is not a regular file or directory; {remedy}")


def _file_digest(path: Path, remedy: str) -> str:
    sha = hashlib.sha256()
    with open_regular(path, remedy) as handle:
        for chunk in iter(lambda: handle.read(CHUNK), b""):
            sha.update(chunk)
    return sha.hexdigest()


def verify(root: Path, output: Mapping[str, Any], stage: str) -> Path:
    """The path of a recorded output (checked by `check_manifest`) once its bytes hash to the
    recorded sha256; missing, outside the run or changed is a PipelineError."""
    remedy = f"rerun from stage {stage}"
    path = root / output["path"]
    try:
        inside = path.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError) as exc:
        raise PipelineError(f"{path} cannot be resolved ({_reason(exc)}); {remedy}") from None
    if not inside:
        raise PipelineError(f"stage {stage}'s output {path} is outside the run; {remedy}")
    if digest(path, remedy) != output["sha256"]:
        raise PipelineError(
            f"stage {stage}'s output {path} changed since it was recorded (sha256 differs); "
            f"{remedy}"
        )
    return path
