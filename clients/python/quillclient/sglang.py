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

Calls, as SGLang's cache controller makes them (`sglang/srt/managers/cache_controller.py`):

- default ("generic") path: `batch_exists(page_hashes) -> int`, the leading run of
  stored pages; `batch_get(page_hashes, [flat page tensor per key])`, each block read
  straight into its tensor (`get_many_into`, one pipelined socket); `batch_set(page_hashes,
  [flat page tensor per key]) -> bool` through `put_blocks` (PUT2PHASE, CRC32C). One
  object per page holds its K and V.
- `"interface_v1": 1` in the extra config: `batch_get_v1` / `batch_set_v1` with host
  indices. The host pool's `get_page_buffer_meta` gives one (MLA) or two (MHA: K, V)
  addresses per page, and quilld's bytes go to and from the host pool itself, with no
  staging tensor. Layouts with more buffers per page (MHA `layer_first`) are refused,
  as SGLang's Mooncake backend refuses them.

A page key is SGLang's page hash (64 hex characters of a SHA-256 chain over the token
ids) plus what tells ranks apart: `_{tp_rank}_{tp_size}` for MHA (each rank holds its
own heads), nothing for MLA (one copy, written by rank 0), then `_pp{r}_{n}`,
`_cp{r}_{n}`, `_dcp{r}_{n}` when those are in use, then `_k` / `_v` on the v1 path.
The model goes into quilld's identity scope (`SCOPE model tokenizer`), not the key.

Targets may be anything with the buffer protocol (numpy arrays, bytearray, mmap),
CPU torch tensors (torch is looked up in `sys.modules`, never imported here), or raw
addresses (ints, with sizes), which is how SGLang's zero-copy calls name host memory.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from quillclient.client import QuillClient
from quillclient.errors import BufferTooSmall, QuillError

try:  # SGLang's factory accepts only subclasses of its own base; torch comes with it
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except ImportError:  # SGLang absent: a plain class with the same methods
    _Base = object

log = logging.getLogger(__name__)

# Extra-config keys that belong to SGLang itself (the factory, the controller), not to us.
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size", "prefetch_threshold",
    "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
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
    parallelism: int = 4  # connections uploading one batch_set at once

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> HiCacheSettings:
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(k for k in extra if k not in known and k not in SGLANG_KEYS)
        if unknown:
            raise ValueError(f"unknown QuillHiCacheStorage settings {unknown}; known: {sorted(known)}")
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


def key_suffix(config: Any) -> str:
    """What tells this rank's copy of a page from another rank's (see the module docstring)."""
    suffix = "" if getattr(config, "is_mla_model", False) else f"_{config.tp_rank}_{config.tp_size}"
    for name in ("pp", "attn_cp", "dcp"):
        size = getattr(config, f"{name}_size", 1) or 1
        if size > 1:
            suffix += f"_{name.removeprefix('attn_')}{getattr(config, f'{name}_rank')}_{size}"
    return suffix


def byte_view(target: Any, nbytes: int | None = None) -> memoryview:
    """A flat byte view of a page: a buffer, a CPU torch tensor, or an address with a size in bytes."""
    if isinstance(target, int) and not isinstance(target, bool):
        if nbytes is None or nbytes < 0:
            raise ValueError("an address target needs its size in bytes")
        return memoryview((ctypes.c_ubyte * nbytes).from_address(target)).cast("B")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(target, torch.Tensor):
        if target.device.type != "cpu":
            raise ValueError(f"HiCache storage reads host tensors, got one on {target.device}")
        if not target.is_contiguous():
            raise ValueError("HiCache storage needs contiguous tensors")
        target = target.reshape(-1).view(torch.uint8).numpy()
    view = memoryview(target)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view if nbytes is None else view[:nbytes]


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
        self.is_mla = bool(getattr(storage_config, "is_mla_model", False))
        s = self.settings
        model = s.model if s.model is not None else (getattr(storage_config, "model_name", None) or "")
        self.client = QuillClient(s.host, s.port, username=s.username, password=s.password,
                                  socket_timeout=s.socket_timeout, parallelism=s.parallelism,
                                  max_connections=max(32, s.parallelism),
                                  scope=(model, s.tokenizer, s.adapter) if model else None)
        try:
            self.client.ping()  # unreachable or refused: fail the attach now, not every page later
        except BaseException:
            self.client.close()
            raise
        self.mem_pool_host: Any = None

    def __repr__(self) -> str:
        return f"<QuillHiCacheStorage {self.client!r} suffix={self.suffix!r} v1={self.interface_v1}>"

    # -- keys ------------------------------------------------------------------

    def page_key(self, key: str) -> str:
        return key + self.suffix

    def object_keys(self, key: str) -> list[str]:
        """The quilld objects that make up one page, in `get_page_buffer_meta` order."""
        base = self.page_key(key)
        if not self.interface_v1:
            return [base]
        return [base + "_k"] if self.is_mla else [base + "_k", base + "_v"]

    # -- life cycle ------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host

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
            return all(self.client.exists(k) for k in self.object_keys(key))
        except QuillError as e:
            log.warning("quilld EXISTS %s failed: %s", key, e)
            return False

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many pages, from the first, are stored: one pipelined round of EXISTS."""
        if not keys:
            return 0
        names = [self.object_keys(k) for k in keys]
        try:
            replies = self.client.exists_many([n for group in names for n in group])
        except QuillError as e:
            log.warning("quilld batch EXISTS failed: %s", e)
            return 0
        it = iter(replies)
        for i, group in enumerate(names):
            if not all(next(it) for _ in group):
                return i
        return len(keys)

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
        for i, target in enumerate(targets):
            if target is None and self.mem_pool_host is not None:
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
        """Pages read straight into the host pool at `host_indices` (SGLang's zero-copy path)."""
        names, views = self._host_buffers(keys, host_indices)
        lengths = self._read(names, views)
        per = len(names) // max(1, len(keys))
        return [all(lengths[j] == views[j].nbytes for j in range(i * per, (i + 1) * per)) for i in range(len(keys))]

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
        return self._write(items)

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Pages written straight from the host pool at `host_indices`; per page whether it is stored."""
        names, views = self._host_buffers(keys, host_indices)
        ok = self._write(list(zip(names, views)))
        return [ok] * len(keys)

    def _write(self, items: list[tuple[str, memoryview]]) -> bool:
        # put_blocks answers False for a page some other rank or engine already completed: kept, fine.
        try:
            self.client.put_blocks(items)
            return True
        except QuillError as e:
            log.warning("quilld put of %d pages failed: %s", len(items), e)
            return False

    def _host_buffers(self, keys: list[str], host_indices: Any) -> tuple[list[str], list[memoryview]]:
        if self.mem_pool_host is None:
            raise RuntimeError("register_mem_pool_host was not called")
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        names = [name for k in keys for name in self.object_keys(k)]
        if len(ptrs) != len(names):
            raise ValueError(f"{len(ptrs)} host buffers for {len(keys)} pages: QuillHiCacheStorage stores one "
                             f"buffer per {'page' if self.is_mla else 'page for K and one for V'} "
                             "(use a page_first layout)")
        return names, [byte_view(p, s) for p, s in zip(ptrs, sizes)]


__all__ = ["QuillHiCacheStorage", "HiCacheSettings", "key_suffix", "byte_view", "SGLANG_KEYS"]
