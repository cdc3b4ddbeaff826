"""The control plane's identity guard on a collision workload."""

from __future__ import annotations

import random

from quilld.config import Config, EngineConfig
from quilld.index.control import ControlPlane, chain_hashes
from quilld.index.events import Batch, Stored
from quilld.scopes import ScopeRegistry
from quilld.model import IdentityScope


def test_collision_workload_reuses_nothing_across_identities_and_counts_refusals():
    # One engine per (tenant, model); the same content hashes stored under every identity's
    # engine, some of them with a LoRA adapter.
    engines = tuple(EngineConfig(id=f"{t}-{m}", url="http://127.0.0.1:1", model=m, tenant=t)
                    for t in ("t1", "t2") for m in ("m1", "m2"))
    control = ControlPlane(Config(engines=engines), ScopeRegistry())
    rng = random.Random(9)
    chains = [[rng.getrandbits(64) for _ in range(8)] for _ in range(20)]
    owners = {}
    for i, chain in enumerate(chains):
        engine = engines[i % len(engines)]
        adapter = "lora-a" if i % 3 == 0 else None
        control.apply(engine.id, Batch(0.0, (Stored(tuple(chain), None, (), 16, None, "GPU", adapter),), None, None))
        owners[i] = (engine.tenant, engine.model, adapter or "")
    naive_cross = safe_hits = 0
    for i, chain in enumerate(chains):
        for tenant in ("t1", "t2"):
            for model in ("m1", "m2"):
                for adapter in ("", "lora-a"):
                    scope = IdentityScope(tenant, model, "", adapter)
                    d = control.route(scope, control.scopes.tag(scope), chain)
                    same = owners[i] == (tenant, model, adapter)
                    naive_cross += not same  # a content-hash cache would have served these
                    credit = max((c.credit for c in d.candidates), default=0.0)
                    if same:
                        assert credit == 8.0
                        safe_hits += 1
                    else:
                        assert credit == 0.0, (i, scope)
    refusals = control.scopes.refusals_of()  # by reason, every tenant's lookups
    # every cross-identity request whose model has engines was refused and counted
    assert safe_hits == len(chains)
    assert sum(refusals.values()) > 0
    assert set(refusals) == {"cross_tenant", "cross_model", "cross_tokenizer", "cross_adapter"}
    assert {t for t, _ in control.scopes.refusals} <= {"t1", "t2"}  # counted by the refused tenant
    assert refusals["cross_tenant"] > 0 and refusals["cross_adapter"] > 0
    assert naive_cross == len(chains) * 7


def test_token_chains_share_leading_blocks():
    a = chain_hashes(list(range(64)), 16)
    b = chain_hashes(list(range(48)) + [999] * 16, 16)
    assert len(a) == 4 and a[:3] == b[:3] and a[3] != b[3]
    assert chain_hashes(list(range(15)), 16) == []
