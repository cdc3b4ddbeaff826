"""SGLang 0.5.23's HiCache objects as a storage backend sees them, over numpy (SGLang needs torch).

- `StorageConfig`: the `HiCacheStorageConfig` fields a backend reads;
- `HostPool`, `MLAHostPool`: `MHATokenToKVPoolHost` and `MLATokenToKVPoolHost`
  (`sglang/srt/mem_cache/pool_host/mha.py`, `mla.py`) in their layouts: the buffer's shape and
  the page methods HiCache storage calls, as SGLang writes them;
- `PoolTransfer`: the v2 calls' transfer (`mem_cache/hicache_storage.py`);
- `page_hashes`: SGLang's page keys (`mem_cache/utils.py` `get_storage_hash_str`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

STORAGE_BATCH_SIZE = 128  # sglang/srt/mem_cache/hicache_storage.py: pages per batched storage call
PAGE, SG_LAYERS, SG_HEADS, SG_DIM = 4, 2, 2, 8


@dataclass
class StorageConfig:
    """The HiCacheStorageConfig fields a backend reads (SGLang 0.5.23)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    enable_storage_metrics: bool = False
    is_page_first_layout: bool = True
    model_name: str | None = "Qwen/Qwen3-8B"
    extra_config: dict | None = None
    dcp_size: int = 1
    dcp_rank: int = 0
    tp_lcm_size: int | None = None
    should_split_heads: bool = False
    dp_rank: int = 0
    logical_page_size: int | None = None


