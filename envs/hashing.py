"""The environment hash: one sha256 that changes whenever what an agent experiences could change.

It is taken over a canonical JSON manifest of the resolved id, the entry point, the parameters,
the time limit, the seed, the Python version and the versions of the distributions the
environment depends on. The manifest is kept beside it (`$SHOAL_HOME/envs/hashes/<hash>.json`,
SHOAL_HOME defaults to ~/.shoal), so `shoal envs diff` can say which field made two runs differ.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shoal.envs.errors import EnvError
from shoal.envs.registry import Registry, default_registry
from shoal.envs.text_registry import text_manifest
from shoal.files import write_atomically

if TYPE_CHECKING:
    from shoal.envs.wrappers import EnvConfig

MANIFEST_FORMAT = 1
HASH_LENGTH = 64
MIN_PREFIX = 6

Manifest = dict[str, Any]


class UnknownHash(EnvError):
    """No manifest is stored for this hash (or prefix) in the hash store."""


class HashStoreError(EnvError):
    """The hash store cannot be written or read (permissions, a full disk, a corrupt file)."""


def shoal_home() -> Path:
    return Path(os.environ.get("SHOAL_HOME") or "~/.shoal").expanduser()


def _json_value(key: str, value: Any) -> Any:
    """`value` in a form JSON writes one way only, or an error naming the parameter."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, tuple | list):
        return [_json_value(key, item) for item in value]
    if isinstance(value, Mapping):
        return {str(k): _json_value(f"{key}.{k}", v) for k, v in value.items()}
    if isinstance(value, float) and not np.isfinite(value):
        raise EnvError(f"parameter {key}={value!r} cannot be hashed: use a finite number")
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise EnvError(
        f"parameter {key}={value!r} cannot be hashed: use numbers, strings, booleans, "
        "lists or dicts of them"
    )


def canonical_json(manifest: Manifest) -> str:
    return json.dumps(manifest, sort_keys=True, separators=(",", ":"), allow_nan=False)


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def env_manifest(
    env_id: str,
    kwargs: Mapping[str, Any] | None = None,
    seed: int | None = None,
    registry: Registry = default_registry,
    wrappers: EnvConfig | None = None,
) -> Manifest:
    """The canonical description of an environment that `env_hash` hashes; a job's `[env]`
    section (`wrappers`) enters it only when it applies something, so the hash of a bare
    environment is the same as before wrappers existed; with it, the backend that runs it where
    that changes the frames (ale-py's C++ vector for the `atari` set: envs/ale_vector.py)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int | np.integer)):
        raise EnvError(f"seed must be an integer or None, got {seed!r}")
    spec = registry.spec(env_id)
    params = {**spec.kwargs, **(kwargs or {})}
    limit = params.pop("max_episode_steps", spec.max_episode_steps)
    manifest = {
        "format": MANIFEST_FORMAT,
        "id": spec.id,
        "entry_point": spec.entry_point_name,
        "kwargs": _json_value("kwargs", params),
        "max_episode_steps": _json_value("max_episode_steps", limit),
        "seed": None if seed is None else int(seed),
        "python": platform.python_version(),
        "packages": {name: package_version(name) for name in sorted(spec.requirements)},
    }
    if wrappers is not None and wrappers.active:
        from shoal.envs.ale_vector import backend_manifest

        section = {**wrappers.manifest(), **backend_manifest(spec.id, kwargs or {}, wrappers)}
        manifest["env"] = _json_value("env", section)
    text = text_manifest(spec.id, params)
    if text is not None:  # a text environment: its generator, version, parameters, tokenizer
        manifest["text"] = _json_value("text", text)
    return manifest


def manifest_hash(manifest: Manifest) -> str:
    return hashlib.sha256(canonical_json(manifest).encode()).hexdigest()


class HashStore:
    """Manifests by hash in one directory; writes are atomic, so readers never see half a file."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def default(cls) -> HashStore:
        return cls(shoal_home() / "envs" / "hashes")

    def save(self, digest: str, manifest: Manifest) -> Path:
        path = self.root / f"{digest}.json"
        if path.exists():
            return path
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            write_atomically(path, canonical_json(manifest) + "\n", durable=False)
        except OSError as exc:
            raise HashStoreError(
                f"cannot record environment hash in {self.root}: {exc}; set SHOAL_HOME to a "
                "writable directory"
            ) from exc
        return path

    def resolve(self, prefix: str) -> str:
        """The full hash that `prefix` (at least 6 hex digits) names in this store."""
        text = prefix.strip().lower()
        if not (MIN_PREFIX <= len(text) <= HASH_LENGTH) or any(
            c not in "0123456789abcdef" for c in text
        ):
            raise UnknownHash(
                f"{prefix!r} is not an environment hash: give {MIN_PREFIX} to {HASH_LENGTH} hex digits"
            )
        matches = (
            sorted(p.stem for p in self.root.glob(f"{text}*.json")) if self.root.is_dir() else []
        )
        if not matches:
            raise UnknownHash(
                f"unknown environment hash {prefix}: no manifest in {self.root} (hashes are "
                "recorded by 'shoal envs hash' and by runs using this SHOAL_HOME)"
            )
        if len(matches) > 1:
            raise UnknownHash(
                f"hash prefix {prefix} is ambiguous: {', '.join(m[:12] for m in matches)}"
            )
        return matches[0]

    def load(self, prefix: str) -> tuple[str, Manifest]:
        digest = self.resolve(prefix)
        path = self.root / f"{digest}.json"
        try:
            manifest: Manifest = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise HashStoreError(f"cannot read the manifest {path}: {exc}") from exc
        return digest, manifest


_recorded: set[tuple[Path, str]] = set()


def env_hash(
    env_id: str,
    kwargs: Mapping[str, Any] | None = None,
    seed: int | None = None,
    store: HashStore | None = None,
    wrappers: EnvConfig | None = None,
) -> str:
    """The hash of an environment (with a job's wrappers and normalisation), its manifest
    recorded in the store (once per process)."""
    manifest = env_manifest(env_id, kwargs, seed, wrappers=wrappers)
    digest = manifest_hash(manifest)
    store = store or HashStore.default()
    if (store.root, digest) not in _recorded:
        store.save(digest, manifest)
        _recorded.add((store.root, digest))
    return digest


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}{key}."))
        return flat if flat or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: value}


def diff_manifests(first: Manifest, second: Manifest) -> list[str]:
    """One line per field that differs, e.g. `python: 3.11.7 → 3.12.1`; empty when equal."""
    a, b = _flatten(first), _flatten(second)
    lines = []
    for key in sorted(a.keys() | b.keys()):
        left, right = a.get(key, "(absent)"), b.get(key, "(absent)")
        if left != right:
            lines.append(f"{key}: {_show(left)} → {_show(right)}")
    return lines


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)
