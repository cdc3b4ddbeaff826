"""Which blocks follow which, so that eviction keeps a usable prefix.

A KV prefix is only worth its first blocks: block n is loaded only when blocks 0..n-1 are, so
evicting a chain's head strands every block after it. Blocks stored with their engine hash and
their parent's (`PUT2PHASE BEGIN ... HASH h PARENT p`, `SHM RESERVE ... CHAINED`) are linked
here, within their scope: the keyspace's LRU eviction (allkeys-lru, the default) then drops

1. first an *orphan*: a block whose parent was named but is not here (it was never stored, or
   went): nothing can load it;
2. else, for the least recently used value, the deepest block of the chain it heads (following
   its most recent child, at most MAX_DESCENT steps): its tail, not its head.

So a chain written past the arena's size keeps its first blocks, as many as fit, and each new
block beyond them goes first. Plain keys and blocks with no parent are evicted as before. The
cost per eviction is one dict look-up per step down the chain; a block costs three dict entries.
"""

from __future__ import annotations

from typing import Any, Callable

MAX_DESCENT = 4096  # steps down a chain looking for its tail, per eviction


class Chains:
    def __init__(self) -> None:
        self.key_of: dict[tuple[bytes, Any], bytes] = {}  # (scope tag, block hash) -> full key
        self.block_of: dict[bytes, tuple[bytes, Any]] = {}  # full key -> (scope tag, block hash)
        self.parent: dict[bytes, bytes] = {}  # full key -> its parent's full key (both here)
        self.kids: dict[bytes, dict[bytes, None]] = {}  # full key -> its children here, oldest first
        # blocks whose named parent is not here, oldest first -> that parent's (scope tag, hash)
        self.orphans: dict[bytes, tuple[bytes, Any]] = {}
        self.waiting: dict[tuple[bytes, Any], dict[bytes, None]] = {}  # absent parent -> orphans naming it

    def added(self, fk: bytes, tag: bytes, bhash: Any, parent: Any) -> None:
        """`fk` (of scope `tag`) now holds block `bhash`, whose parent is `parent` (None: a head)."""
        block = (tag, bhash)
        self.key_of[block] = fk
        self.block_of[fk] = block
        for kid in self.waiting.pop(block, {}):  # a parent stored after its children adopts them
            self._link(kid, fk)
        if parent is None:
            return
        pfk = self.key_of.get((tag, parent))
        if pfk is None or pfk == fk:
            self._orphan(fk, (tag, parent))
        else:
            self._link(fk, pfk)

    def _orphan(self, fk: bytes, parent: tuple[bytes, Any]) -> None:
        self.orphans[fk] = parent
        self.waiting.setdefault(parent, {})[fk] = None

    def _link(self, fk: bytes, pfk: bytes) -> None:
        self.orphans.pop(fk, None)
        self.parent[fk] = pfk
        self.kids.setdefault(pfk, {})[fk] = None

    def removed(self, fk: bytes) -> None:
        """`fk` left the keyspace (deleted, evicted, overwritten): its children are orphans now."""
        block = self.block_of.pop(fk, None)
        if block is None:
            return
        if self.key_of.get(block) == fk:
            del self.key_of[block]
        awaited = self.orphans.pop(fk, None)
        if awaited is not None:
            waiting = self.waiting.get(awaited)
            if waiting is not None:
                waiting.pop(fk, None)
                if not waiting:
                    del self.waiting[awaited]
        pfk = self.parent.pop(fk, None)
        if pfk is not None:
            siblings = self.kids.get(pfk)
            if siblings is not None:
                siblings.pop(fk, None)
                if not siblings:
                    del self.kids[pfk]
        for kid in self.kids.pop(fk, {}):
            self.parent.pop(kid, None)
            self._orphan(kid, block)

    def victim(self, front: bytes, evictable: Callable[[bytes], bool]) -> bytes:
        """The key to evict instead of `front` (the least recently used): an orphan, else the
        tail of the chain `front` heads; `front` itself when neither applies."""
        for fk in self.orphans:
            if evictable(fk):
                return fk
        fk, steps = front, 0
        while steps < MAX_DESCENT:
            kids = self.kids.get(fk)
            if not kids:
                break
            fk = next(reversed(kids))
            steps += 1
        return fk if fk != front and evictable(fk) else front
