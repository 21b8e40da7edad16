"""The receiving end of weight sync: `WeightAssembler` rebuilds one policy version from
`weights_begin` / `weights_bucket` / `weights_commit` messages.

Pure (no event loop, no transport) so the rollout actor (rollout.py) and benches drive it the
same way. Everything it is given came over the network: it checks the manifest against the
local model's own names and shapes before allocating anything, checks every bucket's part,
index, length and checksum, and hands out the weights only once every part of the version is
committed (a sharded learner's ranks each send their own rows, weight_sync.py); a newer version
drops a half-received one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from shoal.learner.errors import WeightSyncError
from shoal.learner.weight_plan import (
    MAX_BUCKETS,
    MAX_PARTS,
    MAX_SOURCE_CHARS,
    MIN_BUCKET_BYTES,
    WIRE_DTYPES,
    Chunk,
    bucket_count,
    checksum,
    part_sizes,
    plan_buckets,
)
from shoal.runtime import wire


class _Receiving:
    """One version being received: every part's plan, which parts have begun and how far each
    has come, and the bytes of every tensor so far."""

    def __init__(
        self,
        version: int,
        source: str,
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
        bucket_bytes: int,
        parts: int,
    ) -> None:
        self.version = version
        self.source = source
        self.specs = specs
        self.bucket_bytes = bucket_bytes
        self.parts = parts
        self.shapes = [(shape, dtype.itemsize) for _, dtype, shape in specs]
        self.plans: list[list[list[Chunk]] | None] = [None] * parts
        """Each part's bucket plan, derived once the part begins."""
        self.starts: list[list[int]] = [[] for _ in range(parts)]
        """Where each part's bytes of each tensor start, once the part begins."""
        self.received = [0] * parts
        self.committed: set[int] = set()
        self.data = [
            np.empty(math.prod(shape) * dtype.itemsize, np.uint8) for _, dtype, shape in specs
        ]


