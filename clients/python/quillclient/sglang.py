"""QuillHiCacheStorage: quilld as SGLang's HiCache L3 storage, through its `dynamic` backend.

SGLang loads it by name and checks that it subclasses its `HiCacheStorage`::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "quill",
            "module_path": "quillclient.sglang", "class_name": "QuillHiCacheStorage",
            "host": "10.0.0.7", "port": 7379}'

`StorageBackendFactory` imports `module_path`, takes `class_name`, checks
`issubclass(cls, HiCacheStorage)` and calls `cls(storage_config, kwargs)` with a
`HiCacheStorageConfig` (ranks, model name, `extra_config`). So the base class is
SGLang's own when SGLang is importable, and `object` otherwise (this module must
import without SGLang or torch). docs/connectors.md has the whole recipe.

Calls, as SGLang's cache controller makes them (`HybridCacheController`, which every model runs on
in SGLang 0.5.23, over `sglang/srt/managers/cache_controller.py`):

- default ("generic") path: `batch_exists(page_hashes) -> int`, the leading run of
  stored pages (one `EXISTS` of all of them); `batch_get(page_hashes, [flat page tensor per
  key])`, each block read straight into its tensor (`get_many_into`: one `MGET` over TCP; over
  shared memory found in quilld's lookup table and copied with no round trip at all);
  `batch_set(page_hashes, [flat page tensor per key]) -> bool` through `put_blocks` (one
  `MPUTBLK` per round over TCP, one `SHM RESERVE` and one `SHM COMMIT` over shared memory,
  every block checked against its CRC32C). One object per page holds its K and V.
- `"interface_v1": 1` in the extra config: `batch_get_v1` / `batch_set_v1` with host
  indices. The host pool's `get_page_buffer_meta` gives a page's buffers (one for MLA
  `page_first`, K and V for MHA `page_first`, K and V of every layer for `layer_first`),
  and quilld's bytes go to and from the host pool itself, with no staging tensor: each
  page gathered into one object, the same bytes under the same key as the generic
  path's (see `host_layout`), so the two paths share pages and `get`, `exists` and
  `batch_exists` mean the same on both.

- the v2 batch calls, for the host pools besides the main KV pool that SGLang registers
  with `register_mem_host_pool_v2` (a speculative-decoding draft model's own KV pool,
  SWA, Mamba state, ...): `batch_set_v2(transfers)` and `batch_get_v2(transfers)` ->
  `{pool name: [ok per page]}`, `batch_exists_v2(keys, pool_transfers)` ->
  `PoolTransferResult` (the KV prefix, cut where a pool's `hit_policy` is not met).
  `HybridCacheController` (every model in SGLang 0.5.23) calls `batch_set_v2` for those
  pools before it stores the KV pages, so a backend without them stores nothing at all;
  when the KV pages then fail to store, the v2 pages stored for them are deleted again.
  A v2 page is one object, the pool's flat data page (`get_data_page` /
  `set_from_flat_data_page`, as SGLang's file backend does), named `<hash>.<pool>`.

The host pools' layouts are checked when SGLang registers them (`register_mem_pool_host`,
`register_mem_host_pool_v2`): a layout this backend cannot store raises ValueError there,
which fails SGLang's attach, instead of every backup failing after a successful start.

A page key is SGLang's page hash (64 hex characters of a SHA-256 chain over the token
ids, `get_storage_hash_str`) plus what tells ranks apart: `_{tp_rank}_{tp_size}` for MHA
(each rank holds its own heads), nothing for MLA (one copy, written by rank 0), then
`_pp{r}_{n}`, `_cp{r}_{n}`, `_dcp{r}_{n}` when those are in use. Mamba state is split over
TP ranks even in an MLA model: its pages always carry
the rank. The model goes into quilld's identity scope (`SCOPE model tokenizer`), not the key.

Targets may be anything with the buffer protocol (numpy arrays, bytearray, mmap),
CPU torch tensors (torch is looked up in `sys.modules`, never imported here), or raw
addresses (ints, with sizes), which is how SGLang's zero-copy calls name host memory.
"""

