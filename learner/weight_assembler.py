"""The receiving end of weight sync: `WeightAssembler` rebuilds one policy version from
`weights_begin` / `weights_bucket` / `weights_commit` messages.

Pure (no event loop, no transport) so the rollout actor (rollout.py) and benches drive it the
same way. Everything it is given came over the network: it checks the manifest against the
local model's own names and shapes before allocating anything, checks every bucket's index,
length and checksum, and hands out the weights only at commit; a new begin drops a half-received
version.
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
    MAX_SOURCE_CHARS,
    MIN_BUCKET_BYTES,
    WIRE_DTYPES,
    Chunk,
    bucket_count,
    checksum,
    plan_buckets,
)
from shoal.runtime import wire


class _Receiving:
    """One version being received: its plan and the bytes of every tensor so far."""

    def __init__(
        self,
        version: int,
        source: str,
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
        plan: list[list[Chunk]],
    ) -> None:
        self.version = version
        self.source = source
        self.specs = specs
        self.plan = plan
        self.lengths = [sum(c.length for c in chunks) for chunks in plan]
        self.data = [
            np.empty(math.prod(shape) * dtype.itemsize, np.uint8) for _, dtype, shape in specs
        ]
        self.received = 0


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
        """Start receiving `version`; raises WeightSyncError if the manifest does not describe
        the local model (the previous half version is dropped either way)."""
        self.reset()
        if type(version) is not int or version < 0:
            raise WeightSyncError(f"weights version {version!r} is not a non-negative integer")
        if not isinstance(manifest, dict):
            raise WeightSyncError("the weights manifest is not a mapping")
        source = manifest.get("source", "")
        if not isinstance(source, str) or len(source) > MAX_SOURCE_CHARS:
            raise WeightSyncError("the weights manifest's source is not a short string")
        specs = self._tensor_specs(manifest.get("tensors"))
        plan = self._plan(manifest, [math.prod(s) * d.itemsize for _, d, s in specs])
        self.receiving = _Receiving(version, source, specs, plan)

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

    def _plan(self, manifest: dict[Any, Any], sizes: list[int]) -> list[list[Chunk]]:
        bucket_bytes, buckets, nbytes = (
            manifest.get(k) for k in ("bucket_bytes", "buckets", "nbytes")
        )
        total = sum(sizes)
        if (
            type(bucket_bytes) is not int
            or not MIN_BUCKET_BYTES <= bucket_bytes <= self.max_bucket_bytes
        ):
            raise WeightSyncError(
                f"the weights manifest's bucket size {str(bucket_bytes)[:30]} is outside "
                f"[{MIN_BUCKET_BYTES}, {self.max_bucket_bytes}]"
            )
        if nbytes != total or buckets != bucket_count(total, bucket_bytes):
            raise WeightSyncError(
                f"the weights manifest says {str(nbytes)[:30]} bytes in {str(buckets)[:30]} "
                f"buckets; its tensors make {total} bytes in "
                f"{bucket_count(total, bucket_bytes)}"
            )
        if buckets > MAX_BUCKETS:
            raise WeightSyncError(f"{buckets} buckets is over the limit of {MAX_BUCKETS}")
        return plan_buckets(sizes, bucket_bytes)

    def bucket(self, version: Any, index: Any, data: Any, crc: Any) -> bool:
        """Take bucket `index` of the version being received; False if that is not `version`
        (a leftover of a dropped one). A wrong index, length or checksum drops the version and
        raises WeightSyncError."""
        receiving = self.receiving
        if receiving is None or version != receiving.version:
            return False
        try:
            self._take(receiving, index, data, crc)
        except WeightSyncError:
            self.reset()
            raise
        return True

    def _take(self, receiving: _Receiving, index: Any, data: Any, crc: Any) -> None:
        if index != receiving.received or type(index) is not int:
            raise WeightSyncError(
                f"bucket {str(index)[:30]} of version {receiving.version} arrived, expected "
                f"bucket {receiving.received}"
            )
        if index >= len(receiving.plan):
            raise WeightSyncError(
                f"bucket {index} of version {receiving.version} is past its last bucket"
            )
        expected = receiving.lengths[index]
        if (
            not isinstance(data, np.ndarray)
            or data.dtype != np.uint8
            or data.shape != (expected,)
            or not data.flags.c_contiguous
        ):
            raise WeightSyncError(
                f"bucket {index} of version {receiving.version} is not {expected} bytes"
            )
        if type(crc) is not int or checksum(data) != crc:
            raise WeightSyncError(
                f"bucket {index} of version {receiving.version} fails its checksum: the "
                "version is dropped and the last complete one kept"
            )
        for chunk in receiving.plan[index]:
            target = receiving.data[chunk.tensor]
            target[chunk.start : chunk.start + chunk.length] = data[
                chunk.at : chunk.at + chunk.length
            ]
        receiving.received += 1

    def commit(self, version: Any) -> tuple[str, dict[str, torch.Tensor]] | None:
        """The complete version as (source, name -> tensor in the local dtype), or None when
        `version` is not the one being received. Raises WeightSyncError (and drops the version)
        when buckets are missing."""
        receiving = self.receiving
        if receiving is None or version != receiving.version:
            return None
        if receiving.received != len(receiving.plan):
            self.reset()
            raise WeightSyncError(
                f"version {version} was committed after {receiving.received} of "
                f"{len(receiving.plan)} buckets: dropped"
            )
        self.receiving = None
        weights = {}
        for (name, dtype, shape), data in zip(receiving.specs, receiving.data):
            local_dtype = self.expected[name][1]
            if not data.size:  # a 0-element tensor has no bytes to view
                weights[name] = torch.empty(shape, dtype=local_dtype)
                continue
            weights[name] = torch.from_numpy(data).view(dtype).reshape(shape).to(local_dtype)
        return receiving.source, weights
