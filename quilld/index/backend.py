"""The residency index's seam: one interface, its backends, and the one place that picks one.

Everything above the index (KV events, ROUTE, LOCATE, the feed of this node's own blocks, the
cluster's directory) calls the operations below and nothing else, whatever the backend:

- `memory`: `ResidencyIndex` (residency.py), the reference: dicts of int masks, updated in
  place; empty after a restart.
- `lmdb`: `PersistentIndex` (persistent.py) over LMDB, a copy-on-write B+tree opened by mmap;
  reads the same dicts, writes through in group commits; after a restart, the last commit.
- `rocksdb`: the same over RocksDB, an LSM tree.

A persistent backend keeps the in-memory index as its mirror for reads and writes its durable
holders' changes through to the storage engine (persistent.py); the storage study (docs/benchmarks/index-study.md)
measured reading through the engine instead, and an in-memory adaptive radix tree, and says why
neither is a backend here. The default stays `memory`: see the study for what the others cost.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from quilld.config import INDEX_BACKENDS, IndexConfig
from quilld.errors import ConfigError
from quilld.index.persistent import PersistentIndex
from quilld.index.residency import BlockHash, ResidencyIndex
from quilld.index.stores import DamagedStore, open_store
from quilld.model import CacheTier
from quilld.scopes import ScopeRegistry

BACKENDS = INDEX_BACKENDS
log = logging.getLogger("quilld.index")


class IndexBackend(Protocol):
    """What every backend answers, as ResidencyIndex answers it (its docstrings say what each does)."""

    backend: str
    persistent: bool
    tag_entries: dict[bytes, int]  # scope tag -> entries under it
    router_memo: dict  # the router's scratch, keyed by this index's holder numbers
    states: Callable[[], dict[str, dict]]  # the control plane's per-engine state, persisted beside the entries

    # updates
    def put(self, tag: bytes, block: BlockHash, holder: str, tier: CacheTier | str) -> bool: ...
    def put_many(self, tag: bytes, blocks: Iterable[BlockHash], holder: str, tier: CacheTier | str) -> int: ...
    def remove(self, tag: bytes, block: BlockHash, holder: str, tier: CacheTier | str) -> bool: ...
    def remove_many(self, tag: bytes, blocks: Iterable[BlockHash], holder: str, tier: CacheTier | str) -> int: ...
    def clear_holder(self, holder: str, tier: CacheTier | str | None = None) -> int: ...

    # queries: ROUTE's walk reads masks (leading_masks), the rest LOCATE, the guard and the admin API
    def masks(self, tag: bytes, blocks: list[BlockHash]) -> list[int]: ...
    def leading_masks(self, tag: bytes, blocks: list[BlockHash]) -> list[int]: ...
    def entries(self, tag: bytes) -> dict[int | bytes, int]: ...
    def has(self, key: bytes) -> bool: ...
    def held_elsewhere(self, tag: bytes, block: BlockHash) -> list[bytes]: ...
    def locate(self, tag: bytes, blocks: Iterable[BlockHash]) -> list[list[tuple[str, CacheTier]]]: ...
    def prefix_lengths(self, tag: bytes, blocks: list[BlockHash]) -> dict[str, int]: ...
    def holder_entries(self, holder: str) -> list[tuple[bytes, bytes, int]]: ...
    def holder_tags(self) -> dict[str, set[bytes]]: ...
    def snapshot(self) -> dict[tuple[bytes, bytes], list[tuple[str, CacheTier]]]: ...

    # holders and counts
    def holder_bits(self, holder: str) -> int: ...
    def holder_no(self, holder: str) -> int | None: ...
    def holder_count(self) -> int: ...
    def holders(self) -> list[str]: ...
    def slots(self, mask: int) -> list[tuple[str, CacheTier]]: ...
    def count(self, holder: str, tier: CacheTier | str) -> int: ...
    def __len__(self) -> int: ...

    # persistence (no-ops in memory)
    def keep(self, holder: str) -> None: ...
    def release(self, holder: str) -> None: ...
    def retain(self, holders: Iterable[str]) -> int: ...
    def groups_of(self, holder: str, kind: str) -> dict: ...
    def group_scope(self, holder: str, tag: bytes) -> dict: ...
    def engine_state(self, holder: str) -> dict | None: ...
    def committed_state(self, holder: str) -> dict | None: ...
    def flush(self, force: bool = False) -> None: ...
    def close(self) -> None: ...
    def describe(self) -> dict: ...


def open_index(cfg: IndexConfig, scopes: ScopeRegistry) -> ResidencyIndex:
    """The index `cfg` names; a persistent one is loaded from `index.path` before this returns. A
    damaged one (stores.DamagedStore) is moved aside (`<backend>.damaged-<time>`, kept for a look)
    and an empty one started, said in one line: the engines' replay fills it again."""
    if cfg.backend == "memory":
        return ResidencyIndex(scopes)
    if cfg.backend not in BACKENDS:  # validate() refuses it first; a caller building IndexConfig itself lands here
        raise ConfigError(f"index.backend must be one of {', '.join(BACKENDS)}, got {cfg.backend!r}")
    try:
        return _load(cfg, scopes)
    except DamagedStore as e:
        where = Path(cfg.path) / cfg.backend
        aside = where.with_name(f"{cfg.backend}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
        where.rename(aside)
        log.warning("index: the %s index in %s is damaged (%s): moved to %s, starting empty; the engines' "
                    "residencies come back from their KV events' replay", cfg.backend, where, e, aside.name)
        return _load(cfg, scopes)


def _load(cfg: IndexConfig, scopes: ScopeRegistry) -> PersistentIndex:
    store = open_store(cfg.backend, Path(cfg.path), cfg.fsync)
    try:
        return PersistentIndex(scopes, store, cfg.commit_ms)
    except BaseException:
        store.close()
        raise
