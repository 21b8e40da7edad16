"""Adam for the learner ranks, without `torch.optim`.

Every `torch.optim` optimiser imports `torch._dynamo` the first time it steps, zeroes its
gradients or reads its state: about 1.5 s of CPU on an idle machine here and 3-4 s on a loaded
one, per process. A rank pays it at every start, so every learner group restart too; and in
a worker thread it did not hide behind the rendezvous, it held it up (the import holds the
GIL and import locks that `init_process_group` needs), so the group formed only once both
ranks' imports were done. This class does the same arithmetic as `torch.optim.Adam`'s
single-tensor path (no weight decay, no amsgrad): the same operations in the same order, so
on CPU the parameters are bit-identical step for step (tested against torch's). Its
`state_dict` has torch's layout, so checkpoints written with either load into the other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from shoal.learner.errors import LearnerError

# What torch.optim.Adam records per parameter group besides lr, betas and eps; written so that
# torch's `load_state_dict` accepts our state (it reads these keys when it steps).
TORCH_GROUP_DEFAULTS: dict[str, Any] = {
    "weight_decay": 0,
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": False,
}


class Adam:
    """One parameter group; `param_groups[0]["lr"]` may be changed between steps (annealing)."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        if not (math.isfinite(lr) and lr >= 0):
            raise LearnerError(f"Adam lr = {lr} must be a finite number >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise LearnerError(f"Adam betas = {betas} must each be in [0, 1)")
        if not (math.isfinite(eps) and eps >= 0):
            raise LearnerError(f"Adam eps = {eps} must be a finite number >= 0")
        self.params = list(params)
        self.param_groups: list[dict[str, Any]] = [{"lr": lr, "betas": tuple(betas), "eps": eps}]
        self.steps = [0] * len(self.params)
        self.moments: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        lr, eps = float(group["lr"]), float(group["eps"])
        beta1, beta2 = (float(b) for b in group["betas"])
        for i, param in enumerate(self.params):
            if param.grad is None:
                continue
            grad = param.grad
            if i not in self.moments:
                self.moments[i] = (
                    torch.zeros_like(param, memory_format=torch.preserve_format),
                    torch.zeros_like(param, memory_format=torch.preserve_format),
                )
            exp_avg, exp_avg_sq = self.moments[i]
            self.steps[i] += 1
            step = float(self.steps[i])
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step_size = lr / (1 - beta1**step)
            denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
            param.addcdiv_(exp_avg, denom, value=-step_size)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.Adam's layout: per parameter index `step` (a float32 scalar tensor),
        `exp_avg`, `exp_avg_sq`; one group naming the indices."""
        state = {
            i: {
                "step": torch.tensor(float(self.steps[i]), dtype=torch.float32),
                "exp_avg": exp_avg,
                "exp_avg_sq": exp_avg_sq,
            }
            for i, (exp_avg, exp_avg_sq) in sorted(self.moments.items())
        }
        group = {**TORCH_GROUP_DEFAULTS, **self.param_groups[0]}
        return {
            "state": state,
            "param_groups": [{**group, "params": list(range(len(self.params)))}],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from ours or from torch.optim.Adam's (a checkpoint from before this class)."""
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != 1:
            raise LearnerError(
                "the optimiser state has "
                f"{len(groups) if isinstance(groups, list) else 'no'} parameter groups; this "
                "Adam has one: the checkpoint is not from this learner's model"
            )
        saved = groups[0]
        if len(saved.get("params", ())) != len(self.params):
            raise LearnerError(
                f"the optimiser state is for {len(saved.get('params', ()))} parameters, the "
                f"model has {len(self.params)}: the checkpoint is not from this model"
            )
        index = {saved_id: i for i, saved_id in enumerate(saved["params"])}
        steps = [0] * len(self.params)
        moments = {}
        for saved_id, entry in state_dict.get("state", {}).items():
            i = index[saved_id]
            param = self.params[i]
            steps[i] = int(float(entry["step"]))
            moments[i] = (
                entry["exp_avg"].to(device=param.device, dtype=param.dtype).clone(),
                entry["exp_avg_sq"].to(device=param.device, dtype=param.dtype).clone(),
            )
        self.steps, self.moments = steps, moments
        self.param_groups = [
            {"lr": float(saved["lr"]), "betas": tuple(saved["betas"]), "eps": float(saved["eps"])}
        ]
