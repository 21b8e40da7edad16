"""Schemathesis drives the admin API of a real three-replica cluster (child processes) from its
own OpenAPI document, with every check it has (`st run --checks all`): what the document allows
must be accepted, what it forbids refused with a documented 4xx, no 500, every answer as
documented. It must find nothing. Bounded to about 400 cases (fuzzing and stateful phases; the
coverage phase adds some 2,000 more and is left to a manual `st run`). It talks to a follower,
so forwarding to the leader is tested too.
"""

from __future__ import annotations

from typing import Any

import pytest

from shoal.local import LocalCluster

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the test extra")

from schemathesis.config import SchemathesisConfig  # noqa: E402
from schemathesis.core.failures import Failure  # noqa: E402
from schemathesis.engine import events, from_schema  # noqa: E402
from schemathesis.openapi.checks import RejectedPositiveData  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

EXAMPLES = 12
"""Per operation and mode (valid, invalid data): 27 operations make about 320 cases."""
SEED = 1414
"""Fixed, so a run is repeatable; change it locally to explore."""
ACCEPTED = ["2xx", "3xx", "401", "403", "404", "409", "413", "429", "5xx"]
"""Schemathesis' default answers to valid data, and 413: a size limit (the 1 MiB command a
batch of 10,000 long commands outgrows) is no schema keyword, and the document gives every
route with a body its 413. A 5xx still fails, by the not_a_server_error check."""
LONG_POLL_S = 0.05
"""The `wait` of the long-polling reads, shortened so the run stays short; values outside the
parameter's bounds are sent unchanged, so those are still tested."""


def follower_url(cluster: LocalCluster) -> str:
    leader = cluster.wait_ready()
    return next(url for url in cluster.api_urls() if url != leader)


def is_documented_rule(failure: Failure, response: Any) -> bool:
    """A 422 whose error is `rule`: the fields break a rule across them that JSON Schema cannot
    state (unique ids in a list, ...), named in the schema's description. Schemathesis cannot
    read descriptions, so its valid-looking case is rightly refused."""
    if response.status_code != 422 or not isinstance(failure, RejectedPositiveData):
        return False
    try:
        return bool(response.json().get("error") == "rule")
    except ValueError:
        return False


def short_polls(query: dict[str, Any] | None) -> dict[str, Any] | None:
    wait = (query or {}).get("wait")
    if isinstance(wait, int | float) and not isinstance(wait, bool) and 0 <= wait <= 60:
        return {**(query or {}), "wait": min(wait, LONG_POLL_S)}
    return query


def run_schemathesis(url: str, token: str) -> tuple[list[str], int]:
    """The failures found (one line each) and how many cases were sent."""
    auth = {"Authorization": f"Bearer {token}"}
    config = SchemathesisConfig.from_dict(
        {
            "base-url": url,
            "headers": auth,
            "request-timeout": 30,
            "seed": SEED,
            "cache": {"enabled": False},
            "generation": {"max-examples": EXAMPLES, "database": "none"},
            "phases": {"coverage": {"enabled": False}},
            "checks": {"positive_data_acceptance": {"expected-statuses": ACCEPTED}},
        }
    )
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", config=config, headers=auth)
    schema.config.checks.update(included_check_names=["all"])

    @schema.hook
    def filter_failure(context: Any, failure: Failure, case: Any, response: Any) -> bool:
        return not is_documented_rule(failure, response)

    @schema.hook
    def map_query(context: Any, query: dict[str, Any] | None) -> dict[str, Any] | None:
        return short_polls(query)

    found: list[str] = []
    cases = 0
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished | events.FuzzScenarioFinished):
            cases += len(event.recorder.cases)
            found += failures_in(event.recorder)
        elif isinstance(event, events.NonFatalError | events.FatalError):
            found.append(f"{type(event).__name__}: {event.info.format()}")
    return found, cases


def failures_in(recorder: Any) -> list[str]:
    """One line per failed check: operation, check, and the request and answer behind it."""
    lines = []
    for case_id, checks in recorder.checks.items():
        for check in checks:
            if check.failure_info is None:
                continue
            interaction = recorder.interactions.get(case_id)
            sent = got = "?"
            if interaction is not None:
                request = interaction.request
                sent = f"{request.method} {request.uri} {(request.body or b'')[:300]!r}"
                if interaction.response is not None:
                    answer = interaction.response
                    got = f"{answer.status_code} {answer.content[:300]!r}"
            title = check.failure_info.failure.title
            lines.append(f"{recorder.label}: {check.name}: {title}; sent {sent}; got {got}")
    return lines


def test_the_api_does_what_its_openapi_document_says(cluster: LocalCluster) -> None:
    found, cases = run_schemathesis(follower_url(cluster), cluster.token)
    assert not found, "\n".join(found)
    assert cases > 200  # the run reached the API, case after case
