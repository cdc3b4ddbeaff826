"""PeerPool's bound on connections per peer never turns into an unbounded wait: against a real
listener on 127.0.0.1 that accepts and never answers (a SIGSTOPped peer, as the kernel sees it),
a call past the bound fails within its own timeout, counted, and its slot is not lost."""

from __future__ import annotations

import asyncio
import time

import pytest

from quilld.cluster.peer_client import PeerError, PeerPool


async def silent_server() -> tuple[asyncio.AbstractServer, int]:
    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65536):
            pass
        writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_a_call_past_the_bound_fails_within_its_timeout_and_frees_its_slot():
    async def scenario():
        server, port = await silent_server()
        pool = PeerPool(per_peer=2)
        try:
            held = [asyncio.ensure_future(pool.call("127.0.0.1", port, "PING", timeout=1.0)) for _ in range(2)]
            await asyncio.sleep(0.05)  # both connections open and busy
            t0 = time.monotonic()
            with pytest.raises(PeerError, match="2 connections stayed busy for 0.2 s"):
                await pool.call("127.0.0.1", port, "PING", timeout=0.2)
            waited = time.monotonic() - t0
            for task in held:
                with pytest.raises(PeerError, match="timeout"):
                    await task
            # the two slots came back (their calls timed out): the next call gets one at once
            t1 = time.monotonic()
            with pytest.raises(PeerError, match="timeout"):
                await pool.call("127.0.0.1", port, "PING", timeout=0.1)
            return waited, time.monotonic() - t1, pool.busy_timeouts, pool.waits
        finally:
            pool.close()
            server.close()
            await server.wait_closed()

    waited, next_call, busy, waits = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert 0.2 <= waited < 0.5, waited
    assert next_call < 0.3, next_call
    assert (busy, waits) == (1, 1)
