"""`CausalLMPolicy`: a Hugging Face causal language model with a value head, as a PPO policy.

The observation is a fixed-length sequence of token ids (int64 [B, L]); the action space is
Discrete(n) with n <= the vocabulary: the policy's logits are the first n logits of the last
position, and a linear value head reads the last position's hidden state. Only the last
position goes through the LM head, so a step costs one decoder pass, not B×L×vocab logits.
The token update (learner/token_ppo.py) scores whole completions with the same `forward` in
its token form (`completion_outputs`: every completion token's log-prob, entropy and value
from one decoder pass), so a DDP or FSDP2 wrapper's hooks run for it as for a step.

The LM is built from `Qwen2Config`/`LlamaConfig` with the `[model]` sizes, or loaded with
`from_pretrained(path, local_files_only=True)`: nothing is ever downloaded. Parameters are kept
in float32 (mixed precision is the sharded learner's job). `transformers` is the optional `lm`
extra and is imported only when this family is used.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from shoal import boundedjson
from shoal.files import UnreadableFile, read_limited
from shoal.learner.errors import PolicyError
from shoal.learner.models.base import PolicyModel
from shoal.learner.models.config import LIMITS, ModelConfig
from shoal.learner.models.lm_files import LMWeights

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

ARCH_CONFIGS = {"qwen2": "Qwen2Config", "llama": "LlamaConfig"}
"""model_type -> the transformers config class this family builds (and accepts in a spec)."""
_SIZE_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "intermediate_size": "intermediate_size",
    "max_position_embeddings": "max_positions",
}
"""HF config key -> the ModelConfig key whose bounds it is held to."""
_REFUSED_KEYS = ("auto_map", "quantization_config")
"""Config keys that would make transformers import code or change the weights' meaning."""
POLICY_JSON = "shoal_policy.json"
MAX_CONFIG_BYTES = 2**20
"""A config.json is a few kB; a bigger one is refused unread."""
MAX_CONFIG_DEPTH = 8
"""A config.json nests a rope_scaling table or a list of layer types: two or three levels."""
VALUE_HEAD_FILE = "value_head.safetensors"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise PolicyError(
            "the causal-lm family needs transformers: pip install 'shoal[lm]'"
        ) from exc
    return transformers


