"""`LMPipelineConfig`: every setting of the language-model pipeline, checked before stage 1.

The defaults are the CPU recipe (byte-level Qwen2 models, a 0.42M-parameter teacher and a 0.25M
student, all four stages on 2 cores in 5-6.5 minutes on the hosts measured; docs/pipeline.md
has the measurements and why the models are smaller than the issue's "few million"). A GPU
host's recipe is the same table with bigger `[pipeline.teacher]`/`[pipeline.student]` sizes
and more steps: the stages run on its first GPU by default (`device`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from shoal.config import check_int, check_number
from shoal.envs.text_registry import TEXT_ENVS, is_text_env
from shoal.envs.tokenizer import BYTES
from shoal.envs.tokenizer_training import MAX_VOCAB, MIN_VOCAB
from shoal.errors import ConfigError
from shoal.learner.config import SEED_MAX
from shoal.learner.distill import FitConfig
from shoal.learner.models import ModelConfig
from shoal.learner.token_ppo import TokenRLConfig

STAGES = ("synthesis", "distillation", "rl", "evaluation")
BPE = "bpe"
"""`tokenizer` value: learn a BPE from the synthesised train split in stage 1."""
AUTO = "auto"
"""`device` value: the first CUDA device torch sees, else the CPU."""
DEVICE_SPEC = re.compile(r"auto|cpu|cuda(:[0-9]{1,3})?")


def qwen2_sizes(hidden: int, layers: int, heads: int, intermediate: int) -> ModelConfig:
    """A small Qwen2's sizes, half as many KV heads as heads (grouped-query attention)."""
    return ModelConfig(family="causal-lm", arch="qwen2", hidden_size=hidden, num_layers=layers,
                       num_heads=heads, num_kv_heads=max(1, heads // 2),
                       intermediate_size=intermediate, max_positions=512)  # fmt: skip


@dataclass(frozen=True)
class RLStageConfig:
    """Stage 3: asynchronous RL from the distilled student."""

    steps: int = 120
    """Learner updates; each consumes one batch of prompts_per_step × token.group_size samples."""
    prompts_per_step: int = 8
    max_staleness: int = 1
    """A batch is at most this many policy versions older than the learner that consumes it;
    the generation worker waits rather than run further ahead."""
    queue_size: int = 2
    """Finished batches waiting for the learner at most."""
    max_new_tokens: int = 48
    token: TokenRLConfig = field(
        default_factory=lambda: TokenRLConfig(
            algo="grpo", group_size=8, lr=1e-4, update_epochs=2, num_minibatches=2, kl_coef=0.05
        )
    )
    """The token update (algo grpo|ppo, group_size, temperature, lr, kl_coef, clip, ...).
    kl_coef 0.05 (KL to the frozen student) was chosen over 0, lr 1e-4 over 3e-5 and
    temperature 1 over 1.2 by validation pass@1 alone, with RL on the rl values
    (docs/pipeline.md); every margin was within one validation standard error."""
    val_tasks: int = 128
    """Validation tasks (the environment's "validation" pool split where it has one, else the
    train distribution; own seed, no prompt shared with train or any evaluation split;
    learner/lm_validation.py) the stage scores every `val_every` updates. 128 × `val_samples`
    4: one standard error of pass@1 0.015–0.04 as measured (docs/pipeline.md)."""
    val_every: int = 20
    """Updates between validation scores; the checkpoint with the best score is kept (the
    student if none beats it)."""
    val_samples: int = 4
    """Samples per validation task: validation pass@1 is unbiased from these."""
    val_temperature: float = 0.8
    """Sampling temperature of validation: the evaluation's, so both measure the same pass@1."""

    def __post_init__(self) -> None:
        check_int("pipeline.rl.steps", self.steps, 0, 1_000_000)
        check_int("pipeline.rl.prompts_per_step", self.prompts_per_step, 1, 4096)
        check_int("pipeline.rl.max_staleness", self.max_staleness, 0, 64)
        check_int("pipeline.rl.queue_size", self.queue_size, 1, 64)
        check_int("pipeline.rl.max_new_tokens", self.max_new_tokens, 1, 4096)
        check_int("pipeline.rl.val_tasks", self.val_tasks, 1, 100_000)
        check_int("pipeline.rl.val_every", self.val_every, 1, 1_000_000)
        check_int("pipeline.rl.val_samples", self.val_samples, 1, 1024)
        check_number("pipeline.rl.val_temperature", self.val_temperature, above=0, high=10)
        if self.prompts_per_step * self.token.group_size < self.token.num_minibatches:
            raise ConfigError(
                "pipeline.rl.prompts_per_step × token.group_size is fewer completions than "
                "token.num_minibatches: raise the first or lower the second"
            )


@dataclass(frozen=True)
class EvalStageConfig:
    """Stage 4: pass@k of the teacher, the distilled student and the RL policy."""

    tasks: int = 128
    """Tasks per split (held-out tasks, held-out families, perturbed held-out tasks, train
    distribution); 128 × `samples` 4: one standard error of pass@1 0.015–0.04 as measured."""
    samples: int = 4
    """Samples per task: pass@k for k up to this, by the unbiased estimator."""
    ks: tuple[int, ...] = (1, 4)
    temperature: float = 0.8
    max_new_tokens: int = 48

    def __post_init__(self) -> None:
        check_int("pipeline.eval.tasks", self.tasks, 1, 100_000)
        check_int("pipeline.eval.samples", self.samples, 1, 1024)
        if not self.ks or any(
            isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.samples
            for k in self.ks
        ):
            raise ConfigError(
                f"pipeline.eval.ks = {self.ks!r} is invalid: list integers from 1 to "
                f"pipeline.eval.samples ({self.samples})"
            )
        check_number("pipeline.eval.temperature", self.temperature, above=0, high=10)
        check_int("pipeline.eval.max_new_tokens", self.max_new_tokens, 1, 4096)


@dataclass(frozen=True)
class LMPipelineConfig:
    """The four stages for a text environment (CodeGen-v1, Countdown-v1, ...)."""

    env_id: str = "CodeGen-v1"
    seed: int = 0
    """Seeds stage 1's tasks and every model's initialisation and sampling."""
    tokenizer: str = BYTES
    """"bytes", "bpe" (a byte-level BPE learnt in stage 1 from the train split, at most
    `bpe_vocab` tokens, digits one token each: envs/tokenizer_training.py) or a local tokenizer
    directory (never downloaded; the two words are keywords, so a directory named bpe is
    "./bpe")."""
    bpe_vocab: int = 512
    """The learnt BPE's vocabulary at most; CodeGen-v1's train split fills 512."""
    train_tasks: int = 2000
    """Training tasks synthesised in stage 1: the SFT and distillation examples (RL draws its
    prompts from the environment's "rl" pool split where it has one, else from train)."""
    torch_threads: int = 1
    """torch intra-op threads for synthesis, RL and evaluation (restored after). One: the RL
    stage already runs two busy threads (generation and learning), and on a shared 2-core
    machine two intra-op threads per process spin against each other."""
    device: str = AUTO
    """Where stages 2-4 train and sample: "auto" (the first CUDA device torch sees, else the
    CPU), "cpu", "cuda" or "cuda:N". Resolved before stage 1, so a GPU that is not there is
    refused before any work; recorded in pipeline.json."""
    mixed_precision: bool = True
    """On a CUDA device, forward passes of SFT, distillation and the RL update run under bf16
    autocast (float32 weights, optimiser state and losses) where the GPU has bf16; on a CPU
    with bf16 instructions (AVX512-BF16, AMX) those of a model's SFT or distillation do where
    a few of its steps measured faster so (learner/precision_probe.py: the flags do not tell),
    and the RL update stays float32."""
    fit_threads: int = 2
    """torch intra-op threads for stage 2 (SFT and distillation), one thread of work whose
    matrix products split well: on 2 idle cores the default teacher's SFT step of 32 CodeGen-v1
    examples took 117-121 ms with 2 against 197-227 ms with 1, and stage 2 of the default run
    283 s against 464 s, with the same results (docs/pipeline.md). On a machine other work keeps
    busy, set 1 (a 0.5M-parameter step took 9x longer with 2 there: the threads spin waiting for
    each other)."""
    teacher: ModelConfig = field(default_factory=lambda: qwen2_sizes(128, 2, 4, 336))
    """0.42M parameters: past the copying plateau in 625 steps on one CPU core."""
    student: ModelConfig = field(default_factory=lambda: qwen2_sizes(96, 2, 4, 256))
    sft: FitConfig = field(default_factory=lambda: FitConfig(epochs=16, lr=3e-3, batch_size=32))
    """How the teacher learns the reference solutions. 16 epochs (1,008 steps), not the 10 that
    first passed the copying plateau: at 10 its held-out pass@1 swung from 0.09 to 0.47 with
    the seed, at 16 its train CE is under 0.001 (docs/pipeline.md)."""
    distill: FitConfig = field(default_factory=lambda: FitConfig(epochs=16, lr=3e-3, batch_size=32))
    """How the student learns the teacher's logits (temperature, ce_weight). 16 epochs: at 8
    the student solved only 0.68-0.89 of fresh train-distribution tasks, and RL from it gained
    held-out pass@1 beyond noise in 1 of 3 seeds; at 16 it solves 0.99 (docs/pipeline.md)."""
    rl: RLStageConfig = field(default_factory=RLStageConfig)
    eval: EvalStageConfig = field(default_factory=EvalStageConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.env_id, str) or not is_text_env(self.env_id):
            raise ConfigError(
                f"pipeline.env_id = {self.env_id!r:.60} is not a text environment: use one of "
                f"{', '.join(sorted(TEXT_ENVS))}"
            )
        check_int("pipeline.seed", self.seed, 0, SEED_MAX)
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ConfigError(
                f"pipeline.tokenizer = {self.tokenizer!r} is invalid: use bytes or a directory"
            )
        check_int("pipeline.bpe_vocab", self.bpe_vocab, MIN_VOCAB, MAX_VOCAB)
        check_int("pipeline.train_tasks", self.train_tasks, 1, 1_000_000)
        check_int("pipeline.torch_threads", self.torch_threads, 1, 1024)
        check_int("pipeline.fit_threads", self.fit_threads, 1, 1024)
        if not isinstance(self.device, str) or not DEVICE_SPEC.fullmatch(self.device):
            raise ConfigError(
                f"pipeline.device = {self.device!r} is invalid: use auto, cpu, cuda or cuda:N"
            )
        for name in ("teacher", "student"):
            if getattr(self, name).family != "causal-lm":
                raise ConfigError(
                    f"pipeline.{name}.family must be causal-lm (the pipeline trains token policies)"
                )
            _check_unused(name, getattr(self, name))


UNUSED_MODEL_KEYS = {
    "vocab_size": "the vocabulary is the tokenizer's (pipeline.tokenizer)",
    "hidden": "it sizes the MLP family; a causal LM's width is hidden_size",
    "channels": "it sizes the CNN family",
    "options": "it configures a custom family",
}
"""`[model]` keys a pipeline's causal LMs never read: setting one is a mistake to point out,
not a value to drop silently."""


def _check_unused(name: str, model: ModelConfig) -> None:
    default = ModelConfig()
    for key, why in UNUSED_MODEL_KEYS.items():
        if getattr(model, key) != getattr(default, key):
            raise ConfigError(f"pipeline.{name}.{key} is not used ({why}): remove it")