from __future__ import annotations

import difflib
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from quillclient import host_layout
from quillclient.host_layout import byte_view
from quillclient.client import QuillClient
from quillclient.errors import BufferTooSmall, QuillError

try:  # SGLang's factory accepts only subclasses of its own base; torch comes with it
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except ImportError:  # SGLang absent: a plain class with the same methods
    _Base = object


class _HitPolicy(str, Enum):
    """SGLang's PoolHitPolicy, where SGLang is absent (same values)."""

    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"
    BLOCK_GROUPS = "block_groups"


@dataclass
class _TransferResult:
    """SGLang's PoolTransferResult, where SGLang is absent (same fields)."""

    kv_hit_pages: int
    extra_pool_hit_pages: dict = field(default_factory=dict)
    restorable_prefix_pages: list | None = None


try:  # the v2 interface's types (SGLang 0.5.2x); the controller reads the result's fields
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransferResult
    KV_POOL: Any = PoolName.KV  # results are looked up by SGLang's own enum (its hash is the member's)
except ImportError:
    PoolHitPolicy, PoolTransferResult, KV_POOL = _HitPolicy, _TransferResult, "kv"

log = logging.getLogger(__name__)

# v2 pages remembered until their KV page is stored (a rank that stores v2 pages only, such as
# an MLA rank's Mamba state, never pairs them: the oldest are forgotten, never deleted)
UNPAIRED_MAX = 65536

# Extra-config keys that belong to SGLang itself, not to us: the factory's, the controller's
# (`interface_v1`), and `file_storage_path`, which SGLang adds to every backend's extra config
# when --file-storage-path is given. SGLang pops the prefetch keys, `hicache_storage_pass_prefix_keys`
# and `tp_lcm_size` before a backend sees the config; they are listed for configs built by hand.
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "file_storage_path", "tp_lcm_size",
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys",
})


