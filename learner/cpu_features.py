"""Whether this host's CPU computes bfloat16 natively (AVX512-BF16 or AMX).

torch runs bfloat16 matmuls and convolutions on any x86 CPU, but without these instructions
oneDNN emulates them and a bf16 step is slower than a float32 one; with them the Nature CNN's
PPO epoch takes half the time (docs/benchmarks.md, "bfloat16 on the collector's thread and
on the CPU learner"). So the learner's CPU autocast and the advice for `rollout.precision`
hang on this, read once from /proc/cpuinfo.
"""

from __future__ import annotations

import functools
from pathlib import Path

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
_CPUINFO_LIMIT = 1 << 20
"""/proc/cpuinfo of a 512-core host is about 1 MiB; only the first `flags` line is read."""


def flags_of(cpuinfo: str) -> frozenset[str]:
    """The first processor's `flags` (x86) or `Features` (arm) from /proc/cpuinfo's text."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@functools.cache
def native_bf16() -> bool:
    """Whether the CPU has bfloat16 instructions (False where /proc/cpuinfo can't be read)."""
    try:
        with Path("/proc/cpuinfo").open(encoding="utf-8", errors="replace") as file:
            text = file.read(_CPUINFO_LIMIT)
    except OSError:
        return False
    return bool(flags_of(text) & NATIVE_BF16_FLAGS)
