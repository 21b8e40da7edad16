"""Registration of shoal's built-in environments (entry points are strings: nothing is imported
until an environment is made).
"""

from __future__ import annotations

from shoal.envs.registry import Registry

_NUMPY = ("numpy", "shoal")


def register_builtins(registry: Registry) -> None:
    """Add every built-in to `registry`; called once for the default registry on import."""
    registry.register(
        "CartPole-v1",
        "shoal.envs.cartpole:make_single",
        vector_entry_point="shoal.envs.cartpole:make_batched",
        max_episode_steps=500,
        requirements=_NUMPY,
        description="Gymnasium's CartPole-v1 dynamics, batched in numpy",
    )
