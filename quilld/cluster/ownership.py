"""Who owns which part of the directory: rendezvous hashing over the live members.

Every directory entry has a *shard key* (bytes); the shard key hashes to one of
`buckets` virtual buckets (a power of two), and each bucket has `replicas` owner
nodes: the members with the highest rendezvous (highest-random-weight) scores
for it. A member's score for a bucket is a 64-bit mix of the bucket's and the
member's hashes, turned into `-weight / ln(u)` with `u` uniform in (0, 1), so
that with weights (capacity, when `weighted`) a member owns a share of buckets
proportional to its weight, and without them every member an equal share.

Why buckets and not the keys themselves: a node looks up owners on every pool
read and every placement, and with a thousand members a per-key rendezvous is a
thousand hashes. Per bucket, the owners are kept in a table that changes only
where a membership change moves them, and a key costs one hash and one table
read. Ceph places objects the same way (object -> placement group -> OSDs).

A membership change moves only the buckets whose top-`replicas` set changes: a
new member takes over, in expectation, `replicas * buckets / n` bucket slots, a
departed member's slots pass to the next-highest scorer, and no other bucket
moves. `update` answers which buckets changed, so holders and owners hand over
exactly those.

The table keeps each bucket's best `replicas + SPARE` members, best first, with
how many of them are exact (`depth`): an arrival is compared with each bucket's
last exact entry (a vectorized pass over the buckets), a departure shifts the
rest up, and only a bucket left with fewer exact entries than owners is scored
again against every member. A member's scores for every bucket (its *column*)
are kept for the next view.

The table is a pure function of (members, weights, buckets, replicas): any two
nodes with the same view agree on every owner. Tables are memoized by that view
(a simulation of a thousand nodes with one view builds it once).

Pure computation: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_SALT = 0x51_7C_C1_B7_27_22_0A_95  # bucket seeds: splitmix64(bucket + _SALT)
SPARE = 4  # candidates kept past the owners in each bucket, so a departure rarely rescores a row
_MEMO_SIZE = 8
# Each member's scores for every bucket, kept for the next view (a member's column does not
# change while its weight does not), bounded in bytes.
COLUMN_CACHE_BYTES = 64 << 20
_columns: OrderedDict[tuple, np.ndarray] = OrderedDict()


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def member_hash(node_id: str) -> int:
    return xxhash.xxh64_intdigest(node_id.encode())


def _column(seeds: np.ndarray, name: str, weight: float) -> np.ndarray:
    """`name`'s rendezvous score for every bucket."""
    key = (len(seeds), name, weight)
    col = _columns.get(key)
    if col is None:
        h = _mix(seeds ^ np.uint64(member_hash(name)))
        u = ((h >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))  # uniform in (0, 1)
        col = weight / -np.log(u)
        _columns[key] = col
        while len(_columns) * col.nbytes > COLUMN_CACHE_BYTES and len(_columns) > 1:
            _columns.popitem(last=False)
    else:
        _columns.move_to_end(key)
    return col


