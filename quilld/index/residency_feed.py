"""Where this node's tracked values are, told to those who need to know.

The store reports every placement of a tracked value (an arena block, or any
value published with an engine block hash) and every removal. The feed
mirrors block hashes into the control plane's residency index, so ROUTE
credits this pool's own copies, and hands every change to the cluster's directory,
so peers can find the key here.
"""

from __future__ import annotations

from typing import Any

from quilld.index.residency import ResidencyIndex
from quilld.model import CacheTier
from quilld.scopes import TAG_LEN, ScopeRegistry

_LOCAL = (CacheTier.DRAM, CacheTier.SSD)


class ResidencyFeed:
    def __init__(self, index: ResidencyIndex, holder: str, scopes: ScopeRegistry) -> None:
        self.index = index
        self.holder = holder
        self.scopes = scopes
        self.log: Any = None  # the cluster's directory (cluster/dir_link.py) once the node is in a cluster

    def placed(self, fk: bytes, tier: CacheTier, nbytes: int, bhash: int | bytes | None) -> None:
        """The value of `fk` is now (only) in `tier` of this node: just written."""
        self._credit(fk, tier, bhash)
        if self.log is not None:
            self.log.placed(fk, tier, nbytes, bhash)

    def moved(self, fk: bytes, tier: CacheTier, nbytes: int, bhash: int | bytes | None) -> None:
        """The same value of `fk` is now (only) in `tier` (a demotion, a promotion, a recovery)."""
        self._credit(fk, tier, bhash)
        if self.log is not None:
            self.log.moved(fk, tier, nbytes, bhash)

    def _credit(self, fk: bytes, tier: CacheTier, bhash: int | bytes | None) -> None:
        if bhash is not None:
            tag, index, holder = fk[:TAG_LEN], self.index, self.holder
            for other in _LOCAL:
                if other is not tier:
                    index.remove(tag, bhash, holder, other)
            index.put(tag, bhash, holder, tier)

    def removed(self, fk: bytes, bhash: int | bytes | None) -> None:
        """The value of `fk` is gone from this node."""
        tag = fk[:TAG_LEN]
        if bhash is not None:
            for t in _LOCAL:
                self.index.remove(tag, bhash, self.holder, t)
        if self.log is not None:
            self.log.removed(fk, bhash)
