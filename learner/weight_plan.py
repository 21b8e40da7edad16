"""The weight-sync protocol's shared, pure half: its limits, `[weight_sync]` config, the bucket
plan and the checksum.

Both ends derive the bucket layout from the manifest alone with `plan_buckets`, so the learner
side (weight_sync.py) and the receiving side (weight_assembler.py) import it from here: one
definition is what makes "the same plan on both ends" true by construction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import xxhash

from shoal.config import check_number
from shoal.errors import ConfigError
from shoal.learner.errors import WeightSyncError
from shoal.runtime import wire

MIB = 1 << 20
FRAME_HEADROOM = 64 * 1024
"""Bytes of a bucket's frame that are not the bucket: prefix, msgpack header (method, actor
path, version, index, checksum), the buffer table and its 64-byte alignment."""
MIN_BUCKET_BYTES = 1024
MAX_BUCKETS = 1 << 16
"""Buckets of one version; 65536 × 256 MiB is 16 TiB, and a receiver never plans more."""
MAX_SOURCE_CHARS = 256
MAX_PARTS = 1024
"""Publishers of one version: a shard group's ranks (16 in the seed's islands)."""
WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
WIRE_NAMES = {dtype: name for name, dtype in WIRE_DTYPES.items()}


@dataclass(frozen=True)
class WeightSyncConfig:
    """TOML `[weight_sync]`: how the learner ships a policy version to its rollout actors."""

    bucket_mb: float = 256.0
    """Largest bucket in MiB (also capped by the transport's frame size); 1 KiB at least."""
    wire_dtype: str = "float32"
    """"bfloat16" halves the bytes of floating tensors on the wire; the receiver casts back."""
    deadline_s: float = 60.0
    """A transfer to one actor that takes longer is abandoned, logged and counted."""

    def __post_init__(self) -> None:
        check_number(
            "weight_sync.bucket_mb", self.bucket_mb, low=MIN_BUCKET_BYTES / MIB, high=65536
        )
        if self.wire_dtype not in ("float32", "bfloat16"):
            raise ConfigError(
                f'weight_sync.wire_dtype = {self.wire_dtype!r} is invalid: use "float32" or '
                '"bfloat16"'
            )
        check_number("weight_sync.deadline_s", self.deadline_s, above=0, unit="seconds")

    def bucket_bytes(self, max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES) -> int:
        """The bucket size to plan with: `bucket_mb`, but always a frame's worth under the cap."""
        return bucket_limit(int(self.bucket_mb * MIB), max_frame_bytes)


def bucket_limit(bucket_bytes: int, max_frame_bytes: int) -> int:
    """`bucket_bytes`, lowered so a bucket plus its message fits in one frame."""
    room = max_frame_bytes - FRAME_HEADROOM
    if room < MIN_BUCKET_BYTES:
        raise ConfigError(
            f"max_frame_bytes = {max_frame_bytes} leaves no room for weight buckets: use at least "
            f"{FRAME_HEADROOM + MIN_BUCKET_BYTES}"
        )
    return max(MIN_BUCKET_BYTES, min(bucket_bytes, room))


class Chunk(NamedTuple):
    """Bytes [start, start + length) of tensor `tensor`, at offset `at` of its bucket."""

    tensor: int
    start: int
    length: int
    at: int


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[list[Chunk]]:
    """Cut tensors of `sizes` bytes, in order, into buckets of at most `bucket_bytes`.

    Every bucket but the last is full and none is empty, so the sender and the receiver derive
    the same plan from the manifest alone (nothing about the layout has to be trusted)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[Chunk]] = []
    current: list[Chunk] = []
    filled = 0
    for index, size in enumerate(sizes):
        start = 0
        while start < size:
            length = min(size - start, bucket_bytes - filled)
            current.append(Chunk(index, start, length, filled))
            start += length
            filled += length
            if filled == bucket_bytes:
                buckets.append(current)
                current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


def row_span(rows: int, part: int, parts: int) -> tuple[int, int]:
    """Rows [lo, hi) of a tensor with `rows` rows that part `part` of `parts` owns: runs of
    ceil(rows / parts), the last ones short or empty. The same split as torch.chunk, and so
    as FSDP2's dim-0 shards: a sharded rank owns exactly the rows it holds."""
    size = -(-rows // parts)
    lo = min(part * size, rows)
    return lo, min(lo + size, rows)


def part_range(shape: Sequence[int], itemsize: int, part: int, parts: int) -> tuple[int, int]:
    """The bytes (start, length) of a row-major tensor that part `part` of `parts` owns: its
    rows' (a 0-dimensional tensor is one row)."""
    rows = shape[0] if shape else 1
    row_bytes = itemsize * math.prod(shape[1:])
    lo, hi = row_span(rows, part, parts)
    return lo * row_bytes, (hi - lo) * row_bytes


def part_sizes(
    specs: Sequence[tuple[Sequence[int], int]], part: int, parts: int
) -> tuple[list[int], list[int]]:
    """For tensors of (shape, itemsize): where each tensor's owned bytes start, and how many."""
    ranges = [part_range(shape, itemsize, part, parts) for shape, itemsize in specs]
    return [start for start, _ in ranges], [length for _, length in ranges]


def bucket_count(total: int, bucket_bytes: int) -> int:
    return -(-total // bucket_bytes)


def checksum(data: np.ndarray) -> int:
    """XXH3-64 of a bucket: 19 GB/s here against 3.9 GB/s for CRC-32, on the critical path at
    both ends of every sync (docs/weight-sync.md); it guards against corruption and mix-ups,
    the link itself is authenticated."""
    return int(xxhash.xxh3_64_intdigest(data.data))


def wire_dtype(dtype: torch.dtype, cfg: WeightSyncConfig) -> torch.dtype:
    if dtype not in WIRE_NAMES:
        raise WeightSyncError(
            f"cannot ship a tensor of dtype {dtype}: supported are {sorted(WIRE_DTYPES)}"
        )
    if cfg.wire_dtype == "bfloat16" and dtype.is_floating_point:
        return torch.bfloat16
    return dtype
