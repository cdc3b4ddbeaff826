"""Identity scopes as compact key prefixes, and the guard that counts refusals.

Every distinct IdentityScope is interned once and given a 4-byte tag; a key
is stored as `tag + key`, so equal keys in different scopes can never meet.
A lookup that misses in its own scope but would have matched in another one
is a refused cross-scope reuse: it is counted by reason, never served.
"""

from __future__ import annotations

from collections import Counter

from quilld.model import IdentityScope

TAG_LEN = 4


class ScopeRegistry:
    def __init__(self) -> None:
        self._tags: dict[IdentityScope, bytes] = {}
        self._scopes: list[IdentityScope] = []
        self.refusals: Counter[str] = Counter()

    def tag(self, scope: IdentityScope) -> bytes:
        tag = self._tags.get(scope)
        if tag is None:
            tag = len(self._scopes).to_bytes(TAG_LEN, "big")
            self._tags[scope] = tag
            self._scopes.append(scope)
        return tag

    def scope_of(self, tag: bytes) -> IdentityScope:
        return self._scopes[int.from_bytes(tag[:TAG_LEN], "big")]

    def tags(self) -> list[bytes]:
        return list(self._tags.values())

    @property
    def total_refusals(self) -> int:
        return sum(self.refusals.values())

    def audit_miss(self, tag: bytes, key: bytes, contains) -> bool:
        """After a miss of `key` in scope `tag`: count a refusal if another scope holds it.

        `contains(full_key)` tells whether a stored key exists. Returns True when
        the lookup was refused rather than a plain miss.
        """
        if len(self._scopes) < 2:
            return False
        mine = self.scope_of(tag)
        for other_scope, other in self._tags.items():
            if other != tag and contains(other + key):
                self.refusals[refusal_reason(mine, other_scope)] += 1
                return True
        return False


def refusal_reason(wanted: IdentityScope, held: IdentityScope) -> str:
    """The first identity field that differs, in order of severity."""
    if wanted.tenant != held.tenant:
        return "cross_tenant"
    if wanted.model != held.model:
        return "cross_model"
    if wanted.tokenizer != held.tokenizer:
        return "cross_tokenizer"
    return "cross_adapter"
