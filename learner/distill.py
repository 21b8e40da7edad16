"""Supervised fine-tuning and logit distillation of causal LMs, over completion tokens only.

A training example is a prompt and a completion (a reference solution). The teacher learns the
completions by cross-entropy (SFT); the student then learns the teacher's whole next-token
distribution at every completion position (forward KL(teacher ‖ student) on the logits, softened
by a temperature as in Hinton et al., 2015), which carries far more signal per token than the
sampled text alone. The prompt is context, never a target: its positions carry no loss.

Losses are token means over the minibatch's completion tokens, so a long reference weighs more
than a short one, as it does in the RL stage's token-mean loss (learner/token_ppo.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from shoal.config import check_int, check_number
from shoal.learner.errors import LearnerError


class DistillError(LearnerError):
    """Examples or logits that cannot be trained on; the message says which and why."""


@dataclass(frozen=True)
class TokenBatch:
    """Prompts + completions, right-padded to one length; `tokens[i, :prompt_lengths[i]]` is
    the prompt and the next `completion_lengths[i]` tokens the completion."""

    tokens: torch.Tensor
    """int64 [N, L]"""
    prompt_lengths: torch.Tensor
    """int64 [N], each >= 1 (a completion token is predicted from the position before it)"""
    completion_lengths: torch.Tensor
    """int64 [N], each >= 1"""

    def to(self, device: torch.device) -> TokenBatch:
        """The same batch on `device` (the model's)."""
        return replace(self, tokens=self.tokens.to(device),
                       prompt_lengths=self.prompt_lengths.to(device),
                       completion_lengths=self.completion_lengths.to(device))  # fmt: skip

    def attention_mask(self) -> torch.Tensor:
        """1 over prompt + completion, 0 over the right padding: int64 [N, L]."""
        positions = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        return (positions < (self.prompt_lengths + self.completion_lengths)[:, None]).long()

    def target_mask(self) -> torch.Tensor:
        """bool [N, L-1]: True at position j when token j+1 is a completion token, i.e. where
        the logits at j are trained."""
        targets = torch.arange(1, self.tokens.shape[1], device=self.tokens.device)
        start = self.prompt_lengths[:, None]
        return (targets >= start) & (targets < start + self.completion_lengths[:, None])


def pack(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int
) -> TokenBatch:
    """One right-padded batch; every prompt and completion must hold at least one token."""
    if len(prompts) != len(completions) or not prompts:
        raise DistillError(
            f"pack needs as many prompts as completions, at least one: got {len(prompts)} "
            f"prompts and {len(completions)} completions"
        )
    if any(not p for p in prompts) or any(not c for c in completions):
        raise DistillError("every prompt and completion needs at least one token (a BOS at least)")
    length = max(len(p) + len(c) for p, c in zip(prompts, completions))
    tokens = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        row = list(prompt) + list(completion)
        tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return TokenBatch(
        tokens=tokens,
        prompt_lengths=torch.tensor([len(p) for p in prompts], dtype=torch.long),
        completion_lengths=torch.tensor([len(c) for c in completions], dtype=torch.long),
    )


def lm_logits(lm: nn.Module, batch: TokenBatch) -> torch.Tensor:
    """The LM's logits float32 [N, L-1, V] at every position but the last (which predicts
    nothing in the batch)."""
    out = lm(input_ids=batch.tokens, attention_mask=batch.attention_mask(), use_cache=False)
    return out.logits[:, :-1].float()


def sft_loss(logits: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """Cross-entropy of the completion tokens, token mean. `logits` as `lm_logits` returns."""
    mask = batch.target_mask()
    _check_logits(logits, mask)
    return F.cross_entropy(logits[mask], batch.tokens[:, 1:][mask])


def distill_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    batch: TokenBatch,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Forward KL(teacher ‖ student) of the temperature-softened next-token distributions,
    token mean over completion positions, times T² so its gradient keeps its scale as T
    changes (Hinton et al.). Zero exactly when the student's logits equal the teacher's up to
    a constant per position. The teacher gets no gradient."""
    check_number("distill.temperature", temperature, above=0)
    mask = batch.target_mask()
    _check_logits(student_logits, mask)
    if teacher_logits.shape != student_logits.shape:
        raise DistillError(
            f"teacher logits {tuple(teacher_logits.shape)} and student logits "
            f"{tuple(student_logits.shape)} differ: the two models need the same tokenizer "
            "(vocabulary)"
        )
    return kl_rows(student_logits[mask], teacher_logits[mask], temperature)


def kl_rows(
    student_rows: torch.Tensor, teacher_rows: torch.Tensor, temperature: float
) -> torch.Tensor:
    """`distill_kl` over logits already taken at the completion positions, [tokens, vocab]."""
    student = F.log_softmax(student_rows / temperature, dim=-1)
    teacher = F.log_softmax(teacher_rows.detach() / temperature, dim=-1)
    kl = (teacher.exp() * (teacher - student)).sum(-1)
    return kl.mean() * temperature**2


TEACHER_CACHE_BYTES = 512 << 20
"""The most the teacher's logits at every completion position of the examples may take to be
computed once for all epochs instead of in every distillation step (2,000 CodeGen-v1 examples
in bytes: about 50 MB). A teacher's forward pass is a third of its training step, so for a
student a third of the teacher's size it was half of each step's time; above the bound (a
150k-token vocabulary, many examples) every step runs the teacher again."""


class TeacherTargets:
    """The teacher's float32 logits at each example's completion positions, computed once:
    the teacher is frozen and in eval mode, so every epoch would compute the same rows again."""

    def __init__(self, rows: list[torch.Tensor]) -> None:
        self.rows = rows

    @classmethod
    def cached(
        cls,
        teacher: nn.Module,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Sequence[int]],
        pad_id: int,
        batch_size: int,
        forward: Callable[[], AbstractContextManager[object]],
    ) -> TeacherTargets | None:
        """The targets of every example, or None when they would take over
        TEACHER_CACHE_BYTES (the vocabulary is read from the teacher's first batch)."""
        device = next(teacher.parameters()).device
        positions = sum(len(c) for c in completions)
        rows: list[torch.Tensor] = []
        for start in range(0, len(prompts), batch_size):
            end = start + batch_size
            batch = pack(prompts[start:end], completions[start:end], pad_id).to(device)
            with torch.no_grad(), forward():
                logits = lm_logits(teacher, batch)
            if positions * logits.shape[-1] * logits.element_size() > TEACHER_CACHE_BYTES:
                return None
            picked = logits[batch.target_mask()]
            rows.extend(picked.split(batch.completion_lengths.tolist()))
        return cls(rows)

    def take(self, chunk: Sequence[int]) -> torch.Tensor:
        """The rows of the examples `chunk` names, in the order a batch of them masks its
        logits (example by example, position by position)."""
        return torch.cat([self.rows[i] for i in chunk])


def _check_logits(logits: torch.Tensor, mask: torch.Tensor) -> None:
    if logits.dim() != 3 or logits.shape[:2] != mask.shape:
        raise DistillError(
            f"logits of shape {tuple(logits.shape)} do not fit the batch: expected "
            f"[{mask.shape[0]}, {mask.shape[1]}, vocab] (use lm_logits)"
        )
    if not bool(mask.any()):
        raise DistillError("the batch has no completion token to train on")


@dataclass(frozen=True)
class FitConfig:
    """How a model is fitted to the examples (SFT, or distillation when a teacher is given)."""

    epochs: int = 8
    lr: float = 3e-3
    """AdamW's peak learning rate, warmed up over the first 5% of steps, then cosine to 0."""
    batch_size: int = 32
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    temperature: float = 1.0
    """Distillation: the softening temperature of both distributions."""
    ce_weight: float = 0.0
    """Distillation: weight of the completion cross-entropy added to the KL (0: logits only)."""

    def __post_init__(self) -> None:
        check_int("fit.epochs", self.epochs, 1, 10_000)
        check_int("fit.batch_size", self.batch_size, 1, 1 << 16)
        check_number("fit.lr", self.lr, above=0)
        check_number("fit.weight_decay", self.weight_decay, low=0)
        check_number("fit.max_grad_norm", self.max_grad_norm, above=0)
        check_number("fit.temperature", self.temperature, above=0)
        check_number("fit.ce_weight", self.ce_weight, low=0)


def fit(
    lm: nn.Module,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    pad_id: int,
    cfg: FitConfig,
    *,
    seed: int = 0,
    teacher: nn.Module | None = None,
    forward: Callable[[], AbstractContextManager[object]] = nullcontext,
) -> dict[str, float]:
    """Train `lm` on the examples: SFT without a teacher, distillation from `teacher`'s logits
    with one, on the device `lm` is on (the teacher's must be the same); every forward pass
    runs inside `forward()` (bf16 autocast where it pays, learner/lm_pipeline.py). Every
    epoch deals the examples into fresh random minibatches. Batches cut once
    from length-sorted buckets held mostly one task family each (lengths follow the family),
    and those steps kept CodeGen-v1's teacher on its loss plateau (CE 0.12 after 1,000 steps,
    held-out pass@1 0.05); mixed batches got past it to copying the prompt's constants (CE
    0.01 after 625 steps, held-out pass@1 0.59), for a little more padding.
    Returns the last epoch's mean loss (and KL/CE parts) and the step count."""
    if not prompts:
        raise DistillError("fit needs at least one example (prompt and completion)")
    per_epoch = math.ceil(len(prompts) / cfg.batch_size)
    total = cfg.epochs * per_epoch
    optimizer = torch.optim.AdamW(lm.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(total))
    rng = torch.Generator().manual_seed(seed)
    device = next(lm.parameters()).device
    targets = None
    if teacher is not None:
        teacher.eval()
        targets = TeacherTargets.cached(
            teacher, prompts, completions, pad_id, cfg.batch_size, forward
        )
    lm.train()
    sums: dict[str, torch.Tensor] = {}
    for _ in range(cfg.epochs):
        # summed where they are computed: a GPU is not made to wait for each step's loss
        sums = {key: torch.zeros((), device=device) for key in ("loss", "kl", "ce")}
        order = torch.randperm(len(prompts), generator=rng).tolist()
        for start in range(0, len(order), cfg.batch_size):
            chunk = order[start : start + cfg.batch_size]
            batch = pack([prompts[i] for i in chunk], [completions[i] for i in chunk], pad_id)
            with forward():
                taught = None if targets is None else targets.take(chunk)
                parts = _loss(lm, batch.to(device), cfg, teacher, taught)
            optimizer.zero_grad(set_to_none=True)
            parts["loss"].backward()
            nn.utils.clip_grad_norm_(lm.parameters(), cfg.max_grad_norm)
            optimizer.step()
            schedule.step()
            for key, value in parts.items():
                sums[key] += value.detach().float()
    lm.eval()
    metrics = {key: float(value) / per_epoch for key, value in sums.items()}
    metrics["steps"] = float(total)
    metrics["examples"] = float(len(prompts))
    return metrics


def _loss(
    lm: nn.Module,
    batch: TokenBatch,
    cfg: FitConfig,
    teacher: nn.Module | None,
    taught: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """SFT without a teacher; with one, the KL to `taught` (its cached rows) or, where they
    were not cached, to its logits computed now."""
    logits = lm_logits(lm, batch)
    ce = sft_loss(logits, batch)
    if teacher is None:
        return {"loss": ce, "ce": ce, "kl": torch.zeros((), device=ce.device)}
    if taught is None:
        with torch.no_grad():
            teacher_logits = lm_logits(teacher, batch)
        kl = distill_kl(logits, teacher_logits, batch, cfg.temperature)
    else:
        kl = kl_rows(logits[batch.target_mask()], taught, cfg.temperature)
    return {"loss": kl + cfg.ce_weight * ce, "ce": ce, "kl": kl}


def _warmup_cosine(total: int) -> Callable[[int], float]:
    warmup = max(1, total // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor
