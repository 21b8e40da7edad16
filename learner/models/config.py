"""`ModelConfig`: the job TOML's `[model]` section, which family of policy to build and its sizes.

```toml
[model]
family = "causal-lm"      # "auto" | "mlp" | "cnn" | "multi" | "causal-lm" | "package.module:factory"
arch = "qwen2"            # or "llama"
hidden_size = 256
num_layers = 4
```

Every key is checked here, once, so a bad job file is refused with the key, the value and what
is valid before any rank starts. The size bounds are the ones a spec read back from a checkpoint
is held to as well (`LIMITS`), so a job can never write a checkpoint it could not read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from shoal.config import check_int
from shoal.envs.tokenizer import VOCAB_LIMITS
from shoal.errors import ConfigError

BUILTIN_FAMILIES = ("auto", "mlp", "cnn", "multi", "causal-lm")
ARCHS = ("qwen2", "llama")
FACTORY_RE = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
"""A custom family: `package.module:factory`, as environment entry points are written."""

LIMITS: dict[str, tuple[int, int]] = {
    "hidden": (1, 1 << 16),
    "channels": (1, 4096),
    "vocab_size": VOCAB_LIMITS,
    "hidden_size": (1, 1 << 16),
    "num_layers": (1, 1024),
    "num_heads": (1, 1024),
    "num_kv_heads": (1, 1024),
    "intermediate_size": (1, 1 << 20),
    "max_positions": (1, 1 << 24),
}
"""Inclusive (low, high) for every integer size: far above any model that fits 512 GPUs, far
below what would overflow an allocation size before torch could refuse it."""
MAX_LAYERS = 64
"""Most entries in `hidden` or `channels` (each one is a layer)."""
MAX_OPTIONS = 64
"""Most keys in `options` (a custom factory's keyword arguments)."""


@dataclass(frozen=True)
class ModelConfig:
    """The policy's family and sizes; keys of other families are ignored by the one chosen."""

    family: str = "auto"
    """auto: multi for structured observations (Dict/Tuple/Text/Discrete, packed), cnn for
    image observations (a 3-D uint8 Box), else mlp; causal-lm is chosen explicitly;
    `package.module:factory` builds a custom model."""
    hidden: tuple[int, ...] = (64, 64)
    """mlp and multi: widths of the policy's and the value's hidden layers (multi: after the
    concatenated part encoders); cnn: dense layers after the convolutions."""
    channels: tuple[int, ...] = (32, 64, 64)
    """cnn: output channels of each convolution (Nature-CNN kernels 8/4, 4/2, 3/1)."""
    arch: str = "qwen2"
    """causal-lm: the transformers architecture built from the sizes below."""
    path: str = ""
    """causal-lm: a local directory with a `save_pretrained` model (loaded instead of built;
    nothing is ever downloaded)."""
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_positions: int = 512
    options: dict[str, Any] = field(default_factory=dict)
    """A custom family's keyword arguments: factory(observation_space, action_space, **options)."""

    def __post_init__(self) -> None:
        _check_family(self.family)
        for key in ("hidden", "channels"):
            _check_widths(key, getattr(self, key))
        if self.arch not in ARCHS:
            raise ConfigError(
                f"model.arch = {self.arch!r} is invalid: use one of {', '.join(map(repr, ARCHS))}"
            )
        if not isinstance(self.path, str):
            raise ConfigError(f"model.path = {self.path!r} is invalid: use a directory path")
        for key in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_positions",
        ):
            check_int(f"model.{key}", getattr(self, key), *LIMITS[key])
        _check_heads(self.hidden_size, self.num_heads, self.num_kv_heads)
        _check_options(self.options)


def _check_family(family: object) -> None:
    if isinstance(family, str) and (family in BUILTIN_FAMILIES or FACTORY_RE.match(family)):
        return
    raise ConfigError(
        f"model.family = {family!r} is invalid: use one of "
        f"{', '.join(map(repr, BUILTIN_FAMILIES))} or 'package.module:factory' for your own"
    )


def _check_widths(key: str, widths: object) -> None:
    low, high = LIMITS[key]
    if (
        not isinstance(widths, tuple)
        or not 1 <= len(widths) <= MAX_LAYERS
        or any(
            isinstance(w, bool) or not isinstance(w, int) or not low <= w <= high for w in widths
        )
    ):
        raise ConfigError(
            f"model.{key} = {widths!r} is invalid: use a list of 1 to {MAX_LAYERS} integers "
            f"from {low} to {high}"
        )


def _check_heads(hidden_size: int, num_heads: int, num_kv_heads: int) -> None:
    if hidden_size % num_heads:
        raise ConfigError(
            f"model.num_heads = {num_heads} is invalid: it must divide model.hidden_size "
            f"({hidden_size})"
        )
    if num_heads % num_kv_heads:
        raise ConfigError(
            f"model.num_kv_heads = {num_kv_heads} is invalid: it must divide model.num_heads "
            f"({num_heads})"
        )


def _check_options(options: object) -> None:
    if (
        not isinstance(options, dict)
        or len(options) > MAX_OPTIONS
        or not all(isinstance(k, str) and k.isidentifier() for k in options)
    ):
        raise ConfigError(
            f"model.options = {options!r} is invalid: use a table of at most {MAX_OPTIONS} "
            "keyword arguments for the custom factory"
        )