class HostPool:
    """SGLang 0.5.23's MHATokenToKVPoolHost (mem_cache/pool_host/mha.py) over numpy, in one of its
    layouts: the buffer's shape and the page methods HiCache storage uses, as SGLang writes them.
    `page_unified` keeps SGLang's refusals (no flat page, no per-page buffers)."""

    def __init__(self, pages: int, seed: int | None = None, layers: int = SG_LAYERS, layout: str = "page_first",
                 page_size: int = PAGE, heads: int = SG_HEADS) -> None:
        self.page_size, self.size, self.page_num, self.layer_num = page_size, pages * page_size, pages, layers
        self.head_num, self.head_dim, self.layout = heads, SG_DIM, layout
        shape = {"layer_first": (2, layers, self.size, heads, SG_DIM),
                 "page_first": (2, self.size, layers, heads, SG_DIM),
                 "page_first_direct": (2, pages, layers, page_size, heads, SG_DIM),
                 "page_unified": (pages, 2 * layers * page_size * heads * SG_DIM)}[layout]
        self.kv_buffer = np.zeros(shape, np.float16)
        if seed is not None:
            self.kv_buffer[:] = np.random.default_rng(seed).standard_normal(shape)

    def _page(self, index: int) -> np.ndarray:
        index = int(index)
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, index:index + self.page_size]
        if self.layout == "page_first":
            return self.kv_buffer[:, index:index + self.page_size]
        if self.layout == "page_first_direct":
            return self.kv_buffer[:, index // self.page_size:index // self.page_size + 1]
        raise ValueError(f"Unsupported layout: {self.layout}")

    def get_data_page(self, index: int, flat: bool = True) -> np.ndarray:
        return self._page(index).flatten() if flat else self._page(index)

    def get_dummy_flat_data_page(self) -> np.ndarray:
        return np.zeros(2 * self.layer_num * self.page_size * self.head_num * SG_DIM, np.float16)

    def set_from_flat_data_page(self, index: int, data_page: np.ndarray) -> None:
        page = self._page(index)
        page[...] = data_page.reshape((2, self.layer_num, self.page_size, self.head_num, SG_DIM)
                                      if self.layout == "layer_first" else page.shape)

    def get_page_buffer_meta(self, indices) -> tuple[list[int], list[int]]:
        """MHATokenToKVPoolHost.get_page_buffer_meta: K and V per page (per layer in layer_first)."""
        assert len(indices) % self.page_size == 0
        indices = indices.tolist()
        item, base = self.kv_buffer.itemsize, self.kv_buffer.ctypes.data
        row = self.head_num * SG_DIM * item
        v_offset = self.layer_num * self.size * row
        ptrs = []
        if self.layout == "layer_first":
            for index in range(0, len(indices), self.page_size):
                for layer in range(self.layer_num):
                    k = base + indices[index] * row + layer * self.size * row
                    ptrs += [k, k + v_offset]
            return ptrs, [item * self.page_size * self.head_num * SG_DIM] * len(ptrs)
        if self.layout in ("page_first", "page_first_direct"):
            for index in range(0, len(indices), self.page_size):
                k = base + indices[index] * self.layer_num * row
                ptrs += [k, k + v_offset]
            return ptrs, [self.layer_num * item * self.page_size * self.head_num * SG_DIM] * len(ptrs)
        raise ValueError(f"Unsupported layout: {self.layout}")

    def page(self, index: int) -> np.ndarray:
        """The page at host index `index` as the generic path stores it (a copy)."""
        return self.get_data_page(index).copy()


class MLAHostPool(HostPool):
    """SGLang 0.5.23's MLATokenToKVPoolHost (mem_cache/pool_host/mla.py): one latent row a token
    and layer, no V; layer_first and page_first."""

    KV_DIM = 48

    def __init__(self, pages: int, seed: int | None = None, layers: int = SG_LAYERS, layout: str = "page_first") -> None:
        self.page_size, self.size, self.layer_num, self.layout = PAGE, pages * PAGE, layers, layout
        shape = {"layer_first": (layers, self.size, 1, self.KV_DIM),
                 "page_first": (self.size, layers, 1, self.KV_DIM)}[layout]
        self.kv_buffer = np.zeros(shape, np.float16)
        if seed is not None:
            self.kv_buffer[:] = np.random.default_rng(seed).standard_normal(shape)

    def _page(self, index: int) -> np.ndarray:
        index = int(index)
        if self.layout == "layer_first":
            return self.kv_buffer[:, index:index + self.page_size]
        return self.kv_buffer[index:index + self.page_size]

    def get_dummy_flat_data_page(self) -> np.ndarray:
        return np.zeros(self.layer_num * self.page_size * self.KV_DIM, np.float16)

    def set_from_flat_data_page(self, index: int, data_page: np.ndarray) -> None:
        page = self._page(index)
        page[...] = data_page.reshape(page.shape)

    def get_page_buffer_meta(self, indices) -> tuple[list[int], list[int]]:
        """MLATokenToKVPoolHost.get_page_buffer_meta: one buffer a page, or one a layer (layer_first)."""
        indices = indices.tolist()
        item, base, row = self.kv_buffer.itemsize, self.kv_buffer.ctypes.data, self.KV_DIM * 2
        ptrs = []
        if self.layout == "layer_first":
            for index in indices[::self.page_size]:
                ptrs += [base + index * row + layer * self.size * row for layer in range(self.layer_num)]
            return ptrs, [item * self.page_size * self.KV_DIM] * len(ptrs)
        for index in indices[::self.page_size]:
            ptrs.append(base + index * self.layer_num * row)
        return ptrs, [self.layer_num * item * self.page_size * self.KV_DIM] * len(ptrs)


def page_hashes(tokens: list[int], prior: str | None = None, extra_key: str | None = None,
                cache_salt: str | None = None) -> list[str]:
    """SGLang's page keys (mem_cache/utils.py get_storage_hash_str): SHA-256 of the prior digest and the
    page's uint32 tokens, chained; a new chain starts from the request's namespace seed when it has
    an extra key (LoRA and the like) or a cache salt (storage_namespace_seed), else from nothing."""
    if prior is None and (extra_key, cache_salt) != (None, None):
        seed = hashlib.sha256(b"sglang-cache-namespace-v1")
        for part in (extra_key, cache_salt):
            raw = None if part is None else part.encode()
            seed.update(b"\x00" if raw is None else b"\x01" + len(raw).to_bytes(8, "little") + raw)
        prior = seed.hexdigest()
    out, digest = [], bytes.fromhex(prior) if prior else b""
    for start in range(0, len(tokens) - len(tokens) % PAGE, PAGE):
        digest = hashlib.sha256(digest + np.asarray(tokens[start:start + PAGE], "<u4").tobytes()).digest()
        out.append(digest.hex())
    return out


@dataclass
class PoolTransfer:
    """SGLang 0.5.23's PoolTransfer (mem_cache/hicache_storage.py), the fields a backend reads."""

    name: str
    host_indices: Any = None
    device_indices: Any = None
    keys: list[str] | None = None
    hit_policy: str = "all_pages"
    nodes_to_load: Any = None
    indices_from_pool: str | None = None
    block_pages: int = 0
    group_pages: int = 0
