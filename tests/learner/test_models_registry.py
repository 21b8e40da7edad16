"""`[model]` from TOML (every key checked, naming model.<key>), family selection, and custom
families by import path: built, stored in the spec, rebuilt, and refused when they are not a
PolicyModel or cannot be imported."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from gymnasium import spaces

from shoal.config import load, parse_toml
from shoal.errors import ConfigError
from shoal.learner.errors import PolicyError
from shoal.learner.models import MLPPolicy, ModelConfig, build_model, model_from_spec

VECTOR = spaces.Box(-1.0, 1.0, (4,), np.float32)


@dataclass(frozen=True)
class Job:
    """A job section holding [model], as the training config does."""

    model: ModelConfig = field(default_factory=ModelConfig)


def from_toml(text: str, environ: dict[str, str] | None = None) -> ModelConfig:
    return load(Job, parse_toml(textwrap.dedent(text), source="job.toml"), source="job.toml",
                environ=environ or {}).model  # fmt: skip


def test_model_section_fills_model_config_from_toml():
    cfg = from_toml(
        """
        [model]
        family = "causal-lm"
        arch = "llama"
        hidden = [128, 128]
        channels = [16, 32]
        hidden_size = 96
        num_heads = 6
        num_kv_heads = 3
        options = { a = 1 }
        """
    )
    assert cfg.family == "causal-lm"
    assert cfg.arch == "llama"
    assert cfg.hidden == (128, 128)
    assert cfg.channels == (16, 32)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (96, 6, 3)
    assert cfg.options == {"a": 1}
    assert from_toml("") == ModelConfig()
    override = from_toml("[model]\nfamily = 'mlp'\n", {"SHOAL_MODEL_HIDDEN": "8,8"})
    assert override.hidden == (8, 8)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("family = 'transformer'", "model.family = 'transformer' is invalid"),
        ("family = 'no colon'", "model.family"),
        ("hidden = []", "model.hidden = () is invalid"),
        ("hidden = [0]", "model.hidden = (0,) is invalid"),
        ("channels = [100000]", "model.channels"),
        ("arch = 'gpt2'", "model.arch = 'gpt2' is invalid"),
        ("vocab_size = 1", "model.vocab_size = 1 is invalid"),
        ("num_layers = 0", "model.num_layers = 0 is invalid"),
        ("max_positions = 100000000", "model.max_positions"),
        ("hidden_size = 30", "model.num_heads = 4 is invalid: it must divide model.hidden_size"),
        ("num_kv_heads = 3", "model.num_kv_heads = 3 is invalid"),
        ("hidden_size = true", "model.hidden_size = True is invalid"),
        ("bogus = 1", "unknown key"),
    ],
)
def test_every_model_key_is_checked(body, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_toml(f"[model]\n{body}\n")
    with pytest.raises(ConfigError, match=r"model\.options"):
        ModelConfig(options={"not an identifier": 1})


FACTORY = """
import numpy as np
from torch import nn
from shoal.learner.models import MLPPolicy


class Wide(MLPPolicy):
    family = "wide"


def make(observation_space, action_space, width=8):
    return Wide(observation_space, action_space, hidden=(width,))


def not_a_policy(observation_space, action_space):
    return nn.Linear(2, 2)
"""


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    (tmp_path / "shoal_test_factory.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "shoal_test_factory"


def test_a_custom_family_builds_by_import_path_and_rebuilds_from_its_spec(factory_module):
    cfg = ModelConfig(family=f"{factory_module}:make", options={"width": 12})
    torch.manual_seed(0)
    policy = build_model(cfg, VECTOR, spaces.Discrete(3))
    assert isinstance(policy, MLPPolicy)
    assert policy.hidden == (12,)
    spec = policy.spec()
    assert spec["family"] == f"{factory_module}:make"
    assert spec["options"] == {"width": 12}
    clone = model_from_spec(spec)
    assert type(clone).__name__ == "Wide"
    assert clone.spec() == spec
    clone.set_weights(policy.get_weights())
    obs = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(clone.value(obs), policy.value(obs))


def test_custom_families_that_are_not_policy_models_or_missing_are_refused(factory_module):
    for family, message in (
        (f"{factory_module}:not_a_policy", "returned Linear, not a PolicyModel"),
        (f"{factory_module}:absent", "has no callable 'absent'"),
        ("shoal_no_such_module_here:make", "cannot import 'shoal_no_such_module_here'"),
    ):
        with pytest.raises(PolicyError, match=message):
            build_model(ModelConfig(family=family), VECTOR, spaces.Discrete(3))
    spec = build_model(ModelConfig(), VECTOR, spaces.Discrete(3)).spec()
    with pytest.raises(PolicyError, match="family 'nope' is unknown"):
        model_from_spec({**spec, "family": "nope"})
    with pytest.raises(PolicyError, match="options must be an object"):
        model_from_spec({**spec, "family": f"{factory_module}:make", "options": [1]})
