"""The baseline shoal is measured against: synchronous PPO in the style of CleanRL, for discrete
actions (ppo.py) and for continuous ones (ppo_continuous_action.py).

One explicit loop you can read top to bottom. `Args()` holds CleanRL's classic-control
defaults: 4 Gymnasium environments in a SyncVectorEnv, 128 steps each per iteration (batch
512), learning rate 2.5e-4 annealed linearly to 0, 4 epochs of 4 minibatches, γ 0.99, λ 0.95,
clip 0.2, entropy 0.01, value 0.5, gradient norm 0.5. `Args.continuous(env_id)` holds
ppo_continuous_action.py's MuJoCo defaults: 1 environment x 2048 steps, learning rate 3e-4
annealed, 10 epochs of 32 minibatches, no entropy bonus, a Gaussian policy with a
state-independent log-std, and its wrapper stack (actions clipped to the box, observations
normalised and clipped to ±10, rewards scaled by the running std of the discounted return and
clipped to ±10). Like CleanRL it treats a time limit as a terminal state (no bootstrap), uses
Gymnasium's same-step autoreset, and reports the environment's own (raw) episode returns. It
imports nothing from shoal's learner on purpose, so the comparison measures shoal's system, not
a shared bug.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

Point = tuple[float, int, float]
"""(wall seconds, env steps, mean return of the last 20 episodes) after one iteration."""


@dataclass(frozen=True)
class Args:
    """CleanRL's ppo.py defaults for CartPole-v1."""

    env_id: str = "CartPole-v1"
    total_timesteps: int = 500_000
    """Sets the learning-rate annealing horizon; the run stops earlier when solved."""
    learning_rate: float = 2.5e-4
    num_envs: int = 4
    num_steps: int = 128
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    num_minibatches: int = 4
    update_epochs: int = 4
    clip_coef: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5

    @classmethod
    def continuous(cls, env_id: str, total_timesteps: int = 1_000_000) -> Args:
        """ppo_continuous_action.py's defaults (its MuJoCo runs): 1 env x 2048 steps, 32
        minibatches of 64, 10 epochs, lr 3e-4, no entropy bonus."""
        return cls(
            env_id=env_id,
            total_timesteps=total_timesteps,
            learning_rate=3e-4,
            num_envs=1,
            num_steps=2048,
            num_minibatches=32,
            update_epochs=10,
            ent_coef=0.0,
        )

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def minibatch_size(self) -> int:
        return self.batch_size // self.num_minibatches


def _init(layer: nn.Linear, gain: float = math.sqrt(2)) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.constant_(layer.bias, 0.0)
    return layer


def _mlp(obs_dim: int, out: int, out_gain: float) -> nn.Sequential:
    """64-64 tanh, orthogonally initialised; the last layer's gain is CleanRL's per head."""
    return nn.Sequential(
        _init(nn.Linear(obs_dim, 64)), nn.Tanh(),
        _init(nn.Linear(64, 64)), nn.Tanh(),
        _init(nn.Linear(64, out), out_gain),
    )  # fmt: skip


