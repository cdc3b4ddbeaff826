"""Three `Gossip` shells on real loopback sockets in one event loop.

Join through a seed (TCP push/pull), meta exchange, garbage and forged
packets on both UDP and TCP (dropped and counted), a graceful leave (LEFT,
never DEAD) and a stopped member (DEAD); replayed and stale packets dropped
and counted, and no gossip off loopback without a secret. Fast timers keep
it to seconds.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from dataclasses import replace

import pytest

from quilld.cluster.gossip import Gossip, parse_seeds
from quilld.cluster.swim import EventKind
from quilld.cluster.wire import REPLAY_WINDOW, Codec, Ping, State
from quilld.config import ClusterConfig
from quilld.errors import ConfigError

CFG = ClusterConfig(secret="t0ken", probe_interval_ms=200, probe_timeout_ms=80, suspicion_mult=3,
                    push_pull_interval_ms=1000)
LOOPS = ["asyncio"]
try:
    import uvloop
    LOOPS.append("uvloop")
except ImportError:  # pragma: no cover - uvloop is a declared dependency
    uvloop = None


async def until(cond, timeout: float, what: str) -> float:
    """Wait for `cond`; `timeout` bounds a loaded machine's wait, it is no claim about speed."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout}s")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def state(g: Gossip, node_id: str) -> State | None:
    return next((m.state for m in g.members() if m.node_id == node_id), None)


def meta(g: Gossip, node_id: str) -> dict | None:
    return next((m.meta for m in g.members() if m.node_id == node_id), None)


def alive(g: Gossip) -> set[str]:
    return {m.node_id for m in g.members() if m.state is State.ALIVE}


async def scenario() -> None:
    events: dict[str, list] = {"a": [], "b": [], "c": []}
    a = Gossip("a", "127.0.0.1", 0, {"resp": "127.0.0.1:7001"}, CFG, events["a"].append)
    await a.start()
    b = Gossip("b", "127.0.0.1", 0, {"resp": "127.0.0.1:7002"}, CFG, events["b"].append, seeds=[a.addr])
    c = Gossip("c", "127.0.0.1", 0, {"resp": "127.0.0.1:7003"}, CFG, events["c"].append,
               seeds=parse_seeds(f"localhost:{a.port}"))
    await b.start()
    await c.start()
    nodes = [a, b, c]
    try:
        assert a.port and a.port not in (b.port, c.port)
        await until(lambda: all(alive(g) == {"a", "b", "c"} for g in nodes), 15, "join")
        assert meta(c, "b") == {"resp": "127.0.0.1:7002"} and meta(b, "c") == {"resp": "127.0.0.1:7003"}
        assert a.stats["gossip_push_pull_served"] >= 2

        b.update_meta({"resp": "127.0.0.1:7002", "load": 3})
        await until(lambda: meta(a, "b").get("load") == 3 and meta(c, "b").get("load") == 3, 15, "meta")
        assert any(e.kind is EventKind.UPDATED and e.member.node_id == "b" for e in events["c"])

        # Garbage and forgeries, on UDP and on the push/pull port.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"\x93\x01\x01", a.addr)  # no MAC at all
            s.sendto(Codec("wrong").encode(Ping(1, "a", "x")), a.addr)
            s.sendto(b"\x00" * 2000, a.addr)  # oversize
        r, w = await asyncio.open_connection(*a.addr)
        w.write(struct.pack(">I", 5) + b"hello")
        await w.drain()
        assert await r.read() == b""  # closed without a reply
        w.close()
        r, w = await asyncio.open_connection(*a.addr)
        w.write(struct.pack(">I", 2**31))  # a frame over the limit: refused before reading it
        await w.drain()
        assert await r.read() == b""
        w.close()
        await until(lambda: a.stats["gossip_auth_failures"] >= 3 and a.stats["gossip_malformed"] >= 2,
                    15, "bad packets counted")
        assert alive(a) == {"a", "b", "c"}

        await c.stop(leave=True)
        took_left = await until(lambda: state(a, "c") is State.LEFT and state(b, "c") is State.LEFT, 15, "leave")

        stopped = time.monotonic()
        await b.stop(leave=False)
        took_dead = await until(lambda: state(a, "b") is State.DEAD, 20, "detect a stopped member")
        print(f"\nleft seen in {took_left:.2f}s; stopped member DEAD after {time.monotonic() - stopped:.2f}s")
        assert took_dead >= 0.6  # not before the shortest suspicion (3 x 200 ms)
        about_c = [e.kind for es in events.values() for e in es if e.member.node_id == "c"]
        assert EventKind.LEFT in about_c and EventKind.DEAD not in about_c
        assert [e.kind for e in events["a"] if e.member.node_id == "b"][-1] is EventKind.DEAD
        assert a.stats["gossip_internal_errors"] == 0 and a.stats["gossip_event_errors"] == 0
    finally:
        for g in nodes:
            await g.stop(leave=False)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("loop", LOOPS)
