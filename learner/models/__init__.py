"""Policy model families shared by rollout actors and learners (see docs/models.md).

`build_model(ModelConfig, observation_space, action_space)` builds the `[model]` section's
family; `model_from_spec(spec)` rebuilds a checkpoint's; `export_pretrained` writes a causal-lm
policy as a transformers directory.
"""

from shoal.learner.models.base import PolicyModel
from shoal.learner.models.causal_lm import CausalLMPolicy, export_pretrained
from shoal.learner.models.cnn import CNNPolicy
from shoal.learner.models.config import ModelConfig
from shoal.learner.models.mlp import MLPPolicy
from shoal.learner.models.registry import build_model, model_from_spec
from shoal.learner.models.spaces import space_from_json, space_to_json

__all__ = [
    "CNNPolicy",
    "CausalLMPolicy",
    "MLPPolicy",
    "ModelConfig",
    "PolicyModel",
    "build_model",
    "export_pretrained",
    "model_from_spec",
    "space_from_json",
    "space_to_json",
]