class _Table:
    """One view's ranking: `ids[b]` are indices into `names`, best first (-1 pads); the first
    `depth[b]` are exact (the best of all members); the owners are the first `replicas`."""

    __slots__ = ("names", "scores", "ids", "depth", "rows", "by_member", "sets")

    def __init__(self, names: tuple[str, ...], scores: np.ndarray, ids: np.ndarray, depth: np.ndarray) -> None:
        self.names, self.scores, self.ids, self.depth = names, scores, ids, depth
        # filled as asked, and shared by every node holding this view (the memo hands out one table)
        self.rows: dict[int, tuple[str, ...]] = {}  # bucket -> owners, best first
        self.by_member: list[np.ndarray] | None = None  # member index -> its buckets
        self.sets: dict[str, frozenset[int]] = {}  # member -> its buckets, as a set

    @classmethod
    def empty(cls, buckets: int, width: int) -> "_Table":
        return cls((), np.full((buckets, width), -np.inf), np.full((buckets, width), -1, dtype=np.int64),
                   np.zeros(buckets, dtype=np.int64))

    def insert(self, col: np.ndarray, j: int, had: int) -> None:
        """Let member `j` (scores `col`) into each bucket's ranking; `had` members were there before."""
        scores, ids, depth = self.scores, self.ids, self.depth
        width = scores.shape[1]
        n = len(depth)
        last = scores[np.arange(n), np.maximum(depth - 1, 0)]
        last[depth == 0] = -np.inf
        # above the last exact entry; or below it, in a row that holds every member and has room
        rows = np.nonzero((col > last) | ((depth == had) & (depth < width)))[0]
        if not len(rows):
            return
        d = depth[rows]
        s = np.concatenate([scores[rows], col[rows, None]], axis=1)
        i = np.concatenate([ids[rows], np.full((len(rows), 1), j, dtype=np.int64)], axis=1)
        order = np.argsort(-s, axis=1, kind="stable")[:, :width]
        scores[rows] = np.take_along_axis(s, order, axis=1)
        ids[rows] = np.take_along_axis(i, order, axis=1)
        depth[rows] = np.minimum(d + 1, width)
        self._clear_beyond(rows)

    def _clear_beyond(self, rows: np.ndarray) -> None:
        width = self.scores.shape[1]
        dead = np.arange(width)[None, :] >= self.depth[rows][:, None]
        sub_s, sub_i = self.scores[rows], self.ids[rows]
        sub_s[dead], sub_i[dead] = -np.inf, -1
        self.scores[rows], self.ids[rows] = sub_s, sub_i


_memo: OrderedDict[tuple, _Table] = OrderedDict()


