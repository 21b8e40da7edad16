"""shoal's environment ecosystem: the interfaces, the registry and the built-ins.

`make("cartpole")` gives one environment, `make_vector("CartPole-v1", 4096)` a batch of them
stepped as one array operation; `gym:<id>` reaches every installed Gymnasium environment.
"""

from shoal.envs.base import BaseEnvironment
from shoal.envs.builtin import register_builtins
from shoal.envs.errors import (
    DeprecatedEnvironment,
    EnvError,
    InvalidAction,
    InvalidEnvironmentId,
    RegistrationError,
    UnknownEnvironment,
)
from shoal.envs.plugins import PluginError, load_plugins
from shoal.envs.registry import EnvSpec, Registry, default_registry, list, make, register, spec
from shoal.envs.vector import VectorEnvironment, VectorRunner, VectorStep, make_vector

register_builtins(default_registry)
load_plugins()  # after the built-ins: a plugin may build on them, never shadow them

__all__ = [
    "BaseEnvironment",
    "DeprecatedEnvironment",
    "EnvError",
    "EnvSpec",
    "InvalidAction",
    "InvalidEnvironmentId",
    "PluginError",
    "RegistrationError",
    "Registry",
    "UnknownEnvironment",
    "VectorEnvironment",
    "VectorRunner",
    "VectorStep",
    "default_registry",
    "list",
    "make",
    "make_vector",
    "register",
    "spec",
]