class WeightAssembler:
    """Rebuilds one version from begin / bucket / commit messages; everything it is given is
    treated as hostile. `expected` is the local model's state: name -> tensor (shapes and
    dtypes are what is used). Only `commit` hands out weights, cast to the local dtypes."""

    def __init__(
        self,
        expected: Mapping[str, torch.Tensor],
        max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        self.expected = {name: (tuple(t.shape), t.dtype) for name, t in expected.items()}
        self.max_bucket_bytes = max_frame_bytes
        self.receiving: _Receiving | None = None
        self.dropped = 0
        """Half-received versions dropped: by a newer begin, a reset or a refused bucket."""

    def reset(self) -> None:
        """Drop a half-received version, if any."""
        if self.receiving is not None:
            self.receiving = None
            self.dropped += 1

    def begin(self, version: Any, manifest: Any) -> None:
        """Part `manifest["part"]` of `version` starts arriving. A part of the version being
        received joins it (its manifest must agree with the parts before it; a part begun
        again starts over); a newer version, or one from another source, drops the half
        received one; an older part of the same source is ignored. Raises WeightSyncError if
        the manifest does not describe the local model (the half version is dropped)."""
        if type(version) is not int or version < 0:
            self.reset()
            raise WeightSyncError(f"weights version {version!r} is not a non-negative integer")
        if not isinstance(manifest, dict):
            self.reset()
            raise WeightSyncError("the weights manifest is not a mapping")
        source = manifest.get("source", "")
        receiving = self.receiving
        if receiving is not None and source == receiving.source and version < receiving.version:
            return
        try:
            part, parts = _part_of(manifest)
            if receiving is None or (source, version) != (receiving.source, receiving.version):
                self.reset()
                receiving = self._start(version, source, manifest, parts)
            elif self._tensor_specs(manifest.get("tensors")) != receiving.specs or (
                parts,
                manifest.get("bucket_bytes"),
            ) != (receiving.parts, receiving.bucket_bytes):
                raise WeightSyncError(
                    f"part {part} of version {version} describes another layout than the parts "
                    "before it: the learner's ranks disagree on the model"
                )
            starts, sizes = part_sizes(receiving.shapes, part, parts)
            receiving.plans[part] = self._plan(manifest, sizes, part)
            receiving.starts[part] = starts
        except WeightSyncError:
            self.reset()
            raise
        receiving.received[part] = 0
        receiving.committed.discard(part)

    def _start(self, version: int, source: Any, manifest: dict[Any, Any], parts: int) -> _Receiving:
        if not isinstance(source, str) or len(source) > MAX_SOURCE_CHARS:
            raise WeightSyncError("the weights manifest's source is not a short string")
        specs = self._tensor_specs(manifest.get("tensors"))
        bucket_bytes = manifest.get("bucket_bytes")
        if (
            type(bucket_bytes) is not int
            or not MIN_BUCKET_BYTES <= bucket_bytes <= self.max_bucket_bytes
        ):
            raise WeightSyncError(
                f"the weights manifest's bucket size {str(bucket_bytes)[:30]} is outside "
                f"[{MIN_BUCKET_BYTES}, {self.max_bucket_bytes}]"
            )
        self.receiving = _Receiving(version, source, specs, bucket_bytes, parts)
        return self.receiving

    def _tensor_specs(self, tensors: Any) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        if not isinstance(tensors, list) or len(tensors) != len(self.expected):
            count = len(tensors) if isinstance(tensors, list) else "no"
            raise WeightSyncError(
                f"the weights manifest lists {count} tensors, this model has "
                f"{len(self.expected)}: the learner and this actor run different models"
            )
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        seen: set[str] = set()
        for entry in tensors:
            if not isinstance(entry, list) or len(entry) != 3:
                raise WeightSyncError("a manifest tensor entry must be [name, dtype, shape]")
            name, dtype_name, shape = entry
            local = self.expected.get(name) if isinstance(name, str) else None
            if local is None or name in seen:
                raise WeightSyncError(
                    f"the weights manifest names {str(name)[:100]!r}, which this model does not "
                    "have (or twice): the learner and this actor run different models"
                )
            seen.add(name)
            dtype = WIRE_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
            local_shape, local_dtype = local
            if dtype is None or (
                dtype != local_dtype
                and not (dtype.is_floating_point and local_dtype.is_floating_point)
            ):
                raise WeightSyncError(
                    f"tensor {name!r} arrives as {str(dtype_name)[:20]!r}, which cannot load "
                    f"into this model's {local_dtype}"
                )
            if not isinstance(shape, list) or tuple(shape) != local_shape:
                raise WeightSyncError(
                    f"tensor {name!r} arrives with shape {str(shape)[:100]}, this model needs "
                    f"{list(local_shape)}"
                )
            specs.append((name, dtype, local_shape))
        return specs

    def _plan(self, manifest: dict[Any, Any], sizes: list[int], part: int) -> list[list[Chunk]]:
        bucket_bytes, buckets, nbytes = (
            manifest.get(k) for k in ("bucket_bytes", "buckets", "nbytes")
        )
        assert type(bucket_bytes) is int  # checked when the version started
        total = sum(sizes)
        if nbytes != total or buckets != bucket_count(total, bucket_bytes):
            raise WeightSyncError(
                f"the weights manifest of part {part} says {str(nbytes)[:30]} bytes in "
                f"{str(buckets)[:30]} buckets; its rows of the tensors make {total} bytes in "
                f"{bucket_count(total, bucket_bytes)}"
            )
        if buckets > MAX_BUCKETS:
            raise WeightSyncError(f"{buckets} buckets is over the limit of {MAX_BUCKETS}")
        return plan_buckets(sizes, bucket_bytes)

    def bucket(self, version: Any, part: Any, index: Any, data: Any, crc: Any) -> bool:
        """Take bucket `index` of `part` of the version being received; False if that is not
        `version` (a leftover of a dropped one). A part that has not begun, a wrong index,
        length or checksum drops the version and raises WeightSyncError."""
        receiving = self.receiving
        if receiving is None or version != receiving.version:
            return False
        try:
            self._take(receiving, *self._begun(receiving, part), index, data, crc)
        except WeightSyncError:
            self.reset()
            raise
        return True

    def _begun(self, receiving: _Receiving, part: Any) -> tuple[int, list[list[Chunk]]]:
        plan = receiving.plans[part] if type(part) is int and 0 <= part < receiving.parts else None
        if plan is None:
            raise WeightSyncError(
                f"part {str(part)[:30]} of version {receiving.version} has not begun"
            )
        return part, plan

    def _take(
        self,
        receiving: _Receiving,
        part: int,
        plan: list[list[Chunk]],
        index: Any,
        data: Any,
        crc: Any,
    ) -> None:
        if type(index) is not int or index != receiving.received[part]:
            raise WeightSyncError(
                f"bucket {str(index)[:30]} of part {part} of version {receiving.version} "
                f"arrived, expected bucket {receiving.received[part]}"
            )
        if index >= len(plan):
            raise WeightSyncError(
                f"bucket {index} of part {part} of version {receiving.version} is past its "
                "last bucket"
            )
        expected = sum(chunk.length for chunk in plan[index])
        if (
            not isinstance(data, np.ndarray)
            or data.dtype != np.uint8
            or data.shape != (expected,)
            or not data.flags.c_contiguous
        ):
            raise WeightSyncError(
                f"bucket {index} of part {part} of version {receiving.version} is not "
                f"{expected} bytes"
            )
        if type(crc) is not int or checksum(data) != crc:
            raise WeightSyncError(
                f"bucket {index} of part {part} of version {receiving.version} fails its "
                "checksum: the version is dropped and the last complete one kept"
            )
        starts = receiving.starts[part]
        for chunk in plan[index]:
            at = starts[chunk.tensor] + chunk.start
            receiving.data[chunk.tensor][at : at + chunk.length] = data[
                chunk.at : chunk.at + chunk.length
            ]
        receiving.received[part] += 1

    def commit(self, version: Any, part: Any) -> tuple[str, dict[str, torch.Tensor]] | None:
        """The complete version as (source, name -> tensor) once `part` was the last one
        missing; None while parts are missing, or when `version` is not the one being received.
        Each tensor is a view of the received bytes in the wire dtype: `set_weights` casts it
        to the local dtype as it copies, so a bf16 version of an fp32 model never has a second
        whole copy made beside the received one. Raises WeightSyncError (and drops the
        version) when the part has not begun or lacks buckets."""
        receiving = self.receiving
        if receiving is None or version != receiving.version:
            return None
        try:
            part, plan = self._begun(receiving, part)
            if receiving.received[part] != len(plan):
                raise WeightSyncError(
                    f"part {part} of version {version} was committed after "
                    f"{receiving.received[part]} of {len(plan)} buckets: dropped"
                )
        except WeightSyncError:
            self.reset()
            raise
        receiving.committed.add(part)
        if len(receiving.committed) < receiving.parts:
            return None
        self.receiving = None
        weights = {}
        for (name, dtype, shape), data in zip(receiving.specs, receiving.data):
            if not data.size:  # a 0-element tensor has no bytes to view
                weights[name] = torch.empty(shape, dtype=dtype)
                continue
            weights[name] = torch.from_numpy(data).view(dtype).reshape(shape)
        return receiving.source, weights


def _part_of(manifest: dict[Any, Any]) -> tuple[int, int]:
    """The manifest's (part, parts), checked."""
    part, parts = manifest.get("part"), manifest.get("parts")
    if type(parts) is not int or not 1 <= parts <= MAX_PARTS:
        raise WeightSyncError(
            f"the weights manifest's parts {str(parts)[:30]} is not a count from 1 to {MAX_PARTS}"
        )
    if type(part) is not int or not 0 <= part < parts:
        raise WeightSyncError(
            f"the weights manifest's part {str(part)[:30]} is not one of its {parts} parts"
        )
    return part, parts
