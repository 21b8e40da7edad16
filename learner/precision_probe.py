"""Whether bf16 autocast makes a model's training step faster on this CPU, measured on it.

Why measured: a CPU's flags do not tell. Two x86 hosts with the same AVX512-BF16 and AMX flags,
the same day (2026-12-07, `shoal bench precision`, one SFT step of 32 CodeGen-v1 examples in
bytes): on one, bf16 took a 1.3M-parameter causal LM's step from 325 to 204 ms and a 0.25M one's
from 74.7 to 79.0 ms; on the other, from 403 to 396 ms and from 119 to 172 ms. A few steps each
way, on the model and a batch of the stage's own examples, cost seconds before a stage of
minutes and decide for that machine, that model and that batch shape.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shoal.learner.distill import TokenBatch, lm_logits, sft_loss

PROBE_ROUNDS = 3
"""Timed steps each way after one untimed warm-up each (oneDNN builds its kernels on first use);
alternating, so load from other work hits both."""


@dataclass(frozen=True)
class ProbeResult:
    """Median seconds of one step under bf16 autocast and in float32."""

    bf16_s: float
    fp32_s: float

    @property
    def bf16(self) -> bool:
        """bf16 is kept only where it was faster: a tie keeps float32's exact arithmetic."""
        return self.bf16_s < self.fp32_s

    def record(self) -> dict[str, float | bool]:
        return {"bf16_ms": self.bf16_s * 1e3, "fp32_ms": self.fp32_s * 1e3, "bf16": self.bf16}


def faster_precision(
    step: Callable[[bool], object],
    rounds: int = PROBE_ROUNDS,
    clock: Callable[[], float] = time.perf_counter,
) -> ProbeResult:
    """Time `step(autocast)` both ways, `rounds` times each, alternating. Wall time, not the
    thread's CPU time: the step's matrix products run on every intra-op thread."""
    for bf16 in (True, False):
        step(bf16)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for bf16 in (True, False):
            started = clock()
            step(bf16)
            times[bf16].append(clock() - started)
    return ProbeResult(statistics.median(times[True]), statistics.median(times[False]))


def sft_step(lm: nn.Module, batch: TokenBatch) -> Callable[[bool], None]:
    """One SFT forward and backward pass of `lm` on `batch`, under bf16 autocast or not. No
    optimiser step and the gradients are dropped after, so probing leaves `lm` as it was."""
    device_type = next(lm.parameters()).device.type

    def step(bf16: bool) -> None:
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
            loss = sft_loss(lm_logits(lm, batch), batch)
        loss.backward()
        lm.zero_grad(set_to_none=True)

    return step
