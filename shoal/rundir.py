"""A training run's directory, every file in it by name, and the status record ranks write.

`shoal train` lays the directory out, the learner ranks and rollout workers write into it, and
`shoal train`, the chaos checker and tests read what they wrote. Before this module each of
them spelled the file names and the status record's keys itself; now `RunDir` names the files
and `RankStatus` is the record a reader gets: parsed only after its size and nesting depth are
bounded, and with every field it types checked, so a torn or foreign file is one error
(`StatusRefused`) rather than a TypeError in the middle of a run's poll loop.

A leaf module (the standard library, shoal.errors, shoal.boundedjson, shoal.files), so the
learner's processes may use it without importing `shoal train`.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.boundedjson import JsonTooDeep, JsonTooLarge, within_depth
from shoal.errors import ShoalError
from shoal.files import write_json_atomically

MIN_FREE_BYTES = 16 << 20
"""Free space a run directory needs to start: journals, logs and a few small checkpoints."""
MAX_STATUS_BYTES = 64 << 20
"""A status record is a few KB plus the intake's ledger of sequence ranges; far beyond any a
rank writes, a file this large is refused unread."""
MAX_STATUS_DEPTH = 16
"""The record nests five levels (record → ledger → kind → actor's ranges → [lo, hi]);
far deeper is not one."""


class TrainError(ShoalError):
    """The run could not start, or its job failed; the message names the log to read."""


class StatusRefused(TrainError, ValueError):
    """A status file is not a rank's status record (torn, foreign or hostile); a reader skips
    it and keeps the record it had."""


def fresh_path(root: Path, label: str) -> Path:
    """root/<UTC timestamp>-<label>[-n], never an existing directory; `label` (an environment
    id, say) made safe for a file name."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    base = root / f"{stamp}-{label.replace('/', '_').replace(':', '_')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


@dataclass(frozen=True)
class RunDir:
    """Where each file of a run lives. Laid out by `shoal train` (job.json, checkpoints/,
    reports/, result.json); written by the tasks (status-<rank>.json, events.jsonl,
    accounting/, learner-<rank>.addr); an embedded cluster adds cluster.json, api-token and
    logs/ (shoal/local.py)."""

    path: Path

    @classmethod
    def create(cls, root: Path, env_id: str) -> RunDir:
        """A new runs/<UTC timestamp>-<env>[-n], laid out."""
        return cls.lay_out(fresh_path(root, env_id))

    @classmethod
    def lay_out(cls, path: Path) -> RunDir:
        """An explicitly named run directory, with checkpoints/ and reports/; reusing one
        resumes from its checkpoints."""
        run = cls(path)
        try:
            for sub in (run.checkpoints, run.reports):
                sub.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TrainError(f"cannot create run directory {path}: {exc.strerror}") from exc
        return run

    def check_room(self) -> None:
        """Refuse a run directory on a nearly full disk before anything starts: the embedded
        coordinator's Raft journal, the logs and the checkpoints all go there, and a replica
        that finds no room for its journal stops."""
        free = shutil.disk_usage(self.path).free
        if free < MIN_FREE_BYTES:
            raise TrainError(
                f"run directory {self.path} has {free} bytes free, less than the "
                f"{MIN_FREE_BYTES} a run needs to start; free space or choose a --run-dir on "
                "a larger disk"
            )

    @property
    def job_record(self) -> Path:
        """job.json: what the job was submitted with, for people (the tasks do not read it)."""
        return self.path / "job.json"

    @property
    def result(self) -> Path:
        """result.json: the run's summary (`TrainResult`)."""
        return self.path / "result.json"

    @property
    def events(self) -> Path:
        """events.jsonl: one line per lifecycle event of every process of the run."""
        return self.path / "events.jsonl"

    @property
    def checkpoints(self) -> Path:
        """checkpoints/, unless the job's `checkpoint.storage` puts them elsewhere."""
        return self.path / "checkpoints"

    @property
    def reports(self) -> Path:
        return self.path / "reports"

    @property
    def accounting(self) -> Path:
        """accounting/: each learner incarnation's fragment ledger and journal."""
        return self.path / "accounting"

    @property
    def cluster_record(self) -> Path:
        """cluster.json of the local cluster in this directory (an embedded one, or `shoal up`'s)."""
        return self.path / "cluster.json"

    @property
    def api_token(self) -> Path:
        return self.path / "api-token"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    def status(self, rank: int) -> Path:
        """status-<rank>.json: the rank's `RankStatus`, rewritten atomically every few seconds."""
        return self.path / f"status-{rank}.json"

    def clear_statuses(self) -> None:
        """Remove every rank's status file: a new run must not read the counts of the run
        before it (a stale `env_steps` past the new budget would stop it before it starts)."""
        for path in self.path.glob("status-*.json"):
            path.unlink(missing_ok=True)

    def address(self, rank: int) -> Path:
        """learner-<rank>.addr: the transport address the rank listens at."""
        return self.path / f"learner-{rank}.addr"

    def write_job_record(self, record: Mapping[str, Any]) -> None:
        self.job_record.write_text(json.dumps(dict(record), indent=1))

    def write_status(self, rank: int, record: Mapping[str, Any]) -> None:
        """The rank's status, atomically (a reader never sees half of one); not durable: the
        next one follows in seconds."""
        write_json_atomically(self.status(rank), dict(record), durable=False)

    def read_status(self, rank: int) -> RankStatus:
        """The rank's status record; OSError when there is none, StatusRefused (or the
        boundedjson errors) when the file is not one."""
        with self.status(rank).open("rb") as handle:
            return RankStatus.from_json(handle.read(MAX_STATUS_BYTES + 1))

    def append_event(self, event: Mapping[str, Any]) -> None:
        """One line per lifecycle event (start, resume, checkpoint, stop) in events.jsonl."""
        with self.events.open("a") as handle:
            handle.write(json.dumps({"time": time.time(), **event}) + "\n")


@dataclass(frozen=True)
class RankStatus:
    """What a learner rank reports about itself (status-<rank>.json, or rank 0's published
    progress): the fields readers act on, typed, and the whole record as written (`record`)
    for the ones they only show (pid, ledger, phases, ...). Every field may be missing: a
    rank that has not trained yet reports little."""

    version: int = 0
    env_steps: int = 0
    sps: float = 0.0
    returns: tuple[float, ...] = ()
    policy_lag_median: float | None = None
    """None until measured (the rank writes NaN then)."""
    checkpoint: str | None = None
    """The checkpoint the rank last began to write (a full disk may not have let it finish)."""
    checkpoint_step: int | None = None
    checkpoint_error: str | None = None
    final: bool = False
    intake: Mapping[str, int] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)
    record: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: bytes) -> RankStatus:
        """Parse a status file's bytes once their size and depth are bounded. NaN is allowed
        (an unmeasured lag or loss is written as NaN)."""
        if len(data) > MAX_STATUS_BYTES:
            raise JsonTooLarge(f"a status record over {MAX_STATUS_BYTES} bytes")
        if not within_depth(data, MAX_STATUS_DEPTH):
            raise JsonTooDeep(f"a status record nested deeper than {MAX_STATUS_DEPTH} levels")
        try:
            record = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise StatusRefused(f"a status record that is not JSON ({exc})") from None
        return cls.from_mapping(record)

    @classmethod
    def from_mapping(cls, record: object) -> RankStatus:
        """Check each typed field of `record` (an object); unknown keys are kept, not read."""
        if not isinstance(record, dict):
            raise StatusRefused(f"a status record is an object, not {type(record).__name__}")
        return cls(
            version=_field(record, "version", int, 0),
            env_steps=_field(record, "env_steps", int, 0),
            sps=float(_field(record, "sps", float, 0.0)),
            returns=tuple(float(r) for r in _list_of(record, "returns", float)),
            policy_lag_median=_finite_or_none(_field(record, "policy_lag_median", float, None)),
            checkpoint=_field(record, "checkpoint", str, None),
            checkpoint_step=_field(record, "checkpoint_step", int, None),
            checkpoint_error=_field(record, "checkpoint_error", str, None),
            final=bool(_field(record, "final", bool, False)),
            intake=_mapping_of(record, "intake", int),
            metrics=_mapping_of(record, "metrics", float),
            record=record,
        )

    def get(self, key: str, default: Any = None) -> Any:
        """A field of the record as written, by its JSON key (those the dataclass does not
        type too: pid, incarnation, ledger, phases)."""
        return self.record.get(key, default)


def _is(value: object, kind: type) -> bool:
    """JSON's types as Python reads them: a bool is not a number, an int is a float."""
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, int | float)
    return isinstance(value, kind)


def _field(record: Mapping[str, Any], key: str, kind: type, default: Any) -> Any:
    value = record.get(key)
    if value is None:
        return default
    if not _is(value, kind):
        raise StatusRefused(f"status field {key} = {value!r:.80} is not a {kind.__name__}")
    return value


def _list_of(record: Mapping[str, Any], key: str, kind: type) -> list[Any]:
    value = _field(record, key, list, [])
    if not all(_is(item, kind) for item in value):
        raise StatusRefused(f"status field {key} holds something that is not a {kind.__name__}")
    return list(value)


def _mapping_of(record: Mapping[str, Any], key: str, kind: type) -> dict[str, Any]:
    value = _field(record, key, dict, {})
    if not all(_is(item, kind) for item in value.values()):
        raise StatusRefused(f"status field {key} holds something that is not a {kind.__name__}")
    return dict(value)


def _finite_or_none(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)
