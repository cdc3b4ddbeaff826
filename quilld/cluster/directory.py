"""Which peers hold which keys, as followed from their replication logs.

Two views are kept up to date from the same entries: keys (for GETBLK's peer
fetch and LOCATE), and block hashes in the control plane's residency index
(so ROUTE credits a block held on any node of the cluster).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

from quilld.cluster.replog import PLACED, Entry
from quilld.index.residency import ResidencyIndex
from quilld.model import CacheTier
from quilld.scopes import ScopeRegistry

_LOCAL = (CacheTier.DRAM, CacheTier.SSD)


class Directory:
    def __init__(self, scopes: ScopeRegistry, blocks: ResidencyIndex) -> None:
        self.scopes = scopes
        self.keys = ResidencyIndex(scopes)  # holders are peer node ids; entries are keys, not hashes
        self.blocks = blocks
        self.applied: Counter[str] = Counter()  # peer -> entries applied
        # told of every key (scope tag + key) a peer's log places or removes, while keys are WATCHed
        self.touched: Callable[[bytes], None] | None = None

    def apply(self, peer: str, entries: list[Entry]) -> None:
        keys, blocks, tag_of, touched = self.keys, self.blocks, self.scopes.tag, self.touched
        for e in entries:
            tag = tag_of(e.scope)
            if touched is not None:
                touched(tag + e.key)
            for t in _LOCAL:
                if e.op != PLACED or t.value != e.tier:
                    keys.remove(tag, e.key, peer, t)
                    if e.bhash:
                        blocks.remove(tag, e.bhash, peer, t)
            if e.op == PLACED:
                keys.put(tag, e.key, peer, e.tier)
                if e.bhash:
                    blocks.put(tag, e.bhash, peer, e.tier)
        self.applied[peer] += len(entries)

    def forget(self, peer: str) -> int:
        """Drop everything known of `peer` (dead, left, or about to be resynced)."""
        self.blocks.clear_holder(peer)
        return self.keys.clear_holder(peer)

    def holders(self, tag: bytes, key: bytes) -> list[tuple[str, CacheTier]]:
        """Peers holding `key`, DRAM copies first."""
        places = self.keys.locate(tag, [key])[0]
        return sorted(places, key=lambda p: p[1] is not CacheTier.DRAM)