@dataclass(frozen=True)
class HiCacheSettings:
    """Our part of `--hicache-storage-backend-extra-config` (unknown keys are refused)."""

    host: str = "127.0.0.1"
    port: int = 7379
    username: str | None = None
    password: str | None = None
    model: str | None = None  # the scope's model; SGLang's model name when unset
    tokenizer: str = ""
    adapter: str = ""
    socket_timeout: float = 30.0
    parallelism: int = 4  # connections uploading one batch_set at once (TCP)
    shared_memory: str = "auto"  # ClientConfig.shared_memory: "auto", "require" or "off"

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> HiCacheSettings:
        """Our settings out of the whole extra config. SGLang's keys pass; another key that
        looks like a misspelt setting of ours is an error; any other is some other part's
        (SGLang adds keys of its own across versions), ignored with a warning."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(k for k in extra if k not in known and k not in SGLANG_KEYS)
        typos = {k: difflib.get_close_matches(k, known, n=1, cutoff=0.75) for k in unknown}
        typos = {k: m[0] for k, m in typos.items() if m}
        if typos:
            raise ValueError(f"unknown QuillHiCacheStorage settings {sorted(typos)} (did you mean "
                             f"{', '.join(repr(m) for m in typos.values())}?); known: {sorted(known)}")
        if unknown:
            log.warning("QuillHiCacheStorage ignores extra config keys %s (neither its own nor SGLang's)", unknown)
        values: dict[str, Any] = {}
        for name, value in extra.items():
            if name not in known or value is None:
                continue
            want = {"port": int, "parallelism": int, "socket_timeout": float}.get(name, str)
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, want) or isinstance(value, bool):
                raise ValueError(f"QuillHiCacheStorage setting {name!r} must be {want.__name__}, got {value!r}")
            values[name] = value
        return cls(**values)


def key_suffix(config: Any, rank_sharded: bool = False) -> str:
    """What tells this rank's copy of a page from another rank's (see the module docstring).
    `rank_sharded`: a pool split over TP ranks even in an MLA model (Mamba state)."""
    replicated = getattr(config, "is_mla_model", False) and not rank_sharded
    suffix = "" if replicated else f"_{config.tp_rank}_{config.tp_size}"
    for name in ("pp", "attn_cp", "dcp"):
        size = getattr(config, f"{name}_size", 1) or 1
        if size > 1:
            suffix += f"_{name.removeprefix('attn_')}{getattr(config, f'{name}_rank')}_{size}"
    return suffix


class QuillHiCacheStorage(_Base):
    """SGLang's HiCacheStorage over a QuillClient: one instance per TP/PP rank, thread-safe."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = getattr(storage_config, "extra_config", None) or {}
        self.settings = HiCacheSettings.from_extra_config(extra)
        self.storage_config = storage_config
        if getattr(storage_config, "should_split_heads", False):
            raise ValueError("QuillHiCacheStorage does not split heads across TP sizes (tp_lcm_size)")
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        self.suffix = key_suffix(storage_config)
        self.sharded_suffix = key_suffix(storage_config, rank_sharded=True)
        self.registered_pools: dict[str, Any] = {}  # pool name -> host pool (register_mem_host_pool_v2)
        self.is_mla = bool(getattr(storage_config, "is_mla_model", False))
        s = self.settings
        model = s.model if s.model is not None else (getattr(storage_config, "model_name", None) or "")
        self.client = QuillClient(s.host, s.port, username=s.username, password=s.password,
                                  socket_timeout=s.socket_timeout, parallelism=s.parallelism,
                                  max_connections=max(32, s.parallelism), shared_memory=s.shared_memory,
                                  scope=(model, s.tokenizer, s.adapter) if model else None)
        try:
            self.client.ping()  # unreachable or refused: fail the attach now, not every page later
            transport = self.client.transport  # decided now: "require" without shared memory fails the attach
        except BaseException:
            self.client.close()
            raise
        log.info("QuillHiCacheStorage: pages move over %s%s", "shared memory" if transport == "shm" else "TCP",
                 f" ({self.client.shm_unavailable_reason})" if transport == "tcp" else "")
        self.mem_pool_host: Any = None
        self._lock = threading.Lock()
        self._unpaired: OrderedDict[str, list[str]] = OrderedDict()  # page hash -> v2 objects stored before it
        self.v1_layout: host_layout.V1PageLayout | None = None  # set by register_mem_pool_host with interface_v1

    def __repr__(self) -> str:
        return f"<QuillHiCacheStorage {self.client!r} suffix={self.suffix!r} v1={self.interface_v1}>"

    # -- keys ------------------------------------------------------------------

    def page_key(self, key: str) -> str:
        """The one quilld object of a KV page, on the generic and the v1 path alike."""
        return key + self.suffix

    # -- life cycle ------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The KV host pool. Its layout is checked here, where a ValueError fails SGLang's attach
        (`CacheController.attach_storage_backend`), rather than at every backup after it."""
        if self.interface_v1:
            self.v1_layout = host_layout.v1_page_layout(mem_pool_host, self.is_mla)
        else:
            host_layout.check_flat_pages(mem_pool_host, "kv")
        self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Another host pool (draft KV, SWA, Mamba...), read and written by the v2 calls as flat
        pages: checked here, as the KV pool is."""
        host_layout.check_flat_pages(host_pool, _pool_name(host_pool_name))
        self.registered_pools[_pool_name(host_pool_name)] = host_pool

    def on_host_pools_registered(self) -> None:
        """SGLang's end of registration: nothing to finalize, the pools are looked up per call."""

    def clear(self) -> None:
        """Drop every page in this scope (all ranks, all engines of the same model)."""
        self.client.execute("FLUSHALL")

    def close(self) -> None:
        self.client.close()

    def get_stats(self) -> None:
        return None

    # -- existence ---------------------------------------------------------------

    def exists(self, key: str) -> bool:
        try:
            return self.client.exists(self.page_key(key))
        except QuillError as e:
            log.warning("quilld EXISTS %s failed: %s", key, e)
            return False

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many pages, from the first, are stored. One `EXISTS` of every page counts them: all
        or none answers it (the usual cases), and so does a count `c` whose first `c` pages are
        all stored (the rest then are not: a stored prefix, as SGLang stores pages). Otherwise (a
        hole) one pipelined EXISTS a page finds the first missing one."""
        if not keys:
            return 0
        names = [self.page_key(k) for k in keys]
        try:
            stored = self.client.execute("EXISTS", *names, idempotent=True)
            if stored in (0, len(names)):
                return stored
            if self.client.execute("EXISTS", *names[:stored], idempotent=True) == stored:
                return stored
            replies = self.client.exists_many(names)
        except QuillError as e:
            log.warning("quilld batch EXISTS failed: %s", e)
            return 0
        return replies.index(False) if False in replies else len(keys)

    # -- reads -------------------------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """The page read into `target_location` (returned), or None on a miss or a short page."""
        return self.batch_get([key], [target_location], None if target_sizes is None else [target_sizes])[0]

    def batch_get(self, keys: list[str], target_locations: Sequence[Any] | None = None,
                  target_sizes: Sequence[int] | None = None) -> list[Any]:
        """Per key its filled target, or None. With no targets, the pool's dummy page (or bytes)."""
        if not keys:
            return []
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        sizes = list(target_sizes) if target_sizes is not None else [None] * len(keys)
        if not len(targets) == len(sizes) == len(keys):
            raise ValueError("keys, target_locations and target_sizes differ in length")
        out: list[Any] = [None] * len(keys)
        want = []
        dummy = self.mem_pool_host is not None and (self.v1_layout is None or self.v1_layout.generic_size)
        for i, target in enumerate(targets):
            if target is None and dummy:
                targets[i] = target = self.mem_pool_host.get_dummy_flat_data_page()
            if target is None:
                out[i] = self._get_bytes(keys[i])
            else:
                want.append(i)
        if want:
            views = [byte_view(targets[i], sizes[i]) for i in want]
            lengths = self._read([self.page_key(keys[i]) for i in want], views)
            for i, view, n in zip(want, views, lengths):
                out[i] = targets[i] if n == view.nbytes else None
        return out

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Pages read straight into the host pool at `host_indices` (SGLang's zero-copy path),
        each scattered over its buffers."""
        pages = self._host_pages(keys, host_indices)
        lengths = self._read([self.page_key(k) for k in keys], pages)
        return [n == self.v1_layout.nbytes for n in lengths]

    def _get_bytes(self, key: str) -> bytes | None:
        try:
            return self.client.get(self.page_key(key))
        except QuillError as e:
            log.warning("quilld GET %s failed: %s", key, e)
            return None

    def _read(self, names: list[str], views: list[memoryview]) -> list[int]:
        """Lengths read per object (-1: missing or unreadable); a page of another size is never used."""
        try:
            return self.client.get_many_into(names, views)
        except BufferTooSmall as e:  # a stored page larger than the target: another layout or dtype
            log.warning("quilld pages larger than their targets: %s", e)
            return [-1 if n is None else n for n in e.results]
        except QuillError as e:
            log.warning("quilld batch read of %d objects failed: %s", len(names), e)
            return [-1] * len(names)

    # -- writes ------------------------------------------------------------------

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value], None if target_location is None else [target_location],
                              None if target_sizes is None else [target_sizes])

    def batch_set(self, keys: list[str], values: Sequence[Any] | None = None,
                  target_locations: Sequence[Any] | None = None, target_sizes: Sequence[int] | None = None) -> bool:
        """Store every page (`values`, or the buffers/addresses in `target_locations`); True if all are in."""
        if not keys:
            return False
        n = len(keys)
        values = list(values) if values is not None else [None] * n
        targets = list(target_locations) if target_locations is not None else [None] * n
        sizes = list(target_sizes) if target_sizes is not None else [None] * n
        if not len(values) == len(targets) == len(sizes) == n:
            raise ValueError("keys, values, target_locations and target_sizes differ in length")
        items = []
        for key, value, target, size in zip(keys, values, targets, sizes):
            source = value if value is not None else target
            if source is None:
                raise ValueError(f"no data for page {key}")
            items.append((self.page_key(key), byte_view(source, size)))
        return self._write_kv(keys, items)

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Pages written straight from the host pool at `host_indices`, each gathered from its
        buffers into one object; per page whether it is stored."""
        try:
            pages = self._host_pages(keys, host_indices)
        except ValueError as e:
            log.error("QuillHiCacheStorage: %s", e)
            self._write_kv(keys, None)
            return [False] * len(keys)
        ok = self._write_kv(keys, [(self.page_key(k), page) for k, page in zip(keys, pages)])
        return [ok] * len(keys)

    def _write_kv(self, keys: list[str], items: list[tuple[str, Any]] | None) -> bool:
        """Store KV pages (None: they could not be read). SGLang stores a page's v2 objects (draft
        KV...) first: on success they are paired, on failure the ones this backend created
        without their KV page are deleted, so no page group is left half stored."""
        ok = items is not None and self._put(items) is not None
        with self._lock:
            if ok:
                for k in keys:
                    self._unpaired.pop(k, None)
                return True
            orphans = [name for names in self._unpaired.values() for name in names]
            self._unpaired.clear()
        if orphans:
            try:
                self.client.delete(*orphans)
            except QuillError as e:
                log.warning("quilld: deleting %d v2 pages left without their KV page failed: %s", len(orphans), e)
        return False

    def _put(self, items: list[tuple[str, Any]]) -> list[bool] | None:
        """Per item True if stored now, False if it already was (kept: some other rank or engine
        completed it); None if the put failed."""
        try:
            return self.client.put_blocks(items)
        except QuillError as e:
            log.warning("quilld put of %d pages failed: %s", len(items), e)
            return None

    # -- the v2 interface: pools besides the main KV pool -------------------------

    def pool_key(self, pool: Any, key: str) -> str:
        """The object of `key`'s page in `pool`: `<hash><rank suffix>` for the KV pool (as the
        generic path stores it), `<hash>.<pool><rank suffix>` for the others."""
        name = _pool_name(pool)
        if name == _pool_name(KV_POOL):
            return self.page_key(key)
        return f"{key}.{name}" + (self.sharded_suffix if name == "mamba" else self.suffix)

    def batch_exists_v2(self, keys: list[str], pool_transfers: Sequence[Any] | None = None,
                        extra_info: Any = None) -> Any:
        """The stored KV prefix of `keys`, cut to what every pool in `pool_transfers` can restore
        by its `hit_policy` (all pages, or the trailing `len(transfer.keys)` of the prefix)."""
        transfers = list(pool_transfers or [])
        if not keys:
            return PoolTransferResult(0, {}, [])
        names = [self.page_key(k) for k in keys]
        names += [self.pool_key(t.name, k) for t in transfers for k in keys]
        try:
            found = self.client.exists_many(names)
        except QuillError as e:
            log.warning("quilld batch EXISTS (v2) failed: %s", e)
            return PoolTransferResult(0, {}, [])
        it = iter(found)
        kv_present = [next(it) for _ in keys]
        kv_pages = kv_present.index(False) if False in kv_present else len(keys)
        present = {_pool_name(t.name): [next(it) for _ in keys] for t in transfers}
        hits: dict[Any, int] = {KV_POOL: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for t in transfers:
            if not restorable:
                break
            have = present[_pool_name(t.name)]
            policy = _policy(t.hit_policy)
            if policy == "all_pages":
                boundary = have[:kv_pages].index(False) if False in have[:kv_pages] else kv_pages
                ok = set(range(1, boundary + 1))
            elif policy == "trailing_pages":
                trailing = max(1, len(t.keys) if t.keys else 1)
                ok = {n for n in range(1, kv_pages + 1) if all(have[max(0, n - trailing):n])}
                boundary = max(ok, default=0)
            else:
                raise ValueError(f"QuillHiCacheStorage: unsupported pool hit policy {t.hit_policy!r}")
            if boundary:
                hits[t.name] = boundary
            restorable &= ok
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    def batch_get_v2(self, transfers: Sequence[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Each transfer's pages read into its host pool at `host_indices`: per pool, per page, ok."""
        results: dict[Any, list[bool]] = {}
        jobs = []  # (transfer name, page number, host pool, host offset, staging page)
        for t in transfers:
            keys, pool, offsets = self._v2_pages(t)
            results[t.name] = [False] * len(keys)
            if pool is not None:
                jobs += [(t.name, i, pool, off, pool.get_dummy_flat_data_page(), self.pool_key(t.name, k))
                         for i, (k, off) in enumerate(zip(keys, offsets))]
        if jobs:
            views = [byte_view(job[4]) for job in jobs]
            lengths = self._read([job[5] for job in jobs], views)
            for (name, i, pool, off, page, _), view, n in zip(jobs, views, lengths):
                if n == view.nbytes:
                    pool.set_from_flat_data_page(off, page)
                    results[name][i] = True
        return results

    def batch_set_v2(self, transfers: Sequence[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Each transfer's pages written from its host pool at `host_indices`: per pool, per page, ok
        (a page another rank or engine already stored counts as stored)."""
        results: dict[Any, list[bool]] = {}
        items, owners = [], []
        for t in transfers:
            keys, pool, offsets = self._v2_pages(t)
            results[t.name] = [False] * len(keys)
            if pool is not None:
                for i, (k, off) in enumerate(zip(keys, offsets)):
                    items.append((self.pool_key(t.name, k), byte_view(pool.get_data_page(off, flat=True))))
                    owners.append((t.name, i, k))
        created = self._put(items) if items else None
        if created is not None:
            with self._lock:
                for (name, i, key), (obj, _), new in zip(owners, items, created):
                    results[name][i] = True
                    if new:  # until its KV page is stored (see _write_kv)
                        self._unpaired.setdefault(key, []).append(obj)
                        self._unpaired.move_to_end(key)
                while len(self._unpaired) > UNPAIRED_MAX:
                    self._unpaired.popitem(last=False)
        return results

    def _v2_pages(self, transfer: Any) -> tuple[list[str], Any, list[int]]:
        """(keys, host pool or None when the transfer cannot be served, host offset per page)."""
        keys = list(transfer.keys or [])
        name = _pool_name(transfer.name)
        pool = self.registered_pools.get(name)
        if pool is None and name == _pool_name(KV_POOL):
            pool = self.mem_pool_host
        if pool is None:
            log.warning("QuillHiCacheStorage: no host pool registered as %r", name)
            return keys, None, []
        page_size = getattr(pool, "page_size", 1) or 1
        indices = transfer.host_indices
        if indices is None or len(indices) != len(keys) * page_size:
            log.error("QuillHiCacheStorage: %s host indices for %d pages of pool %r (page size %d)",
                      "no" if indices is None else len(indices), len(keys), name, page_size)
            return keys, None, []
        return keys, pool, [int(indices[i * page_size]) for i in range(len(keys))]

    def _host_pages(self, keys: list[str], host_indices: Any) -> list[Any]:
        """Per page, its buffers in the host pool (a view, or a list of views in the order of the
        generic path's flat page: see host_layout)."""
        if self.mem_pool_host is None:
            raise RuntimeError("register_mem_pool_host was not called")
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        return self.v1_layout.pages(ptrs, sizes, len(keys))


def _pool_name(name: Any) -> str:
    """A pool's name as a plain string: SGLang's PoolName members hash by member name, not value."""
    return str(getattr(name, "value", name))


def _policy(policy: Any) -> str:
    return str(getattr(policy, "value", policy) or "all_pages")


__all__ = ["QuillHiCacheStorage", "HiCacheSettings", "key_suffix", "byte_view", "SGLANG_KEYS", "KV_POOL"]
