"""GET /v1/config: the settings this replica really runs with, so an operator can check that
every replica took the file they meant (a replica reads its file once, at start)."""

from __future__ import annotations

import dataclasses

from aiohttp import web

from shoal.raft.context import ApiContext
from shoal.raft.routes import Call


async def get_config(ctx: ApiContext, call: Call) -> web.Response:
    config = ctx.config
    return web.json_response(
        {
            "replica": config.replica_id,
            "source": config.settings_source,
            "scheduler": {"period": config.scheduling.period},
            "balancer": dataclasses.asdict(config.scheduling.balancer),
            "liveness": dataclasses.asdict(config.liveness),
            "raft": dataclasses.asdict(config.timings),
            "write_timeout": config.write_timeout,
            "chaos": dataclasses.asdict(config.chaos),
            "api": {"task_entry_points": config.task_entry_points},
        }
    )
