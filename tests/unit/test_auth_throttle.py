"""The AUTH throttle (protocol/commands/connection.py, issue 11 finding 12) on an injected clock,
and AUTH/HELLO through the dispatcher: delays per address, one attempt at a time, refusals past
the longest delay, a window that forgets, and right passwords answered at once elsewhere."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from handler_context import make_context, session
from quilld.config import SecurityConfig
from quilld.errors import CommandError, WrongPass
from quilld.model import Pending
from quilld.protocol.commands.connection import AUTH_DELAY_FIRST, AuthThrottle
from quilld.protocol.resp import OK

CFG = SecurityConfig(requirepass="pw", auth_throttle_after=3, auth_throttle_window_ms=10_000,
                     auth_delay_max_ms=1_000)


def fail(t: AuthThrottle, addr: str, now: float, times: int = 1) -> None:
    for _ in range(times):
        t.failed(CFG, addr, now)


def test_the_first_failures_are_free_then_each_attempt_waits_longer():
    t = AuthThrottle()
    for _ in range(3):
        assert t.wait(CFG, "10.0.0.1", 0.0) == 0.0
        t.failed(CFG, "10.0.0.1", 0.0)
    assert t.wait(CFG, "10.0.0.1", 0.0) == pytest.approx(AUTH_DELAY_FIRST)
    t.failed(CFG, "10.0.0.1", 0.05)
    assert t.wait(CFG, "10.0.0.1", 5.0) == pytest.approx(2 * AUTH_DELAY_FIRST)
    t.failed(CFG, "10.0.0.1", 5.1)
    assert t.wait(CFG, "10.0.0.1", 9.0) == pytest.approx(4 * AUTH_DELAY_FIRST)
    fail(t, "10.0.0.1", 9.0, times=10)
    assert t.wait(CFG, "10.0.0.1", 12.0) == pytest.approx(1.0)  # capped at auth_delay_max_ms
    # another address is not slowed by this one
    assert t.wait(CFG, "10.0.0.2", 12.0) == 0.0


def test_attempts_from_one_address_take_turns_and_the_queue_is_bounded():
    t = AuthThrottle()
    fail(t, "a", 0.0, times=6)  # delay 0.4 s now
    waits = [t.wait(CFG, "a", 1.0) for _ in range(3)]  # three connections at once: 0.4 s apart
    assert waits[:2] == pytest.approx([0.4, 0.8])
    assert waits[2] is None  # would wait 1.2 s > 1 s: refused at once
    assert t.wait(CFG, "a", 1.0) is None
    assert t.wait(CFG, "a", 1.9) == pytest.approx(0.4)  # turns free up as time passes


def test_an_address_quiet_for_a_window_starts_afresh():
    t = AuthThrottle()
    fail(t, "a", 0.0, times=5)
    assert t.wait(CFG, "a", 5.0) > 0
    assert t.wait(CFG, "a", 5.0 + 10.001) == 0.0
    fail(t, "a", 20.0, times=3)
    assert t.wait(CFG, "a", 20.0) == pytest.approx(AUTH_DELAY_FIRST)


def test_turned_off_with_zero():
    t = AuthThrottle()
    cfg = SecurityConfig(requirepass="pw", auth_throttle_after=0)
    for _ in range(100):
        t.failed(cfg, "a", 0.0)
    assert t.wait(cfg, "a", 0.0) == 0.0


def test_auth_through_the_table_is_deferred_then_refused_and_right_passwords_elsewhere_are_not():
    async def main():
        ctx = make_context(requirepass="pw")
        ctx.cfg = replace(ctx.cfg, security=replace(ctx.cfg.security, auth_delay_max_ms=300))
        attacker = session(ctx)
        attacker.addr = "10.9.9.9:4000"
        for _ in range(10):  # security.auth_throttle_after's default
            assert isinstance(ctx.table.dispatch(attacker, [b"AUTH", b"nope"]), WrongPass)
        assert ctx.stats["auth_failures"] == 10
        reply = ctx.table.dispatch(attacker, [b"AUTH", b"pw"])  # even the right one waits its turn
        assert isinstance(reply, Pending)
        assert ctx.stats["auth_throttled"] == 1 and not attacker.authenticated
        assert await reply.awaitable is OK and attacker.authenticated
        late = ctx.table.dispatch(attacker, [b"HELLO", b"3", b"AUTH", b"default", b"nope"])
        assert isinstance(late, Pending)
        with pytest.raises(WrongPass):
            await late.awaitable
        assert ctx.stats["auth_failures"] == 11
        assert not attacker.resp3  # HELLO switched nothing
        # a client at another address is answered at once
        other = session(ctx)
        other.addr = "10.1.1.1:5000"
        assert ctx.table.dispatch(other, [b"AUTH", b"pw"]) is OK
        # bytes that are no text count as failures too, throttled like the rest
        for creds in ([b"\xff\xfe"], [b"us\xc3\xa9r", b"\xff"], [b"default", b"caf\xc3\xa9"]):
            fresh = session(ctx)
            fresh.addr = "10.2.2.2:1"
            assert isinstance(ctx.table.dispatch(fresh, [b"AUTH", *creds]), WrongPass)
        assert ctx.stats["auth_failures"] == 14
        # many attempts at once from the attacker: most are refused without waiting
        replies = [ctx.table.dispatch(attacker, [b"AUTH", b"nope"]) for _ in range(50)]
        refused = [r for r in replies if isinstance(r, CommandError) and "too many failed AUTH" in r.message]
        assert len(refused) >= 46 and ctx.stats["auth_throttle_refused"] == len(refused)  # 0.1 s apart, 0.3 max
        for r in replies:
            if isinstance(r, Pending):
                r.awaitable.close()

    asyncio.run(main())
