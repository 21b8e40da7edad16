"""Rank 0 posting `job_metrics` events to the coordinator, for the dashboard's training curves.

Only when the run was submitted through a cluster (job.json names the coordinators). A post
that fails is logged and retried at the next period: the coordinator being slow, electing or
down must never slow or stop training, so posting runs beside the training loop and each
attempt is bounded by the client's own timeout.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.errors import ShoalError
from shoal.learner.errors import LearnerError
from shoal.raft.client import CoordinatorClient

log = logging.getLogger("shoal.learner.metrics")

METRICS_KIND = "job_metrics"
POST_EVERY_S = 3.0


@dataclass(frozen=True)
class MetricsTarget:
    """Where to post: the job id, the coordinators' API URLs and the API token."""

    job: str
    urls: list[str]
    token: str

    @classmethod
    def from_job(cls, entry: Any) -> MetricsTarget:
        """From job.json's `coordinator` entry ({urls, token_file, job})."""
        try:
            urls = [str(u) for u in entry["urls"]]
            token = Path(str(entry["token_file"])).read_text().strip()
            job = str(entry["job"])
        except (KeyError, TypeError) as exc:
            raise LearnerError(
                f"job.json coordinator entry {entry!r} needs urls, token_file and job: {exc}"
            ) from None
        except OSError as exc:
            raise LearnerError(f"cannot read the coordinator token file: {exc}") from None
        if not urls:
            raise LearnerError("job.json coordinator entry has no urls")
        return cls(job, urls, token)


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def metrics_fields(job: str, status: dict[str, Any], window: int) -> dict[str, Any]:
    """The event's fields from a rank status: job, step (the policy version), return (mean of
    the last `window` episodes; absent before any), sps, policy_lag and every loss as loss_*."""
    fields: dict[str, Any] = {"job": job, "step": int(status.get("version", 0))}
    returns = [
        r for r in (_finite(x) for x in status.get("returns", [])[-window:]) if r is not None
    ]
    # Each term divided first: the mean of finite returns near the float maximum stays finite.
    mean = _finite(sum(r / len(returns) for r in returns)) if returns else None
    if mean is not None:
        fields["return"] = mean
    for key, value in (("sps", status.get("sps")), ("policy_lag", status.get("policy_lag_median"))):
        number = _finite(value)
        if number is not None:
            fields[key] = number
    for key, value in (status.get("metrics") or {}).items():
        name = loss_name(str(key))
        number = _finite(value)
        if name is not None and number is not None:
            fields[name] = number
    return fields


def loss_name(key: str) -> str | None:
    """PPO's `loss`, `policy_loss`, `value_loss` as the dashboard's loss_total, loss_policy,
    loss_value; None for a metric that is no loss."""
    if key == "loss":
        return "loss_total"
    if key.endswith("_loss"):
        return "loss_" + key.removesuffix("_loss")
    return key if key.startswith("loss_") else None


async def _post(client: CoordinatorClient, target: MetricsTarget, fields: dict[str, Any]) -> None:
    try:
        await client.add_event(METRICS_KIND, f"{target.job} step {fields['step']}", fields)
    except (ShoalError, OSError) as exc:
        log.warning("could not post job_metrics to %s: %s", target.urls, exc)


async def post_forever(
    target: MetricsTarget, status: Callable[[], dict[str, Any]], window: int
) -> None:
    """Post the current metrics every POST_EVERY_S until cancelled; failures only logged."""
    async with CoordinatorClient(target.urls, target.token, timeout=2.0) as client:
        while True:
            await asyncio.sleep(POST_EVERY_S)
            await _post(client, target, metrics_fields(target.job, status(), window))


async def post_once(target: MetricsTarget, status: dict[str, Any], window: int) -> None:
    """The final metrics when the rank stops, so even a short run leaves its point."""
    async with CoordinatorClient(target.urls, target.token, timeout=2.0) as client:
        await _post(client, target, metrics_fields(target.job, status, window))
