"""Identity scopes' lifetime (scopes.py) and the keyspace's O(1) refusal audit."""

from __future__ import annotations

import pytest

from quilld.config import DramConfig
from quilld.model import IdentityScope
from quilld.scopes import NO_SCOPE, REASONS, ScopeLimit, ScopeRegistry
from quilld.tiers.arena import PAGE
from quilld.tiers.keyspace import Keyspace


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_unheld_scopes_are_released_after_the_grace_and_tags_never_reused():
    clock = Clock()
    reg = ScopeRegistry(clock=clock)
    a = reg.tag(IdentityScope("t", "m1"))
    b = reg.tag(IdentityScope("t", "m2"))
    reg.hold(b)
    clock.now += 29
    assert reg.sweep() == 0
    clock.now += 2
    assert reg.sweep() == 1  # a: nobody held it
    assert reg.find(IdentityScope("t", "m1")) == NO_SCOPE
    assert reg.scope_of(b) == IdentityScope("t", "m2")
    again = reg.tag(IdentityScope("t", "m1"))
    assert again not in (a, b)  # a fresh tag: a stale `a` can never mean another scope
    reg.drop(b)
    clock.now += 31
    assert reg.sweep() == 2 and len(reg) == 0


def test_the_cap_counts_live_scopes_per_tenant_and_reclaims_idle_ones_first():
    reg = ScopeRegistry(max_per_tenant=3, clock=Clock())
    held = [reg.tag(IdentityScope("t", f"m{i}"), capped=True) for i in range(3)]
    for tag in held:
        reg.hold(tag)
    with pytest.raises(ScopeLimit, match="tenant 't' already uses 3 identity scopes"):
        reg.tag(IdentityScope("t", "m3"), capped=True)
    assert reg.limited == 1
    reg.tag(IdentityScope("other", "m3"), capped=True)  # another tenant has its own cap
    reg.tag(IdentityScope("t", "engine"))  # the node's own scopes are never refused
    reg.drop(held[0])
    assert reg.tag(IdentityScope("t", "m3"), capped=True)  # the idle one made room at once
    assert reg.scopes_of("t") <= 4


def test_a_scope_with_keys_is_held_by_the_keyspace():
    clock = Clock()
    reg = ScopeRegistry(clock=clock)
    ks = Keyspace(DramConfig(size=16 * PAGE, inline_max=256), reg)
    tag = reg.tag(IdentityScope("t", "m"))
    ks.publish(tag, b"k", b"v")
    clock.now += 1000
    assert reg.sweep() == 0
    ks.delete(tag, b"k")
    clock.now += 1000
    assert reg.sweep() == 1


def test_a_miss_audit_never_scans_scopes():
    reg = ScopeRegistry(max_per_tenant=100_000)
    ks = Keyspace(DramConfig(size=16 * PAGE, inline_max=256), reg)
    owner = reg.tag(IdentityScope("alice", "m"))
    ks.publish(owner, b"prefix", b"kv")
    for i in range(5000):  # many scopes, none holding the key
        reg.tag(IdentityScope("bob", f"m{i}"))
    calls = 0
    real = reg.refused

    def counting(wanted, held):
        nonlocal calls
        calls += 1
        return real(wanted, held)

    reg.refused = counting
    bob = reg.tag(IdentityScope("bob", "m"))
    assert ks.lookup(bob, b"prefix") is None and ks.lookup(bob, b"nothing") is None
    assert calls == 1 and reg.refusals == {("bob", "cross_tenant"): 1}
    ks.publish(bob, b"prefix", b"bob's")  # both hold it now: alice's miss elsewhere still finds bob's
    other = reg.tag(IdentityScope("carol", "m"))
    assert ks.lookup(other, b"prefix") is None and calls == 2
    ks.delete(owner, b"prefix")
    ks.delete(bob, b"prefix")
    assert ks.lookup(other, b"prefix") is None and calls == 2  # nobody holds it: a plain miss


# -- issue 19 item 16: a tenant's figures do not depend on other tenants' keys -----------------------

def test_a_tenant_is_shown_no_cross_tenant_refusal_and_the_operator_sees_it():
    reg = ScopeRegistry()
    ks = Keyspace(DramConfig(size=16 * PAGE, inline_max=256), reg)
    alice, bob = reg.tag(IdentityScope("alice", "m")), reg.tag(IdentityScope("bob", "m"))
    ks.publish(alice, b"held", b"kv")
    assert ks.lookup(bob, b"held") is None and ks.lookup(bob, b"nobody's") is None
    # before the fix bob's own figures showed cross_tenant 1 for the first miss and 0 for the second
    assert reg.refusals_seen_by("bob") == dict.fromkeys(REASONS, 0)
    assert reg.refusals_of("bob")["cross_tenant"] == 1 and reg.refusals_of()["cross_tenant"] == 1


def test_with_several_holders_the_reason_is_the_callers_own_closest_whatever_others_hold():
    """Bob's miss on a key he holds under another model counts cross_model for him whether or not
    alice holds the same key too (before, the holder counted was whichever the owner set gave first,
    so some of these were cross_tenant: bob's figures depended on alice's keys)."""
    reg = ScopeRegistry()
    ks = Keyspace(DramConfig(size=64 * PAGE, inline_max=256), reg)
    others = [reg.tag(IdentityScope(f"alice{i}", "m")) for i in range(16)]  # tags on both sides of bob's
    bob_m2, bob_m2_lora = reg.tag(IdentityScope("bob", "m2")), reg.tag(IdentityScope("bob", "m", "", "lora"))
    bob = reg.tag(IdentityScope("bob", "m"))
    keys = [b"k%d" % i for i in range(200)]
    for k in keys:
        ks.publish(bob_m2, k, b"b")
    for i, k in enumerate(keys[::2]):
        ks.publish(others[i % 16], k, b"a")
    for k in keys:
        assert ks.lookup(bob, k) is None
    assert reg.refusals_of("bob") == {**dict.fromkeys(REASONS, 0), "cross_model": 200}
    assert reg.refusals_seen_by("bob") == reg.refusals_of("bob")
    for k in keys[:10]:  # a closer scope of his own: the adapter is the field that differs
        ks.publish(bob_m2_lora, k, b"c")
        assert ks.lookup(bob, k) is None
    assert reg.refusals_seen_by("bob")["cross_adapter"] == 10
    # held by another tenant only: counted, for the operator's view
    assert ks.lookup(reg.tag(IdentityScope("carol", "m")), keys[0]) is None
    assert reg.refusals_of("carol")["cross_tenant"] == 1 and reg.refusals_seen_by("carol")["cross_tenant"] == 0
