"""Batched sampling from a `CausalLMPolicy` with a KV cache, each token stamped with the log-prob,
value and policy version the learner needs.

`Generator.start` left-pads a batch of prompts and prefills them in one forward (attention mask
and position ids, so padding changes nothing); each `Generator.step` samples one token for every
unfinished row and runs one decode forward for all of them together (rows that finished are
dropped from the cache, so a long straggler does not drag finished rows along). A rollout worker
yields to its event loop between steps, which is what lets weights arrive mid-generation.

Behaviour log-probs (what the learner's ratio divides by). `logprobs[i, t]` is log mu(a_t | s_t):
the log-probability of the sampled token under the distribution it was actually drawn from, i.e.
the policy's logits (the first `action_dim`, as `CausalLMPolicy.heads` reads them) divided by
`temperature`, restricted to the top-p nucleus and renormalised (`sampling_log_probs`). The
learner must compute pi_theta as `log_softmax(logits / temperature)` with the SAME temperature the
generator used; with `top_p = 1` (the RL default) the two are then the same function of the
logits and an on-policy ratio is exactly 1. With `top_p < 1` the recorded mu is the renormalised
nucleus, larger than the learner's untruncated pi, so ratios are biased low: use top_p < 1 for
evaluation, not for training. Greedy decoding (`temperature = 0`) samples from a point mass, so
its log-probs are 0; it is for evaluation only.

Values. `values[i, t]` is V(s_t): the policy's value head on the last hidden state that produced
token t (the last prompt position for t = 0), the behaviour value token-level GAE starts from.

Stops. A row ends at EOS (`stop_at_eos`), when a stop string appears in its decoded tail, or at
`max_new_tokens`. The tokens keep everything sampled, including the EOS or the tokens that spell
the stop string (the learner trains on what was sampled); `texts` leave out the EOS and cut at the
first stop string (the environment scores the program, not its terminator). A stop string is
looked for in the decoded last `utf8 bytes + 3` tokens, assuming a token decodes to >= 1 byte.

Weight arrival. `weight_arrival = "finish"` (the default, measured in docs/generation.md): the
caller keeps the old weights in the policy until `step` returns False, so a batch is one version.
`"interrupt"`: the caller loads the new weights between two steps and calls `swap`, which
re-prefills prompt + tokens-so-far of the unfinished rows with them; later tokens carry the new
version. On a CPU a swap costs about as much as the rest of an average batch, so it only pays
where a prefill is cheap beside the decode steps it saves (a GPU, long completions).

Concurrency: a Generator and its `Generation` are used from one thread at a time, and the
policy's weights must not change while `step` or `swap` runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shoal.envs.tokenizer import Tokenizer
from shoal.learner.errors import LearnerError
from shoal.learner.models.causal_lm import CausalLMPolicy

WEIGHT_ARRIVAL = ("finish", "interrupt")
"""What a rollout worker does when new weights arrive while a batch is generating."""
STOP_REASONS = ("eos", "stop", "length")
MAX_BATCH = 4096
MAX_NEW_TOKENS = 8192
MAX_TEMPERATURE = 100.0
MAX_STOPS = 16
MAX_STOP_CHARS = 64
_VERSION_RANGE = (0, 2**31 - 1)


class GenerationError(LearnerError):
    """A sampling config, a prompt batch or a tokenizer that this generator cannot use."""


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample; checked on construction (a hostile value raises `GenerationError`)."""

    temperature: float = 1.0
    """Logits are divided by it; 0 means greedy (argmax, log-probs 0: evaluation only)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; keep 1 for RL (see the module docstring)."""
    max_new_tokens: int = 64
    """Completion tokens per row at most."""
    stop: tuple[str, ...] = ()
    """A row ends once its decoded completion contains one of these."""
    stop_at_eos: bool = True
    """A row ends at the tokenizer's EOS token."""
    weight_arrival: str = "finish"
    """"finish" (keep the old weights to the batch's end) or "interrupt" (swap and resume)."""

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature, 0.0, MAX_TEMPERATURE, low_open=False)
        _check_number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        value = self.max_new_tokens
        if isinstance(value, bool) or not isinstance(value, int):
            raise GenerationError(f"max_new_tokens must be an integer, got {value!r:.40}")
        if not 1 <= value <= MAX_NEW_TOKENS:
            raise GenerationError(
                f"max_new_tokens = {value} is out of range: use 1 to {MAX_NEW_TOKENS}"
            )
        _check_stops(self.stop)
        if not isinstance(self.stop_at_eos, bool):
            raise GenerationError(
                f"stop_at_eos must be true or false, got {self.stop_at_eos!r:.40}"
            )
        if self.weight_arrival not in WEIGHT_ARRIVAL:
            raise GenerationError(
                f"weight_arrival = {self.weight_arrival!r:.40} is not a mode: use one of "
                f"{', '.join(WEIGHT_ARRIVAL)}"
            )

    @property
    def stop_window(self) -> int:
        """Tokens of a row's tail decoded to look for a stop string."""
        return max((len(s.encode()) for s in self.stop), default=0) + 3


