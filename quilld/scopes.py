"""Identity scopes as compact key prefixes, their lifetime, and the guard's refusal counts.

Every distinct IdentityScope in use is given a 4-byte tag; a key is stored
as `tag + key`, so equal keys in different scopes can never meet. Tags are
never reused: a released scope's tag is retired, so a stale reference can
never point at another identity.

Lifetime: whoever keeps something under a tag holds it (`hold`/`drop`): a
connection that chose the scope, the keyspace while it has keys in it, the
residency index while it has entries in it, an open two-phase put. A scope
nobody holds is released by `sweep` once it has been idle for
`IDLE_GRACE` seconds, so SCOPE commands and gateway requests cannot grow the
registry without bound; each tenant may have at most `max_per_tenant`
scopes at once (clients' new scopes past that are refused).

A lookup that misses in its own scope but would have matched in another one
is a refused cross-scope reuse: it is counted by the refused tenant and the
reason, never served. Callers find the other scopes themselves in O(1) (the
keyspace keeps an owner map, see tiers/keyspace.py) and call `refused`.

What a tenant is shown of its own refusals (`refusals_seen_by`, INFO) depends on its own keys
only: another tenant's keys would otherwise show through (a miss on a key alice holds counting
1 in bob's figures, a miss on one nobody holds 0). So when the key is held in several scopes,
the reason is taken from the caller's own tenant's closest scope whenever there is one, and a
`cross_tenant` refusal is counted for the operator's view only (the admin API), never shown to
the tenant.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Iterable

from quilld.errors import QuillError
from quilld.model import IdentityScope

TAG_LEN = 4
IDLE_GRACE = 30.0  # seconds an unheld scope is kept (a gateway request between routing and recording)
DEFAULT_MAX_PER_TENANT = 1024
REASONS = ("cross_tenant", "cross_model", "cross_tokenizer", "cross_adapter")
NO_SCOPE = b"\xff\xff\xff\xff"  # a tag no scope ever gets: lookups under it find nothing


class ScopeLimit(QuillError):
    """A tenant asked for more identity scopes than it may hold at once."""


class ScopeRegistry:
    def __init__(self, max_per_tenant: int = DEFAULT_MAX_PER_TENANT, clock=time.monotonic) -> None:
        self.max_per_tenant = max_per_tenant
        self._clock = clock
        self._tags: dict[IdentityScope, bytes] = {}
        self._scopes: dict[bytes, IdentityScope] = {}
        self._next = 0
        self._holds: Counter[bytes] = Counter()
        self._idle: dict[bytes, float] = {}  # unheld tags -> since when
        self._per_tenant: Counter[str] = Counter()
        self.refusals: Counter[tuple[str, str]] = Counter()  # (refused tenant, reason) -> count
        self.released = 0
        self.limited = 0  # new scopes refused by the per-tenant cap
        self.on_release: list = []  # called with (tag, scope) as a scope is released

    # -- tags -------------------------------------------------------------------------
    def tag(self, scope: IdentityScope, capped: bool = False) -> bytes:
        """The tag of `scope`, given one if it has none.

        `capped`: the scope is a client's choice, refused (ScopeLimit) when its tenant
        already has `max_per_tenant` scopes; the node's own scopes (engines, recovery,
        peers) are never refused.
        """
        tag = self._tags.get(scope)
        if tag is not None:
            return tag
        if capped and self._per_tenant[scope.tenant] >= self.max_per_tenant:
            self.sweep(tenant=scope.tenant, grace=0.0)
            if self._per_tenant[scope.tenant] >= self.max_per_tenant:
                self.limited += 1
                raise ScopeLimit(f"tenant '{scope.tenant}' already uses {self.max_per_tenant} identity scopes "
                                 "(security.max_scopes_per_tenant); close connections or let unused scopes expire")
        if self._next >= (1 << (8 * TAG_LEN)) - 1:  # NO_SCOPE is never given out
            raise QuillError("identity scope tags exhausted; restart the node")
        tag = self._next.to_bytes(TAG_LEN, "big")
        self._next += 1
        self._tags[scope] = tag
        self._scopes[tag] = scope
        self._per_tenant[scope.tenant] += 1
        self._idle[tag] = self._clock()
        return tag

    def find(self, scope: IdentityScope) -> bytes:
        """The tag of `scope` if it is in use, else NO_SCOPE (a lookup that must not create one)."""
        return self._tags.get(scope, NO_SCOPE)

    def scope_of(self, tag: bytes) -> IdentityScope:
        return self._scopes[tag[:TAG_LEN]]

    def __len__(self) -> int:
        return len(self._scopes)

    # -- lifetime ------------------------------------------------------------------------
    def hold(self, tag: bytes) -> None:
        if tag not in self._scopes:
            return  # NO_SCOPE, or a scope already released: nothing to keep alive
        self._holds[tag] += 1
        self._idle.pop(tag, None)

    def drop(self, tag: bytes) -> None:
        n = self._holds.get(tag)
        if n is None:
            return
        if n <= 1:
            del self._holds[tag]
            self._idle[tag] = self._clock()
        else:
            self._holds[tag] = n - 1

    def sweep(self, tenant: str | None = None, grace: float = IDLE_GRACE, limit: int = 10_000) -> int:
        """Release scopes nobody has held for `grace` seconds (of one tenant, or all); how many went."""
        now, gone = self._clock(), []
        for tag, since in self._idle.items():
            if len(gone) >= limit:
                break
            if now - since >= grace and (tenant is None or self._scopes[tag].tenant == tenant):
                gone.append(tag)
        for tag in gone:
            del self._idle[tag]
            scope = self._scopes.pop(tag)
            del self._tags[scope]
            for hook in self.on_release:
                hook(tag, scope)
            self._per_tenant[scope.tenant] -= 1
            if not self._per_tenant[scope.tenant]:
                del self._per_tenant[scope.tenant]
        self.released += len(gone)
        return len(gone)

    def scopes_of(self, tenant: str) -> int:
        return self._per_tenant.get(tenant, 0)

    # -- the guard's counts -----------------------------------------------------------------
    def refused(self, wanted_tag: bytes, held_tags: bytes | Iterable[bytes]) -> bool:
        """Count a lookup in `wanted_tag` refused because the same key is held under `held_tags`
        (one tag, or several): the reason is that of the closest holder of the caller's own tenant
        if any, else cross_tenant."""
        wanted = self._scopes.get(wanted_tag)
        if wanted is None:
            return False
        reason = None
        for tag in ((held_tags,) if held_tags.__class__ is bytes else held_tags):
            held = self._scopes.get(tag)
            if held is None or tag == wanted_tag:
                continue
            r = refusal_reason(wanted, held)
            if reason is None or REASONS.index(r) > REASONS.index(reason):
                reason = r  # the closest: the field that differs is the least severe
        if reason is None:
            return False
        self.refusals[(wanted.tenant, reason)] += 1
        return True

    def refusals_of(self, tenant: str | None = None) -> dict[str, int]:
        """Refusals by reason, of one tenant's lookups or (None) of everyone's: the operator's view."""
        out = dict.fromkeys(REASONS, 0)
        for (t, reason), n in self.refusals.items():
            if tenant is None or t == tenant:
                out[reason] += n
        return out

    def refusals_seen_by(self, tenant: str) -> dict[str, int]:
        """What `tenant` is shown of its own refusals (INFO): those that tell of its own keys only,
        so cross_tenant is always 0 (its count tells whether another tenant holds a key)."""
        out = self.refusals_of(tenant)
        out["cross_tenant"] = 0
        return out

    @property
    def total_refusals(self) -> int:
        return sum(self.refusals.values())


def refusal_reason(wanted: IdentityScope, held: IdentityScope) -> str:
    """The first identity field that differs, in order of severity."""
    if wanted.tenant != held.tenant:
        return "cross_tenant"
    if wanted.model != held.model:
        return "cross_model"
    if wanted.tokenizer != held.tokenizer:
        return "cross_tokenizer"
    return "cross_adapter"
