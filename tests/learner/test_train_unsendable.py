"""A rollout task's published error ends the run; only a non-empty error text counts.

`shoal train` itself refuses a fragment that no frame holds before any process starts
(learner/preflight.py `check_fragment`, tests/learner/test_preflight.py); the rollout actor's
own refusal (a worker whose transport allows less) is tested in-process in
tests/learner/test_fragment_size.py."""

from __future__ import annotations

import pytest

from shoal.cluster_train import _published_error


@pytest.mark.parametrize(
    ("task", "error"),
    [
        (
            {"published": {"role": "rollout", "error": "rollout-0-0: too big"}},
            "rollout-0-0: too big",
        ),
        ({"published": {"role": "rollout", "horizon": 20}}, None),
        ({"published": {"error": ""}}, None),
        ({"published": {"error": 3}}, None),
        ({"published": ["error"]}, None),
        ({}, None),
    ],
)
def test_only_a_published_error_text_ends_the_run(
    task: dict[str, object], error: str | None
) -> None:
    assert _published_error(task) == error
