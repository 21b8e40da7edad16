"""The learner's Adam against torch.optim.Adam: identical parameters step for step, state that
loads either way, clear errors for state from another model; and no torch._dynamo import."""

from __future__ import annotations

import copy
import io
import itertools
import subprocess
import sys
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shoal.learner.adam import Adam
from shoal.learner.errors import LearnerError


def _models(seed: int, widths: list[int]) -> tuple[nn.Module, nn.Module]:
    """A small MLP and an exact copy of it."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.Tanh()]
    model = nn.Sequential(*layers)
    return model, copy.deepcopy(model)


def _step(model: nn.Module, optimizer: Adam | torch.optim.Adam, x: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    optimizer.step()


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


settings_ = settings(max_examples=25, deadline=None)
widths = st.lists(st.integers(1, 6), min_size=2, max_size=4)
lrs = st.floats(1e-5, 1e-1)
epss = st.sampled_from([1e-8, 1e-5, 1e-3])
betas = st.tuples(st.floats(0.0, 0.99), st.floats(0.5, 0.9999))


@settings_
@given(st.integers(0, 2**16), widths, lrs, epss, betas, st.integers(1, 12))
def test_steps_are_bit_identical_to_torch_adam(
    seed: int, widths: list[int], lr: float, eps: float, betas: tuple[float, float], steps: int
) -> None:
    ours_model, torch_model = _models(seed, widths)
    ours = Adam(ours_model.parameters(), lr=lr, betas=betas, eps=eps)
    theirs = torch.optim.Adam(torch_model.parameters(), lr=lr, betas=betas, eps=eps)
    gen = torch.Generator().manual_seed(seed)
    for n in range(steps):
        x = torch.randn(5, widths[0], generator=gen)
        if n == steps // 2:  # annealing, as PPOLearner.set_lr does
            ours.param_groups[0]["lr"] = theirs.param_groups[0]["lr"] = lr / 2
        _step(ours_model, ours, x)
        _step(torch_model, theirs, x)
        assert _same(ours_model, torch_model)


@settings_
@given(st.integers(0, 2**16), widths, lrs, st.integers(1, 6), st.booleans())
def test_state_moves_between_torch_adam_and_ours_either_way(
    seed: int, widths: list[int], lr: float, steps: int, from_torch: bool
) -> None:
    """A checkpoint written before this class (torch's state) resumes identically, and ours
    loads into torch's: after the hand-over both continue exactly as one optimiser would."""
    first_model, second_model = _models(seed, widths)
    make: Any = (torch.optim.Adam, Adam) if from_torch else (Adam, torch.optim.Adam)
    first = make[0](first_model.parameters(), lr=lr, eps=1e-5)
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(4, widths[0], generator=gen) for _ in range(steps + 3)]
    for x in inputs[:steps]:
        _step(first_model, first, x)
    second_model.load_state_dict(first_model.state_dict())
    second = make[1](second_model.parameters(), lr=1.0)
    saved = io.BytesIO()
    torch.save(first.state_dict(), saved)  # as a checkpoint holds it
    saved.seek(0)
    second.load_state_dict(torch.load(saved))
    assert second.param_groups[0]["lr"] == lr
    for x in inputs[steps:]:
        _step(first_model, first, x)
        _step(second_model, second, x)
        assert _same(first_model, second_model)


def test_state_of_another_model_is_refused_with_the_counts() -> None:
    small, _ = _models(0, [2, 2])
    large, _ = _models(0, [2, 3, 2])
    state = torch.optim.Adam(small.parameters()).state_dict()
    with pytest.raises(LearnerError, match="for 2 parameters, the model has 4"):
        Adam(large.parameters(), lr=1e-3).load_state_dict(state)
    with pytest.raises(LearnerError, match="2 parameter groups"):
        Adam(small.parameters(), lr=1e-3).load_state_dict(
            {"state": {}, "param_groups": [{"params": [0]}, {"params": [1]}]}
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, "lr = -1.0 must be a finite number >= 0"),
        ({"lr": float("nan")}, "lr = nan"),
        ({"lr": 1e-3, "betas": (0.9, 1.0)}, r"betas = \(0.9, 1.0\) must each be in \[0, 1\)"),
        ({"lr": 1e-3, "eps": -1e-8}, "eps = -1e-08"),
    ],
)
def test_bad_hyper_parameters_are_named(kwargs: dict[str, Any], message: str) -> None:
    model, _ = _models(0, [2, 2])
    with pytest.raises(LearnerError, match=message):
        Adam(model.parameters(), **kwargs)


@pytest.mark.timeout(60)
def test_a_learner_steps_without_importing_torch_dynamo() -> None:
    """The point of the class: a rank's start-up never pays for torch._dynamo."""
    code = (
        "import sys, torch\n"
        "from shoal.learner.config import PPOConfig\n"
        "from shoal.learner.policy import ActorCritic\n"
        "from shoal.learner.ppo import PPOLearner\n"
        "import gymnasium\n"
        "model = ActorCritic((4,), gymnasium.spaces.Discrete(2), (8,))\n"
        "ppo = PPOLearner(model, PPOConfig())\n"
        "ppo.optimizer.zero_grad()\n"
        "model.evaluate_actions(torch.zeros(3, 4), torch.zeros(3, dtype=torch.long))[0].sum().backward()\n"
        "ppo.optimizer.step()\n"
        "ppo.optimizer.load_state_dict(ppo.optimizer.state_dict())\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
