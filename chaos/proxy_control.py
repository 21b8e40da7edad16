"""A local HTTP/JSON control endpoint for fault proxies, so another process (a scenario runner,
curl) can switch faults at run time:

    GET  /proxies                     every proxy: target, port, faults, stats
    PUT  /proxies/{name}/faults       body: NetFaults fields, e.g. {"partition": "blackhole"}
    POST /proxies/{name}/heal         clear all faults
    POST /proxies/{name}/reset        RST every open connection

Bad input is a 400 with `{"error": ..., "message": ...}` naming the key; an unknown proxy a 404.
Binds 127.0.0.1 only.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from shoal.chaos.errors import ProxyError
from shoal.chaos.proxy import FaultProxy
from shoal.chaos.traffic import NetFaults

PROXIES = web.AppKey("proxies", dict[str, FaultProxy])


def describe(name: str, proxy: FaultProxy) -> dict[str, Any]:
    return {
        "name": name,
        "target": f"{proxy.target[0]}:{proxy.target[1]}",
        "port": proxy.port,
        "faults": proxy.faults.to_dict(),
        "stats": proxy.stats.to_dict(),
    }


def _error(status: int, error: str, message: str) -> web.Response:
    return web.json_response({"error": error, "message": message}, status=status)


def _proxy(request: web.Request) -> FaultProxy | None:
    return request.app[PROXIES].get(request.match_info["name"])


async def _list(request: web.Request) -> web.Response:
    return web.json_response({"proxies": [describe(n, p) for n, p in request.app[PROXIES].items()]})


async def _set_faults(request: web.Request) -> web.Response:
    proxy = _proxy(request)
    if proxy is None:
        return _error(404, "not_found", f"no proxy {request.match_info['name']!r}")
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "bad_json", "the body must be a JSON object of fault settings")
    try:
        proxy.set_faults(NetFaults.from_dict(body))
    except ProxyError as exc:
        return _error(400, "invalid", str(exc))
    return web.json_response(describe(request.match_info["name"], proxy))


async def _heal(request: web.Request) -> web.Response:
    proxy = _proxy(request)
    if proxy is None:
        return _error(404, "not_found", f"no proxy {request.match_info['name']!r}")
    proxy.heal()
    return web.json_response(describe(request.match_info["name"], proxy))


async def _reset(request: web.Request) -> web.Response:
    proxy = _proxy(request)
    if proxy is None:
        return _error(404, "not_found", f"no proxy {request.match_info['name']!r}")
    return web.json_response({"reset": proxy.reset_connections()})


def control_app(proxies: dict[str, FaultProxy]) -> web.Application:
    app = web.Application()
    app[PROXIES] = proxies
    app.router.add_get("/proxies", _list)
    app.router.add_put("/proxies/{name}/faults", _set_faults)
    app.router.add_post("/proxies/{name}/heal", _heal)
    app.router.add_post("/proxies/{name}/reset", _reset)
    return app


async def serve_control(proxies: dict[str, FaultProxy], port: int = 0) -> web.AppRunner:
    """Start the endpoint on 127.0.0.1:port; the caller cleans up with `await runner.cleanup()`.
    The bound port is `runner.addresses[0][1]`."""
    runner = web.AppRunner(control_app(proxies), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner
