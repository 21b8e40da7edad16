"""Proof that a server still serves after hostile input: an honest client's round trip.

Tests of misbehaving peers end with this, so a bad connection is shown to cost only itself."""

from __future__ import annotations

from shoal.runtime.system import ActorSystem
from shoal.runtime.transport import TransportConfig, attach


async def good_client_works(address: str, token: str) -> None:
    """Ask the `echo` actor at `address` to echo a value, as a well-behaved peer holding
    `token`; fails the test if the server no longer answers."""
    async with ActorSystem() as system:
        transport = await attach(system, TransportConfig(token=token))
        try:
            assert await system.ref(f"{address}/echo").ask.echo("ok") == "ok"
        finally:
            await transport.close()
