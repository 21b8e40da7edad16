"""Registration of shoal's built-in environments (entry points are strings: nothing is imported
until an environment is made).
"""

from __future__ import annotations

from shoal.envs.registry import Registry

_NUMPY = ("numpy", "shoal")

# name -> (kwargs, description); the Train and HeldOut families share no layout seed.
_GRIDWORLDS: dict[str, tuple[dict[str, object], str]] = {
    "GridWorld-v1": ({}, "8x8, one key and door, one layout (kwargs change size, keys, walls)"),
    "GridWorld-Empty-v1": ({"num_keys": 0, "wall_density": 0.0}, "8x8 open room"),
    "GridWorld-TwoKeys-v1": ({"size": 12, "num_keys": 2}, "12x12, three rooms, two keys"),
    "GridWorld-Train-v1": (
        {"wall_density": 0.15, "num_layouts": 200},
        "8x8, one key, 200 training layouts (seeds 0..199)",
    ),
    "GridWorld-HeldOut-v1": (
        {"wall_density": 0.15, "num_layouts": 200, "first_seed": 1_000_000},
        "8x8, one key, 200 held-out layouts (seeds 1000000..1000199)",
    ),
}


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
    registry.register(
        "Acrobot-v1",
        "shoal.envs.acrobot:make_single",
        vector_entry_point="shoal.envs.acrobot:make_batched",
        max_episode_steps=500,
        requirements=_NUMPY,
        description="Gymnasium's Acrobot-v1 dynamics, batched in numpy",
    )
    for env_id, (kwargs, description) in _GRIDWORLDS.items():
        registry.register(
            env_id,
            "shoal.envs.gridworld:make_single",
            vector_entry_point="shoal.envs.gridworld:make_batched",
            kwargs=kwargs,
            max_episode_steps=256,
            requirements=_NUMPY,
            description=description,
        )
    registry.register(
        "CodeExec-v1",
        "shoal.envs.code_env:CodeExecEnv",
        requirements=("numpy",),
        description="write a Python function for one of 24 small tasks; reward = tests passed",
    )
    registry.register(
        "CodeChoice-v1",
        "shoal.envs.code_env:CodeChoiceEnv",
        vector_entry_point="shoal.envs.code_env:make_choice_vector",
        requirements=("numpy",),
        description="pick one of 4 candidate programs per task (one-hot task id); PPO-learnable",
    )
    registry.register(
        "CodeGen-v1",
        "shoal.envs.text_episodes:codegen_episodes",
        requirements=_NUMPY,
        description="write the body of a tiny seeded Python task; 8 train + 2 held-out families",
    )
    registry.register(
        "Countdown-v1",
        "shoal.envs.text_episodes:countdown_episodes",
        requirements=_NUMPY,
        description="reach a target from 3 (or held-out 4) numbers with + - *; exact checker",
    )
    registry.register(
        "TokenRecall-v1",
        "shoal.envs.token_recall:make_single",
        vector_entry_point="shoal.envs.token_recall:make_batched",
        requirements=_NUMPY,
        description="int64 token ids; name the token after the marker (for causal-lm policies)",
    )