def _check_number(name: str, value: object, low: float, high: float, low_open: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GenerationError(f"{name} must be a number, got {value!r:.40}")
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise GenerationError(f"{name} = {value!r:.40} is out of range: use a value in {bound}")


def _check_stops(stops: object) -> None:
    if not isinstance(stops, tuple):
        raise GenerationError(f"stop must be a tuple of strings, got {type(stops).__name__}")
    if len(stops) > MAX_STOPS:
        raise GenerationError(f"{len(stops)} stop strings: use at most {MAX_STOPS}")
    for stop in stops:
        if not isinstance(stop, str) or not 1 <= len(stop) <= MAX_STOP_CHARS:
            raise GenerationError(
                f"stop string {stop!r:.40} is invalid: use non-empty strings of at most "
                f"{MAX_STOP_CHARS} characters"
            )


def sampling_log_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probabilities of the distribution the generator samples from ([..., V] -> [..., V]):
    softmax(logits / temperature) cut to its top-p nucleus (the smallest set of most likely
    tokens holding at least top_p of the mass) and renormalised; -inf outside the nucleus.
    temperature must be > 0 (greedy has no such distribution)."""
    scaled = logits.float() / temperature
    if top_p < 1.0:
        ordered, order = scaled.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        outside = probs.cumsum(dim=-1) - probs >= top_p  # mass before a token already >= top_p
        ordered = ordered.masked_fill(outside, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(-1, order, ordered)
    return scaled.log_softmax(dim=-1)


@dataclass
class Completions:
    """A finished batch: row i's completion is tokens[i, :lengths[i]]; past it tokens hold the
    pad id, logprobs and values 0 and versions -1. T = the longest completion."""

    tokens: np.ndarray  # int64 [N, T]
    logprobs: np.ndarray  # float32 [N, T], behaviour log-probs (module docstring)
    values: np.ndarray  # float32 [N, T], V(s_t) of the state each token was sampled in
    versions: np.ndarray  # int32 [N, T], the policy version that sampled each token
    lengths: np.ndarray  # int32 [N]
    texts: list[str]
    stop_reasons: list[str]  # one of STOP_REASONS per row


@dataclass
class Generation:
    """The state of one batch between steps. Tensors are indexed by batch row (N rows, columns
    up to max_new_tokens); the cache-side fields (`active` onwards) by unfinished row."""

    prompts: list[list[int]]
    version: int
    tokens: torch.Tensor
    logprobs: torch.Tensor
    values: torch.Tensor
    versions: torch.Tensor
    lengths: torch.Tensor
    reasons: list[str]
    swaps: int = 0
    active: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    """Batch rows still generating, in cache order."""
    cache: Any = None
    mask: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    next_position: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    next_logits: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    next_values: torch.Tensor = field(default_factory=lambda: torch.zeros(0))

    @property
    def done(self) -> bool:
        return not self.active.numel()

    def __repr__(self) -> str:
        return (
            f"<Generation rows={len(self.prompts)} running={self.active.numel()} "
            f"version={self.version} swaps={self.swaps}>"
        )


class Generator:
    """Samples completions from `policy` (its `.lm` a HF Qwen2/Llama causal LM)."""

    def __init__(
        self,
        policy: CausalLMPolicy,
        tokenizer: Tokenizer,
        cfg: SamplingConfig,
        seed: int | None = None,
    ) -> None:
        self.policy = policy
        self.tokenizer = tokenizer
        self.cfg = cfg
        config = policy.lm.config
        self.vocab = int(config.vocab_size)
        self.max_positions = int(config.max_position_embeddings)
        self.eos_id, self.pad_id = int(tokenizer.eos_id), int(tokenizer.pad_id)
        if not 0 <= self.pad_id < self.vocab:
            raise GenerationError(
                f"the tokenizer's pad id {self.pad_id} is outside the LM's vocabulary "
                f"({self.vocab}): use a tokenizer built for this model"
            )
        if cfg.stop_at_eos and not 0 <= self.eos_id < policy.action_dim:
            raise GenerationError(
                f"the tokenizer's EOS id {self.eos_id} can never be sampled (the policy emits ids "
                f"below {policy.action_dim}): use a tokenizer built for this model"
            )
        self.device = next(policy.parameters()).device
        self._rng = torch.Generator(device=self.device)
        if seed is None:
            self._rng.seed()  # a fresh non-deterministic seed, without touching torch's global one
        else:
            self._rng.manual_seed(seed)

    # -- the public steps ----------------------------------------------------------------

    def start(self, prompts: list[list[int]], version: int) -> Generation:
        """Prefill `prompts` (token ids, each non-empty) in one left-padded forward."""
        self._check_prompts(prompts)
        _check_version(version)
        rows, width = len(prompts), self.cfg.max_new_tokens
        state = Generation(
            prompts=[list(p) for p in prompts],
            version=version,
            tokens=torch.full((rows, width), self.pad_id, dtype=torch.long, device=self.device),
            logprobs=torch.zeros(rows, width, device=self.device),
            values=torch.zeros(rows, width, device=self.device),
            versions=torch.full((rows, width), -1, dtype=torch.int32, device=self.device),
            lengths=torch.zeros(rows, dtype=torch.long, device=self.device),
            reasons=[""] * rows,
        )
        self._prefill(state, torch.arange(rows, device=self.device), state.prompts)
        return state

    def step(self, state: Generation) -> bool:
        """Sample one token for every unfinished row, then one decode forward for those still
        going. False once every row has finished."""
        if state.done:
            return False
        with torch.no_grad():
            token, logprob = self._sample(state.next_logits)
            rows = state.active
            column = state.lengths[rows]
            state.tokens[rows, column] = token
            state.logprobs[rows, column] = logprob
            state.values[rows, column] = state.next_values
            state.versions[rows, column] = state.version
            state.lengths[rows] += 1
            ended = self._mark_ended(state, token)
            if bool(ended.any()):
                keep = (~ended).nonzero().squeeze(-1)
                state.cache.batch_select_indices(keep)
                state.active, state.mask = rows[keep], state.mask[keep]
                state.next_position, token = state.next_position[keep], token[keep]
            if not state.done:
                self._decode(state, token)
        return not state.done

    def swap(self, state: Generation, version: int) -> None:
        """Interrupt and resume: the policy now holds `version`'s weights; re-prefill every
        unfinished row's prompt + completion so far with them, and stamp later tokens `version`."""
        _check_version(version)
        if version < state.version:
            raise GenerationError(
                f"swap to version {version} is older than the batch's version {state.version}: "
                "weights only move forward"
            )
        state.version = version
        if state.done:
            return
        rows = state.active
        sequences = [
            state.prompts[row] + state.tokens[row, :length].tolist()
            for row, length in zip(rows.tolist(), state.lengths[rows].tolist())
        ]
        self._prefill(state, rows, sequences)
        state.swaps += 1

    def result(self, state: Generation) -> Completions:
        """The finished batch as numpy arrays, texts and stop reasons."""
        if not state.done:
            raise GenerationError(f"{state!r} is still running: call step() until it returns False")
        lengths = state.lengths.tolist()
        width = max(max(lengths), 1)
        tokens = state.tokens[:, :width].cpu().numpy()
        texts = [
            self._text(row[:length].tolist(), reason)
            for row, length, reason in zip(tokens, lengths, state.reasons)
        ]
        return Completions(
            tokens=tokens.astype(np.int64),
            logprobs=state.logprobs[:, :width].cpu().numpy().astype(np.float32),
            values=state.values[:, :width].cpu().numpy().astype(np.float32),
            versions=state.versions[:, :width].cpu().numpy().astype(np.int32),
            lengths=np.asarray(lengths, dtype=np.int32),
            texts=texts,
            stop_reasons=list(state.reasons),
        )

    def generate(self, prompts: list[list[int]], version: int) -> Completions:
        """start, step to the end, result: one batch on the current weights."""
        state = self.start(prompts, version)
        while self.step(state):
            pass
        return self.result(state)

    # -- the pieces ----------------------------------------------------------------------

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        if not isinstance(prompts, list) or not 1 <= len(prompts) <= MAX_BATCH:
            raise GenerationError(f"prompts must be a list of 1 to {MAX_BATCH} token-id lists")
        longest = self.max_positions - self.cfg.max_new_tokens
        for n, prompt in enumerate(prompts):
            if not isinstance(prompt, list) or not 1 <= len(prompt) <= longest:
                raise GenerationError(
                    f"prompt {n} must be a list of 1 to {longest} token ids (the LM's "
                    f"{self.max_positions} positions less max_new_tokens): shorten it"
                )
            if not all(type(t) is int and 0 <= t < self.vocab for t in prompt):
                raise GenerationError(
                    f"prompt {n} holds an id that is not an integer in [0, {self.vocab}): "
                    "encode it with this model's tokenizer"
                )

    def _prefill(self, state: Generation, rows: torch.Tensor, sequences: list[list[int]]) -> None:
        """A fresh cache for `rows` from one forward over their left-padded `sequences`."""
        from transformers import DynamicCache

        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(sequences), width, dtype=torch.long)
        for n, sequence in enumerate(sequences):  # building the input, once per prefill
            ids[n, width - len(sequence) :] = torch.tensor(sequence, dtype=torch.long)
            mask[n, width - len(sequence) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        state.active, state.mask = rows, mask
        state.cache = DynamicCache(config=self.policy.lm.config)
        state.next_position = mask.sum(-1)
        with torch.no_grad():
            self._forward(state, ids, positions)

    def _decode(self, state: Generation, token: torch.Tensor) -> None:
        ones = torch.ones(len(token), 1, dtype=state.mask.dtype, device=self.device)
        state.mask = torch.cat([state.mask, ones], dim=-1)
        positions = state.next_position[:, None]
        state.next_position = state.next_position + 1
        self._forward(state, token[:, None], positions)

    def _forward(self, state: Generation, ids: torch.Tensor, positions: torch.Tensor) -> None:
        out = self.policy.lm.get_decoder()(
            input_ids=ids,
            attention_mask=state.mask,
            position_ids=positions,
            cache=state.cache,
            use_cache=True,
        )
        hidden = out.last_hidden_state[:, -1]
        logits = self.policy.lm.get_output_embeddings()(hidden)[:, : self.policy.action_dim]
        head = self.policy.value_head
        state.next_logits = logits.float()
        state.next_values = head(hidden.to(head.weight.dtype)).squeeze(-1).float()

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token, behaviour log-prob) per row."""
        if self.cfg.temperature == 0:
            return logits.argmax(dim=-1), torch.zeros(len(logits), device=logits.device)
        logp = sampling_log_probs(logits, self.cfg.temperature, self.cfg.top_p)
        token = torch.multinomial(logp.exp(), 1, generator=self._rng)
        return token.squeeze(-1), logp.gather(-1, token).squeeze(-1)

    def _mark_ended(self, state: Generation, token: torch.Tensor) -> torch.Tensor:
        """Which active rows ended with `token` (bool [A]); their stop reasons are recorded."""
        rows = state.active
        eos = (
            token == self.eos_id
            if self.cfg.stop_at_eos
            else torch.zeros_like(token, dtype=torch.bool)
        )
        stop = self._stopped(state) & ~eos
        length = (state.lengths[rows] >= self.cfg.max_new_tokens) & ~eos & ~stop
        for reason, hits in (("eos", eos), ("stop", stop), ("length", length)):
            for row in rows[hits].tolist():  # only the rows that ended, once each
                state.reasons[row] = reason
        return eos | stop | length

    def _stopped(self, state: Generation) -> torch.Tensor:
        """bool [A]: the active rows whose decoded tail now holds a stop string."""
        rows = state.active
        if not self.cfg.stop:
            return torch.zeros(len(rows), dtype=torch.bool, device=self.device)
        window = min(self.cfg.stop_window, self.cfg.max_new_tokens)
        ends = state.lengths[rows, None]
        columns = ends - window + torch.arange(window, device=self.device)
        tails = state.tokens[rows[:, None], columns.clamp(min=0)].tolist()
        starts = (columns[:, 0].clamp(max=0).neg()).tolist()
        hits = [
            any(s in self.tokenizer.decode(tail[start:]) for s in self.cfg.stop)
            for tail, start in zip(tails, starts)
        ]
        return torch.tensor(hits, dtype=torch.bool, device=self.device)

    def _text(self, completion: list[int], reason: str) -> str:
        if reason == "eos":
            completion = completion[:-1]
        text = self.tokenizer.decode(completion)
        if reason == "stop":
            found = [i for s in self.cfg.stop if (i := text.find(s)) >= 0]
            text = text[: min(found, default=len(text))]
        return text


def _check_version(version: object) -> None:
    low, high = _VERSION_RANGE
    if isinstance(version, bool) or not isinstance(version, int) or not low <= version <= high:
        raise GenerationError(
            f"policy version {version!r:.40} is invalid: use an integer from {low} to {high}"
        )
