"""Session affinity (issue 19.4): kept per tenant, bounded in count and idle time, ids capped in
length, evictions counted; and the control plane routing through it."""

from __future__ import annotations

import pytest

from quilld.config import Config, EngineConfig, GatewayConfig
from quilld.errors import ConfigError
from quilld.index.affinity import MAX_SESSION_ID_BYTES, SessionAffinity, SessionIdTooLong, check_session_id
from quilld.index.control import ControlPlane
from quilld.model import IdentityScope
from quilld.scopes import ScopeRegistry


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_table_keeps_at_most_max_sessions_and_drops_the_least_recently_used():
    clock = Clock()
    table = SessionAffinity(3, 60.0, clock)
    for i in range(3):
        table.put("t", f"s{i}", "e1")
        clock.now += 1
    table.put("t", "s0", "e2")  # used again: now the most recent
    clock.now += 1
    table.put("t", "s3", "e1")
    table.put("t", "s4", "e1")
    assert len(table) == 3 and table.evicted_full == 2
    assert table.get("t", "s1") is None and table.get("t", "s2") is None
    assert table.get("t", "s0") == "e2" and table.get("t", "s4") == "e1"
    for i in range(10_000):
        table.put("t", f"many-{i}", "e1")
    assert len(table) == 3 and table.evicted_full == 2 + 10_000


def test_a_session_unused_for_idle_s_is_forgotten_by_lookup_or_by_sweep():
    clock = Clock()
    table = SessionAffinity(100, 10.0, clock)
    table.put("t", "a", "e1")
    table.put("t", "b", "e1")
    clock.now += 5
    table.put("t", "c", "e2")
    assert table.get("t", "a") == "e1"  # 5 s: still kept
    clock.now += 6  # a and b: 11 s unused; c: 6 s
    assert table.get("t", "a") is None and table.evicted_idle == 1
    assert table.sweep() == 1 and table.evicted_idle == 2  # b
    assert len(table) == 1 and table.get("t", "c") == "e2"
    clock.now += 11
    table.put("t", "d", "e1")  # a put sweeps the idle front too
    assert len(table) == 1 and table.evicted_idle == 3


def test_a_sweep_forgets_at_most_its_share_per_call():
    clock = Clock()
    table = SessionAffinity(100_000, 1.0, clock)
    for i in range(10_000):
        table.put("t", str(i), "e1")
    clock.now += 2
    assert table.sweep(most=4096) == 4096 and len(table) == 10_000 - 4096
    assert table.sweep() + table.sweep() == 10_000 - 4096 and len(table) == 0


def test_an_entry_costs_the_same_whatever_the_ids_length():
    import tracemalloc

    def cost(length: int) -> int:
        table = SessionAffinity(10_000, 60.0, Clock())
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(2000):
            table.put("t", f"{i:08d}".ljust(length, "x"), "e1")
        used = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        return used

    short, long = cost(8), cost(MAX_SESSION_ID_BYTES)
    assert long < short * 1.1 and long < 2000 * 400  # the id itself is not kept


def test_sessions_are_kept_per_tenant():
    table = SessionAffinity(10, 60.0, Clock())
    table.put("alice", "chat-1", "e1")
    table.put("bob", "chat-1", "e2")
    assert table.get("alice", "chat-1") == "e1" and table.get("bob", "chat-1") == "e2"
    assert table.get("carol", "chat-1") is None
    assert table.forget_engine("e1") == 1 and table.get("alice", "chat-1") is None


def test_a_session_id_longer_than_the_cap_is_refused():
    check_session_id("x" * MAX_SESSION_ID_BYTES)
    check_session_id("é" * (MAX_SESSION_ID_BYTES // 2))
    for too_long in ("x" * (MAX_SESSION_ID_BYTES + 1), "é" * (MAX_SESSION_ID_BYTES // 2 + 1),
                     "\udcff" * (MAX_SESSION_ID_BYTES + 1), "\ud800" * 100):
        with pytest.raises(SessionIdTooLong, match=f"at most {MAX_SESSION_ID_BYTES}"):
            check_session_id(too_long)
    table = SessionAffinity(10, 60.0, Clock())
    with pytest.raises(SessionIdTooLong):
        table.put("t", "x" * 32 * 1024, "e1")
    assert len(table) == 0


def test_the_gateway_section_sets_the_bounds():
    assert (GatewayConfig().session_max, GatewayConfig().session_idle_s) == (100_000, 1800.0)
    for bad in ({"session_max": 0}, {"session_idle_s": 0.0}, {"session_idle_s": float("nan")}):
        with pytest.raises(ConfigError, match="session_max must be at least 1 and session_idle_s"):
            Config(gateway=GatewayConfig(**bad)).validate()


# -- through the control plane: what ROUTE, POST /v1/route and the gateway share ------------------

ENGINES = (EngineConfig(id="e1", url="http://127.0.0.1:1", model="m"),
           EngineConfig(id="e2", url="http://127.0.0.1:2", model="m"))


def plane(**gateway) -> ControlPlane:
    return ControlPlane(Config(engines=ENGINES, gateway=GatewayConfig(**gateway)), ScopeRegistry())


def route(control: ControlPlane, tenant: str, session: str | None):
    scope = IdentityScope(tenant, "m", "", "")
    return control.route(scope, control.scopes.tag(scope), [1, 2, 3], session=session)


def test_one_tenants_session_never_steers_another_tenants_requests():
    control = plane()
    lease = control.engines.acquire("e1")  # e1 busy: alice's session lands on e2
    assert route(control, "alice", "chat-1").engine == "e2"
    control.engines.release(lease)
    assert route(control, "alice", "chat-1").engine == "e2"  # her session stays put
    assert route(control, "bob", "chat-1").engine == "e1"  # bob's equal id is his own: the idle favourite
    assert route(control, "bob", None).engine == "e1"


def test_route_refuses_a_long_session_id_and_keeps_nothing():
    control = plane()
    with pytest.raises(SessionIdTooLong):
        route(control, "t", "s" * (MAX_SESSION_ID_BYTES + 1))
    assert len(control.sessions) == 0 and control.stats["routes"] == 0


def test_route_keeps_at_most_session_max_sessions():
    control = plane(session_max=50)
    for i in range(3000):
        assert route(control, "t", f"{i:08d}" + "x" * 200).engine is not None
    assert len(control.sessions) == 50 and control.sessions.evicted_full == 2950