class Agent(nn.Module):
    """Separate 64-64 tanh actor and critic; a categorical over the actor's logits."""

    def __init__(self, obs_dim: int, n_actions: int) -> None:
        super().__init__()
        self.critic = _mlp(obs_dim, 1, 1.0)
        self.actor = _mlp(obs_dim, n_actions, 0.01)

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x).squeeze(-1)

    def get_action_and_value(
        self, x: torch.Tensor, action: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        dist = torch.distributions.Categorical(logits=self.actor(x))
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.get_value(x)


class GaussianAgent(Agent):
    """The same critic; a diagonal Gaussian whose mean is the actor's output and whose log-std
    is one learned vector (state-independent, starting at 0), as ppo_continuous_action.py."""

    def __init__(self, obs_dim: int, action_dim: int) -> None:
        super().__init__(obs_dim, action_dim)
        self.actor_logstd = nn.Parameter(torch.zeros(1, action_dim))

    def get_action_and_value(
        self, x: torch.Tensor, action: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        mean = self.actor(x)
        dist = torch.distributions.Normal(mean, self.actor_logstd.expand_as(mean).exp())
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action).sum(-1), dist.entropy().sum(-1), self.get_value(x)


OBS_CLIP = 10.0
"""ppo_continuous_action.py clips normalised observations and scaled rewards to ±10."""


def _make_env(args: Args) -> gym.Env[Any, Any]:
    """One environment; a continuous-action one gets ppo_continuous_action.py's wrapper stack.
    The episode statistics are recorded innermost, so returns are the environment's own."""
    env: gym.Env[Any, Any] = gym.wrappers.RecordEpisodeStatistics(gym.make(args.env_id))
    if not isinstance(env.action_space, gym.spaces.Box):
        return env
    env = gym.wrappers.ClipAction(env)
    env = gym.wrappers.NormalizeObservation(env)
    env = gym.wrappers.TransformObservation(
        env, lambda obs: np.clip(obs, -OBS_CLIP, OBS_CLIP), env.observation_space
    )
    env = gym.wrappers.NormalizeReward(env, gamma=args.gamma)
    return gym.wrappers.ClipReward(env, -OBS_CLIP, OBS_CLIP)


def _make_envs(args: Args) -> gym.vector.SyncVectorEnv:
    return gym.vector.SyncVectorEnv(
        [lambda: _make_env(args) for _ in range(args.num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )


def _make_agent(envs: gym.vector.SyncVectorEnv, obs_dim: int) -> Agent:
    space = envs.single_action_space
    if isinstance(space, gym.spaces.Box):
        return GaussianAgent(obs_dim, math.prod(space.shape))
    return Agent(obs_dim, int(space.n))  # type: ignore[attr-defined]


def _ended_returns(info: dict[str, Any]) -> list[float]:
    """The raw returns of the episodes that ended this step (same-step autoreset's final_info)."""
    final = info.get("final_info", {})
    if "episode" not in final:
        return []
    return [float(r) for r in final["episode"]["r"][final["_episode"]]]


def run(
    seed: int = 1,
    time_limit_s: float = 120.0,
    target: float = 475.0,
    max_env_steps: int | None = None,
    args: Args | None = None,
    on_iteration: Callable[[Point], None] | None = None,
) -> dict[str, Any]:
    """Train until the mean of the last 20 episode returns reaches `target`, or a limit is hit.

    Returns solved_at_s (wall seconds to solve, None if not solved), env_steps (at the solve or
    the stop), sps (env steps per second over the run), wall_s, solved, and curve: a list of
    (wall_s, env_steps, mean return of the last 20 episodes) after every iteration, each also
    given to `on_iteration` as it is made (a long run can show its progress).
    """
    args = args or Args()
    threads = torch.get_num_threads()
    # A 64-wide MLP is fastest on one thread; two threads on a busy 2-core box ran 20x slower.
    torch.set_num_threads(1)
    try:
        return _train(args, seed, time_limit_s, target, max_env_steps, on_iteration)
    finally:
        torch.set_num_threads(threads)


def _train(
    args: Args,
    seed: int,
    time_limit_s: float,
    target: float,
    max_env_steps: int | None,
    on_iteration: Callable[[Point], None] | None,
) -> dict[str, Any]:
    np.random.seed(seed)
    torch.manual_seed(seed)
    envs = _make_envs(args)
    obs_dim = math.prod(envs.single_observation_space.shape or (1,))
    agent = _make_agent(envs, obs_dim)
    discrete = not isinstance(agent, GaussianAgent)
    action_shape = envs.single_action_space.shape or ()
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    shape = (args.num_steps, args.num_envs)
    obs = torch.zeros((*shape, obs_dim))
    actions = torch.zeros((*shape, *action_shape), dtype=torch.long if discrete else torch.float32)
    logprobs = torch.zeros(shape)
    rewards = torch.zeros(shape)
    dones = torch.zeros(shape)
    values = torch.zeros(shape)

    recent: deque[float] = deque(maxlen=20)
    curve: list[Point] = []
    global_step = 0
    solved_at: float | None = None
    num_iterations = args.total_timesteps // args.batch_size
    start = time.perf_counter()
    next_obs = torch.tensor(envs.reset(seed=seed)[0], dtype=torch.float32)
    next_done = torch.zeros(args.num_envs)

    try:
        for iteration in range(1, num_iterations + 1):
            if args.anneal_lr:
                frac = 1.0 - (iteration - 1.0) / num_iterations
                optimizer.param_groups[0]["lr"] = frac * args.learning_rate

            # -- collect num_steps × num_envs transitions with the current policy --
            for step in range(args.num_steps):
                global_step += args.num_envs
                obs[step] = next_obs
                dones[step] = next_done
                with torch.no_grad():
                    action, logprob, _, value = agent.get_action_and_value(next_obs)
                values[step] = value
                actions[step] = action
                logprobs[step] = logprob
                raw_obs, reward, terminated, truncated, info = envs.step(action.numpy())
                ended = np.logical_or(terminated, truncated)
                rewards[step] = torch.tensor(reward, dtype=torch.float32)
                next_obs = torch.tensor(raw_obs, dtype=torch.float32)
                next_done = torch.tensor(ended, dtype=torch.float32)
                recent.extend(_ended_returns(info))

            # -- GAE, time limits treated as terminal as CleanRL does --
            with torch.no_grad():
                next_value = agent.get_value(next_obs)
                advantages = torch.zeros_like(rewards)
                lastgaelam = torch.zeros(args.num_envs)
                for t in reversed(range(args.num_steps)):
                    if t == args.num_steps - 1:
                        nextnonterminal, nextvalues = 1.0 - next_done, next_value
                    else:
                        nextnonterminal, nextvalues = 1.0 - dones[t + 1], values[t + 1]
                    delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
                    lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
                    advantages[t] = lastgaelam
                returns = advantages + values

            # -- flatten and optimise --
            b_obs = obs.reshape(-1, obs_dim)
            b_logprobs = logprobs.reshape(-1)
            b_actions = actions.reshape((-1, *action_shape))
            b_advantages = advantages.reshape(-1)
            b_returns = returns.reshape(-1)
            b_values = values.reshape(-1)
            b_inds = np.arange(args.batch_size)
            for _epoch in range(args.update_epochs):
                np.random.shuffle(b_inds)
                for lo in range(0, args.batch_size, args.minibatch_size):
                    mb = b_inds[lo : lo + args.minibatch_size]
                    _, newlogprob, entropy, newvalue = agent.get_action_and_value(
                        b_obs[mb], b_actions[mb]
                    )
                    ratio = (newlogprob - b_logprobs[mb]).exp()
                    mb_adv = b_advantages[mb]
                    mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                    pg_loss = torch.max(
                        -mb_adv * ratio,
                        -mb_adv * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef),
                    ).mean()
                    v_unclipped = (newvalue - b_returns[mb]) ** 2
                    v_clipped = b_values[mb] + torch.clamp(
                        newvalue - b_values[mb], -args.clip_coef, args.clip_coef
                    )
                    v_loss = 0.5 * torch.max(v_unclipped, (v_clipped - b_returns[mb]) ** 2).mean()
                    loss = pg_loss - args.ent_coef * entropy.mean() + v_loss * args.vf_coef
                    optimizer.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                    optimizer.step()

            # -- bookkeeping: the solve criterion and the limits --
            elapsed = time.perf_counter() - start
            mean20 = float(np.mean(recent)) if recent else 0.0
            curve.append((elapsed, global_step, mean20))
            if on_iteration is not None:
                on_iteration(curve[-1])
            if len(recent) == recent.maxlen and mean20 >= target:
                solved_at = elapsed
                break
            if elapsed >= time_limit_s or (
                max_env_steps is not None and global_step >= max_env_steps
            ):
                break
    finally:
        envs.close()

    wall = time.perf_counter() - start
    return {
        "solved": solved_at is not None,
        "solved_at_s": solved_at,
        "env_steps": global_step,
        "wall_s": wall,
        "sps": global_step / wall if wall > 0 else 0.0,
        "curve": curve,
    }