class CausalLMPolicy(PolicyModel):
    """The causal-lm family: token-id observations, Discrete(n <= vocab) actions, a value head."""

    family = "causal-lm"

    def __init__(
        self,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
        lm: PreTrainedModel,
    ) -> None:
        super().__init__(observation_space, action_space, np.int64)
        config = lm.config
        vocab = int(config.vocab_size)
        length, highest = _token_layout(observation_space)
        if not self.discrete or not 1 <= self.action_dim <= vocab:
            raise PolicyError(
                f"the causal-lm family needs Discrete(n) actions with n <= the vocabulary "
                f"({vocab}), got {action_space}"
            )
        if highest >= vocab or length > int(config.max_position_embeddings):
            raise PolicyError(
                f"observations {observation_space} do not fit the LM: token ids must be < "
                f"{vocab} and sequences at most {config.max_position_embeddings} long"
            )
        self.lm = lm
        self.value_head = nn.Linear(int(config.hidden_size), 1)
        self._init_value_head()
        self.source: LMWeights | None = None
        """Where a deferred build reads its values (`deferred` from a directory), else None."""

    def _init_value_head(self) -> None:
        nn.init.normal_(self.value_head.weight, std=1.0 / (self.value_head.in_features + 1))
        nn.init.zeros_(self.value_head.bias)

    # -- building ------------------------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        cfg: ModelConfig,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
    ) -> CausalLMPolicy:
        """A fresh LM of `cfg.arch` with `cfg`'s sizes, or `cfg.path` loaded when it is set."""
        if cfg.path:
            return cls.from_pretrained(Path(cfg.path), observation_space, action_space)
        return cls(observation_space, action_space, _lm_from_config(_sized_config(cfg)))

    @classmethod
    def deferred(
        cls,
        cfg: ModelConfig,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
    ) -> CausalLMPolicy:
        """The policy `from_config` builds, on the meta device: shapes only, every value drawn
        (from sizes, `init_module`) once the module has storage, or read from `cfg.path`'s
        safetensors (`source`, checked against the LM here) once it is held. Tied embeddings
        (one parameter, listed once in the files) stay tied (learner/materialize.py)."""
        weights: LMWeights | None = None
        if cfg.path:
            config = pretrained_config(Path(cfg.path))
            weights = LMWeights(Path(cfg.path), aside=frozenset({VALUE_HEAD_FILE}))
        else:
            config = _sized_config(cfg)
        with torch.device("meta"):
            policy = cls(observation_space, action_space, _lm_from_config(config))
        if weights is not None:
            weights.check(policy.lm)
            policy.source = weights
        return policy

    @classmethod
    def from_pretrained(
        cls,
        path: Path,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
    ) -> CausalLMPolicy:
        """Load a `save_pretrained` directory from local disk (never the Hub)."""
        from safetensors import SafetensorError

        config = pretrained_config(path)
        with torch.device("meta"):  # what the files must hold, before transformers reads them
            LMWeights(path, aside=frozenset({VALUE_HEAD_FILE})).check(_lm_from_config(config))
        try:
            lm = _transformers().AutoModelForCausalLM.from_pretrained(
                path, config=config, local_files_only=True, dtype=torch.float32
            )
        except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
            raise PolicyError(f"cannot load the LM in {str(path)!r}: {exc}") from exc
        lm.config.use_cache = False
        policy = cls(observation_space, action_space, lm)
        _load_value_head_from(policy.value_head, path)
        return policy

    @classmethod
    def from_spec(
        cls,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
        spec: Mapping[str, Any],
    ) -> CausalLMPolicy:
        lm_config = spec.get("lm_config")
        if not isinstance(lm_config, Mapping):
            raise PolicyError("causal-lm spec: lm_config must be an object")
        config = _config_from_dict(dict(lm_config))
        return cls(observation_space, action_space, _lm_from_config(config))

    def family_spec(self) -> dict[str, Any]:
        return {"lm_config": json.loads(self.lm.config.to_json_string(use_diff=False))}

    # -- the network ---------------------------------------------------------------------

    def prepare(self, obs: torch.Tensor) -> torch.Tensor:
        return obs.to(torch.long)

    def forward(
        self,
        obs: torch.Tensor,
        actions: torch.Tensor | None = None,
        *,
        prompt_lengths: torch.Tensor | None = None,
        completion_lengths: torch.Tensor | None = None,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The training forward in two forms, both through `nn.Module.__call__`, where a DDP
        or FSDP2 wrapper reduces gradients and gathers shards: given `actions`, PolicyModel's
        step form (one action per observation); given `prompt_lengths` and
        `completion_lengths` [N], the token form (`completion_outputs` of `obs` as sequences)."""
        if prompt_lengths is not None and completion_lengths is not None:
            return self.completion_outputs(obs, prompt_lengths, completion_lengths, temperature)
        if actions is None:
            raise PolicyError(
                "CausalLMPolicy.forward needs actions (the step form) or prompt_lengths and "
                "completion_lengths (the token form)"
            )
        return super().forward(obs, actions)

    def completion_outputs(
        self,
        tokens: torch.Tensor,
        prompt_lengths: torch.Tensor,
        completion_lengths: torch.Tensor,
        temperature: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probs and entropies of softmax(logits / temperature) at every completion token
        of the right-padded sequences `tokens` [N, L], and V of the state each was sampled in,
        flat [K] in row-major order, with ONE decoder pass (causal attention: the padding
        after a row's end is never attended to). The LM and value heads run only at the
        completion positions: an [N, L, vocab] logit tensor would be most of the memory.
        Position i is predicted from hidden state i − 1, so prompts need >= 1 token."""
        ends = (prompt_lengths.long() + completion_lengths.long()).max()
        tokens = tokens[:, : int(ends)].to(self.device)
        mask = completion_mask(
            prompt_lengths.to(tokens.device), completion_lengths.to(tokens.device), tokens.shape[1]
        )
        hidden = self.lm.get_decoder()(input_ids=tokens, use_cache=False).last_hidden_state
        at = mask[:, 1:]
        states = hidden[:, :-1][at]  # [K, H]: the state before each completion token
        logits = self.lm.get_output_embeddings()(states)[:, : self.action_dim]
        log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
        logp = log_probs.gather(-1, tokens[:, 1:][at].unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        values = self.value_head(states.to(self.value_head.weight.dtype)).squeeze(-1).float()
        return logp, entropy, values

    def _last_hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.lm.get_decoder()(input_ids=tokens, use_cache=False)
        return out.last_hidden_state[:, -1]

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self._last_hidden(x)
        logits = self.lm.get_output_embeddings()(hidden)[:, : self.action_dim]
        values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)
        return logits, values

    def values_of(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self._last_hidden(x)
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)

    def shard_units(self) -> list[nn.Module]:
        """The input embeddings, each decoder layer, then the LM head: with a large vocabulary
        the embeddings and the head are the biggest single modules, so as units of their own
        neither is ever whole on a rank next to the other (at build or in a gather). Tied
        embeddings are one parameter, which must stay in one unit: then the root holds both."""
        layers = list(self.lm.get_decoder().layers)
        embed, head = self.lm.get_input_embeddings(), self.lm.get_output_embeddings()
        if head.weight is embed.weight:
            return layers
        return [embed, *layers, head]

    def init_module(self, module: nn.Module) -> None:
        """The value head as `__init__` draws it (or as the directory's value head file holds
        it); an LM module's parameters drawn by transformers' own `_init_weights` (normal(0,
        initializer_range) weights, unit norms), which is what `post_init` applies to an eager
        build, or left for `source.load_into` when the policy was deferred from a directory;
        buffers (the rotary frequencies) recomputed by `_init_weights` either way."""
        if module is self.value_head:
            self._init_value_head()
            if self.source is not None:
                _load_value_head_from(self.value_head, self.source.directory)
        elif self.source is None or next(module.parameters(recurse=False), None) is None:
            self.lm._init_weights(module)  # sizes only, or buffers only (rotary frequencies)

    def enable_activation_checkpointing(self) -> None:
        """transformers' own checkpointing of the decoder layers (non-reentrant); its name
        changed in transformers 5 (`gradient_checkpointing_enable` before)."""
        kwargs = {"use_reentrant": False}
        if hasattr(self.lm, "activation_checkpointing_enable"):
            self.lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            self.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def completion_mask(
    prompt_lengths: torch.Tensor, completion_lengths: torch.Tensor, length: int
) -> torch.Tensor:
    """bool [N, length]: True at each row's completion positions."""
    position = torch.arange(length, device=prompt_lengths.device)[None, :]
    start = prompt_lengths.long()[:, None]
    return (position >= start) & (position < start + completion_lengths.long()[:, None])


def export_pretrained(model: PolicyModel, directory: Path) -> Path:
    """Write a causal-lm policy as a `save_pretrained` directory transformers (or an inference
    server) loads, plus its value head and a JSON naming the policy spec; returns `directory`."""
    if not isinstance(model, CausalLMPolicy):
        raise PolicyError(
            f"only causal-lm policies export as a save_pretrained directory; this one is "
            f"{model.family or 'custom'}: use its checkpoint instead"
        )
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    _transformers().utils.logging.disable_progress_bar()  # one line of ours says it is done
    model.lm.save_pretrained(directory, safe_serialization=True)
    head = {k: v.detach().cpu().contiguous() for k, v in model.value_head.state_dict().items()}
    save_file(head, str(directory / VALUE_HEAD_FILE))
    (directory / POLICY_JSON).write_text(json.dumps(model.spec(), indent=1))
    return directory


def _sized_config(cfg: ModelConfig) -> PretrainedConfig:
    config_class = getattr(_transformers(), ARCH_CONFIGS[cfg.arch])
    return config_class(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=False,
        use_cache=False,
    )


def pretrained_config(path: Path) -> PretrainedConfig:
    """A `save_pretrained` directory's config.json, read bounded and checked as a spec's is
    before transformers sees it (never the Hub, never code named in it)."""
    file = path / "config.json"
    if not file.exists():
        raise PolicyError(
            f"model.path = {str(path)!r} is not a save_pretrained directory (no config.json): "
            "copy the model there first (e.g. `huggingface-cli download <id> --local-dir "
            "<dir>`), shoal never downloads"
        )
    try:
        values = boundedjson.loads(
            read_limited(file, MAX_CONFIG_BYTES),
            max_bytes=MAX_CONFIG_BYTES,
            max_depth=MAX_CONFIG_DEPTH,
        )
    except UnreadableFile as exc:
        raise PolicyError(f"the LM config: {exc}") from None
    except boundedjson.JsonRefused as exc:
        raise PolicyError(f"{str(file)!r} is not a JSON config: {exc}") from None
    if not isinstance(values, dict):
        raise PolicyError(f"{str(file)!r} is not a JSON object of config keys")
    config = _config_from_dict(values, str(file))
    config.use_cache = False
    return config


def _load_value_head_from(head: nn.Linear, directory: Path) -> None:
    """The directory's value head file into `head`, when there is one."""
    path = directory / VALUE_HEAD_FILE
    if not path.is_file():
        return
    try:
        head.load_state_dict(_load_value_head(path))
    except RuntimeError as exc:
        raise PolicyError(f"{str(path)!r} does not fit this LM's value head: {exc}") from exc


def _lm_from_config(config: PretrainedConfig) -> PreTrainedModel:
    model = _transformers().AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model


def _config_from_dict(
    values: dict[str, Any], where: str = "causal-lm spec: lm_config"
) -> PretrainedConfig:
    """A Qwen2/Llama config from a spec or a config.json (hostile: checked first)."""
    from huggingface_hub.errors import StrictDataclassError

    _check_lm_config(values)
    config_class = getattr(_transformers(), ARCH_CONFIGS[values["model_type"]])
    kwargs = {k: v for k, v in values.items() if k not in ("model_type", "transformers_version")}
    try:
        return config_class(**kwargs)
    except (TypeError, ValueError, KeyError, AttributeError, StrictDataclassError) as exc:
        raise PolicyError(f"{where} is not a valid {values['model_type']} config: {exc}") from exc


def _check_lm_config(values: Mapping[str, Any]) -> None:
    model_type = values.get("model_type")
    if model_type not in ARCH_CONFIGS:
        raise PolicyError(
            f"causal-lm: model_type {model_type!r:.40} is not supported; use one of "
            f"{', '.join(ARCH_CONFIGS)}"
        )
    for key in values:
        if (
            not isinstance(key, str)
            or key in _REFUSED_KEYS
            or (key.startswith("_") and key != "_name_or_path")
        ):
            raise PolicyError(f"causal-lm: the LM config key {key!r:.40} is not accepted")
    for key, ours in _SIZE_KEYS.items():
        value = values.get(key)
        low, high = LIMITS[ours]
        if key == "num_key_value_heads" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise PolicyError(
                f"causal-lm: the LM config's {key} = {value!r:.40} is invalid: use an integer "
                f"from {low} to {high}"
            )


def _token_layout(space: spaces.Space[Any]) -> tuple[int, int]:
    """(sequence length, highest token id) of an integer Box or MultiDiscrete of rank 1."""
    if (
        isinstance(space, spaces.Box)
        and space.dtype is not None
        and space.dtype.kind in "iu"
        and len(space.shape) == 1
        and int(space.low.min()) >= 0
    ):
        return int(space.shape[0]), int(space.high.max())
    if (
        isinstance(space, spaces.MultiDiscrete)
        and space.nvec.ndim == 1
        and int(space.start.min()) >= 0
    ):
        return int(space.nvec.shape[0]), int((space.start + space.nvec - 1).max())
    raise PolicyError(
        f"the causal-lm family needs token-id observations (a 1-D integer Box or MultiDiscrete "
        f"with ids >= 0), got {space}"
    )


def _load_value_head(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (OSError, ValueError, SafetensorError) as exc:
        raise PolicyError(f"cannot read the value head {str(path)!r}: {exc}") from exc
