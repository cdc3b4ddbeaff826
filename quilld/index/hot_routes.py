"""Under which scopes each hot prefix was routed, so that who holds it can be asked.

The hot-prefix sketch (`sketch.py`) counts a routed prompt's first block by its bytes alone,
across scopes. To say who holds a hot prefix, the residency index (one node) or the cluster's
directory (every node) is asked per scope, with the block as ROUTE gave it: `HotRoutes` keeps,
for each key the sketch still tracks, the scopes (tags) it was routed under and that block.
Bounded: at most MAX_TAGS scopes a key (the latest), and keys the sketch no longer tracks are
dropped once there are twice as many as it tracks.
"""

from __future__ import annotations

from quilld.index.residency import BlockHash, hash_key
from quilld.index.sketch import HotPrefixes

MAX_TAGS = 8  # scopes remembered per hot prefix (a prefix shared by more tenants: the latest 8)


class HotRoutes:
    def __init__(self, sketch: HotPrefixes) -> None:
        self.sketch = sketch
        self._routes: dict[bytes, dict[bytes, BlockHash]] = {}  # key -> {tag: first block as routed}

    def note(self, tag: bytes, first: BlockHash) -> None:
        """A request of scope `tag` was routed with `first` as its first block: counted in the sketch."""
        key = hash_key(first)
        self.sketch.add(key)
        tags = self._routes.setdefault(key, {})
        tags.pop(tag, None)
        tags[tag] = first
        if len(tags) > MAX_TAGS:
            del tags[next(iter(tags))]
        if len(self._routes) > 2 * self.sketch.top_k:
            tracked = {k for k, _ in self.sketch.top()}
            self._routes = {k: v for k, v in self._routes.items() if k in tracked}

    def routed(self, key: bytes) -> list[tuple[bytes, BlockHash]]:
        """(tag, first block) of each scope `key` was routed under (none for a key never noted)."""
        return list(self._routes.get(key, {}).items())


__all__ = ["HotRoutes", "MAX_TAGS"]
