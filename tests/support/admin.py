"""The admin API from a blocking test body: a JSON POST with the operator token, beside
LocalCluster.get (which reads)."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from shoal.local import LocalCluster

POST_TIMEOUT_S = 5.0


def post_json(local: LocalCluster, url: str, body: dict[str, Any]) -> Any:
    """POST `body` to the admin API `url` of `local` as its operator; the decoded answer."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {local.token}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=POST_TIMEOUT_S) as resp:
        return json.loads(resp.read())