def test_join_exchange_leave_and_detect_on_loopback(loop):
    if loop == "uvloop":
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(scenario())
    else:
        asyncio.run(scenario())


def test_stop_before_start_and_twice_is_harmless():
    async def body():
        g = Gossip("solo", "127.0.0.1", 0, {}, replace(CFG, secret=""))
        await g.stop()
        g2 = Gossip("solo", "127.0.0.1", 0, {}, replace(CFG, secret=""))
        await g2.start()
        assert [m.node_id for m in g2.members()] == ["solo"]
        await g2.stop()
        await g2.stop()
    asyncio.run(body())


def test_no_secret_off_loopback_is_refused_with_nothing_left_open():
    """Issue 11: unauthenticated gossip anywhere but loopback lets one forged packet mark a node dead."""
    async def body():
        g = Gossip("solo", "0.0.0.0", 0, {}, replace(CFG, secret=""))
        with pytest.raises(ConfigError) as info:
            await g.start()
        assert "cluster.secret" in info.value.message
        assert g._transport is None and g._server is None  # both sockets closed again
        keyed = Gossip("solo", "0.0.0.0", 0, {}, CFG)  # with a secret, any address
        await keyed.start()
        await keyed.stop()
    asyncio.run(body())


def test_replayed_and_stale_packets_are_dropped_and_counted(caplog):
    """Issue 11: an authentic packet is accepted once; a copy, or one stamped outside the window, is not."""
    async def body():
        a = Gossip("a", "127.0.0.1", 0, {}, CFG)
        await a.start()
        try:
            assert a.stats["gossip_replays_rejected"] == a.stats["gossip_stale_rejected"] == 0
            packet = Codec(CFG.secret).encode(Ping(1, "a", "x"))  # as a member "x" would send it
            old = Codec(CFG.secret, clock=lambda: time.time() - 2 * REPLAY_WINDOW).encode(Ping(2, "a", "x"))
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.bind(("127.0.0.1", 0))
                s.settimeout(2)
                s.sendto(packet, a.addr)
                ack = Codec(CFG.secret).decode_datagram(await asyncio.to_thread(s.recv, 2048))
                assert ack.seq == 1  # the first copy is answered
                s.sendto(packet, a.addr)
                s.sendto(old, a.addr)
                await until(lambda: a.stats["gossip_replays_rejected"] == 1 and a.stats["gossip_stale_rejected"] == 1,
                            15, "replays counted")
                s.settimeout(0.3)
                with pytest.raises(socket.timeout):
                    await asyncio.to_thread(s.recv, 2048)  # neither got an answer
            assert a.stats["gossip_malformed"] == a.stats["gossip_auth_failures"] == 0
        finally:
            await a.stop(leave=False)
    with caplog.at_level("WARNING", logger="quilld.gossip"):
        asyncio.run(body())
    assert "off this node's clock" in caplog.text