class Ownership:
    def __init__(self, buckets: int = 16384, replicas: int = 3, weighted: bool = False) -> None:
        if buckets <= 0 or buckets & (buckets - 1):
            raise ValueError(f"buckets must be a power of two, not {buckets}")
        if replicas < 1:
            raise ValueError("replicas must be at least 1")
        self.buckets = buckets
        self.replicas = replicas
        self.weighted = weighted
        self.width = replicas + SPARE
        self._mask = buckets - 1
        self._seeds = _mix(np.arange(buckets, dtype=np.uint64) + np.uint64(_SALT))
        self.members: dict[str, float] = {}
        self.version = 0  # raised by every change of the view
        self._table: _Table | None = None
        self._previous: _Table | None = None  # the view before the last change
        self._index: dict[str, int] = {}  # name -> its index in the table's names

    # -- keys ------------------------------------------------------------------------
    def bucket_of(self, shard: bytes) -> int:
        return xxhash.xxh3_64_intdigest(shard) & self._mask

    def owners(self, bucket: int) -> tuple[str, ...]:
        """The bucket's owners, best first (fewer than `replicas` only while there are fewer members)."""
        t = self._table
        if t is None:
            return ()
        row = t.rows.get(bucket)
        if row is None:
            names = t.names
            row = t.rows[bucket] = tuple(names[i] for i in t.ids[bucket, :self.replicas] if i >= 0)
        return row

    def previous_owners(self, bucket: int) -> tuple[str, ...]:
        """The bucket's owners in the view before the last change."""
        t = self._previous
        if t is None:
            return ()
        return tuple(t.names[i] for i in t.ids[bucket, :self.replicas] if i >= 0)

    def owners_of(self, shard: bytes) -> tuple[str, ...]:
        return self.owners(self.bucket_of(shard))

    def owned_by(self, node: str) -> np.ndarray:
        """The buckets `node` is one of the owners of."""
        t = self._table
        i = self._index.get(node)
        if t is None or i is None:
            return np.empty(0, dtype=np.int64)
        if t.by_member is None:  # every member's buckets at once: one sort of the owner columns
            flat = t.ids[:, :self.replicas].ravel()
            order = np.argsort(flat, kind="stable")
            cuts = np.searchsorted(flat[order], np.arange(len(t.names) + 1))
            buckets = order // self.replicas
            t.by_member = [buckets[cuts[j]:cuts[j + 1]] for j in range(len(t.names))]
        return t.by_member[i]

    def owned_set(self, node: str) -> frozenset[int]:
        """`owned_by` as a set (kept with the view, shared by every node that holds it)."""
        t = self._table
        if t is None:
            return frozenset()
        got = t.sets.get(node)
        if got is None:
            got = t.sets[node] = frozenset(self.owned_by(node).tolist())
        return got

    def is_owner(self, node: str, bucket: int) -> bool:
        return node in self.owners(bucket)

    # -- the view --------------------------------------------------------------------
    def update(self, members: dict[str, float]) -> np.ndarray:
        """Take a new view: member -> weight (ignored unless `weighted`). Returns the buckets
        whose owner set changed."""
        members = {m: (w if self.weighted and w > 0 else 1.0) for m, w in members.items()}
        if members == self.members and self._table is not None:
            return np.empty(0, dtype=np.int64)
        old = self._table
        key = (self.buckets, self.replicas, tuple(sorted(members.items())))
        table = _memo.get(key)
        if table is None:
            table = self._derive(old, members)
            _memo[key] = table
            while len(_memo) > _MEMO_SIZE:
                _memo.popitem(last=False)
        else:
            _memo.move_to_end(key)
        changed = self._changed(old, table)
        self._previous, self._table = old, table
        self.members = members
        self._index = {n: i for i, n in enumerate(table.names)}
        self.version += 1
        return changed

    def _derive(self, old: _Table | None, members: dict[str, float]) -> _Table:
        """The table for `members`, from the previous view's: departures shift rows up, arrivals
        are inserted, and a row left with fewer exact entries than owners is scored again."""
        if old is None or any(self.members.get(m, w) != w for m, w in members.items()):
            old = _Table.empty(self.buckets, self.width)  # a weight changed: rank everyone anew
            kept, added = [], sorted(members)
        else:
            kept = [n for n in old.names if n in members]
            added = [m for m in members if m not in old.names]
        names = kept + added
        index = {n: i for i, n in enumerate(names)}
        remap = np.array([index.get(n, -1) for n in old.names] + [-1], dtype=np.int64)
        ids = remap[old.ids]
        gone = (ids < 0) & (old.ids >= 0)
        scores = old.scores.copy()
        depth = old.depth.copy()
        if gone.any():
            hit = np.nonzero(gone.any(axis=1))[0]
            keep = ~gone[hit]
            order = np.argsort(~keep, axis=1, kind="stable")  # survivors first, in rank order
            sub_s = np.take_along_axis(np.where(keep, scores[hit], -np.inf), order, axis=1)
            sub_i = np.take_along_axis(np.where(keep, ids[hit], -1), order, axis=1)
            scores[hit], ids[hit] = sub_s, sub_i
            depth[hit] -= (gone[hit] & (np.arange(self.width)[None, :] < old.depth[hit][:, None])).sum(axis=1)
        table = _Table(tuple(names), scores, ids, depth)
        low = np.nonzero(depth < min(self.replicas, len(kept)))[0]
        if len(low):
            self._rescore(table, low, kept, members)
        had = len(kept)
        for n in added:
            table.insert(_column(self._seeds, n, members[n]), index[n], had)
            had += 1
        return table

    def _rescore(self, t: _Table, rows: np.ndarray, kept: list[str], members: dict[str, float]) -> None:
        """Rank `rows` anew against every kept member (their indices are 0..len(kept)-1)."""
        w = min(self.width, len(kept))
        m = np.stack([_column(self._seeds, n, members[n])[rows] for n in kept], axis=1)
        top = np.argpartition(-m, w - 1, axis=1)[:, :w] if len(kept) > w else \
            np.broadcast_to(np.arange(len(kept)), (len(rows), len(kept)))
        top_s = np.take_along_axis(m, top, axis=1)
        order = np.argsort(-top_s, axis=1, kind="stable")
        s = np.full((len(rows), self.width), -np.inf)
        i = np.full((len(rows), self.width), -1, dtype=np.int64)
        s[:, :w] = np.take_along_axis(top_s, order, axis=1)
        i[:, :w] = np.take_along_axis(top, order, axis=1)
        t.scores[rows], t.ids[rows], t.depth[rows] = s, i, w

    def _changed(self, old: _Table | None, new: _Table) -> np.ndarray:
        r = self.replicas
        if old is None:
            return np.arange(self.buckets)
        names = {n: i for i, n in enumerate(new.names)}
        remap = np.array([names.get(n, -2) for n in old.names] + [-1], dtype=np.int64)
        before = np.sort(remap[old.ids[:, :r]], axis=1)
        after = np.sort(new.ids[:, :r], axis=1)
        return np.nonzero((before != after).any(axis=1))[0]
