"""SGLang HiCache: `quillclient.sglang.QuillHiCacheStorage` as SGLang 0.5.23 builds and calls it.

The backend is built the way SGLang's dynamic backend factory builds it, from the recipe in
docs/connectors.md (host and port swapped for the test's quilld), and called as its cache
controller calls it (`CacheController` / `HybridCacheController`), on host pools that copy
SGLang's own (`sglang/srt/mem_cache/pool_host/mha.py`, `mla.py`: the buffers' shapes in each
layout, `get_data_page`, `get_dummy_flat_data_page`, `set_from_flat_data_page`,
`get_page_buffer_meta`) over numpy. SGLang itself needs torch and is too heavy here; see
docs/connectors.md for how it was run by hand.

quilld listens on a unix socket and lets `default` map its arena, so the backend moves pages
through shared memory unless told `"shared_memory": "off"`; the tests that move pages run
both ways.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np
import pytest
from quillclient import QuillClient, QuillError, WrongPass

from conftest import ROOT, wait_until
from sglang_pools import PAGE, STORAGE_BATCH_SIZE, HostPool, MLAHostPool, PoolTransfer, StorageConfig, page_hashes

DOC = ROOT / "docs" / "connectors.md"

pytestmark = pytest.mark.timeout(90)


def recipe(name: str) -> str:
    """The fenced block right after `<!-- recipe: name -->` in docs/connectors.md."""
    m = re.search(rf"<!-- recipe: {re.escape(name)} -->\s*```\w*\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert m, f"docs/connectors.md has no recipe {name!r}"
    return m.group(1)


@pytest.fixture
def sock_dir():
    d = tempfile.mkdtemp(prefix="qh", dir="/tmp")  # unix socket paths must stay under 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def start_node(quilld_factory, sock_dir: str, password: str, dram: str = "256MiB"):
    """A quilld with the recipe's password, on a unix socket that lets `default` map its arena."""
    path = os.path.join(sock_dir, "q.sock")
    q = quilld_factory("--dram", dram, "--requirepass", password, "--unixsocket", path, "--map-users", "default")
    assert wait_until(lambda: os.path.exists(path), timeout=10)
    return q


@pytest.fixture
def backends():
    made: list = []
    yield made
    for b in made:
        b.close()


def factory(q, made: list, transport: str = "shm"):
    """Backends built the way SGLang's factory builds them, from the recipe, against `q`."""
    extra = json.loads(recipe("sglang-hicache"))

    def make(overrides: dict | None = None, **config) -> Any:
        cfg_extra = {**extra, "host": "127.0.0.1", "port": q.port,
                     "shared_memory": "require" if transport == "shm" else "off", **(overrides or {})}
        # StorageBackendFactory._create_dynamic_backend: import, getattr, cls(storage_config, kwargs)
        cls = getattr(importlib.import_module(cfg_extra["module_path"]), cfg_extra["class_name"])
        backend = cls(StorageConfig(extra_config=cfg_extra, **config), {})
        made.append(backend)
        return backend

    return make


@pytest.fixture(params=["shm", "tcp"])
def transport(request) -> str:
    return request.param


@pytest.fixture
def hicache(quilld_factory, sock_dir, backends):
    """Backends over shared memory, against a quilld with the recipe's password."""
    q = start_node(quilld_factory, sock_dir, json.loads(recipe("sglang-hicache"))["password"])
    return factory(q, backends)


@pytest.fixture
def hicache_both(quilld_factory, sock_dir, backends, transport):
    """`hicache`, over shared memory and over TCP (one test run each)."""
    q = start_node(quilld_factory, sock_dir, json.loads(recipe("sglang-hicache"))["password"])
    return factory(q, backends, transport)


def backup(backend, pool: HostPool, hashes: list[str], first_index: int = 0) -> None:
    """HiCacheController._page_backup with _generic_page_set: batches of flat data pages."""
    indices = np.arange(first_index, first_index + len(hashes) * PAGE)
    for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
        batch = hashes[i:i + STORAGE_BATCH_SIZE]
        data = [pool.get_data_page(int(indices[(i + j) * PAGE])) for j in range(len(batch))]
        assert backend.batch_set(batch, data) is True


def prefetch(backend, pool: HostPool, hashes: list[str]) -> int:
    """_storage_hit_query then _generic_page_get: count the hit, read into dummy pages, copy back."""
    hit: list[str] = []
    for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
        batch = hashes[i:i + STORAGE_BATCH_SIZE]
        n = backend.batch_exists(batch, None)
        hit += batch[:n]
        if n < len(batch):
            break
    for i in range(0, len(hit), STORAGE_BATCH_SIZE):
        batch = hit[i:i + STORAGE_BATCH_SIZE]
        pages = backend.batch_get(batch, [pool.get_dummy_flat_data_page() for _ in batch])
        for j, page in enumerate(pages):
            assert page is not None, f"page {i + j} counted as a hit, then missing"
            pool.set_from_flat_data_page((i + j) * PAGE, page)
    return len(hit)


def test_sglang_class_subclasses_sglangs_base_when_sglang_is_importable(tmp_path):
    """SGLang's factory requires issubclass(cls, HiCacheStorage): a stand-in base proves the lazy subclassing."""
    pkg = tmp_path / "sglang" / "srt" / "mem_cache"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "sglang", tmp_path / "sglang" / "srt", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "hicache_storage.py").write_text(
        "from abc import ABC, abstractmethod\n"
        "class HiCacheStorage(ABC):\n"
        "    def register_mem_pool_host(self, mem_pool_host):\n"
        "        self.mem_pool_host = mem_pool_host\n"
        + "".join(f"    @abstractmethod\n    def {m}(self, *a, **k): ...\n"
                  for m in ("get", "batch_get", "set", "batch_set", "exists")))
    probe = ("import quillclient.sglang as m\n"
             "from sglang.srt.mem_cache.hicache_storage import HiCacheStorage\n"
             "assert issubclass(m.QuillHiCacheStorage, HiCacheStorage)\n"
             "assert not m.QuillHiCacheStorage.__abstractmethods__, m.QuillHiCacheStorage.__abstractmethods__\n"
             "assert 'torch' not in __import__('sys').modules\n"
             "print('ok')\n")
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT / 'clients' / 'python'}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=30)
    assert done.stdout.strip() == "ok", done.stderr
    import quillclient.sglang as here
    assert here.QuillHiCacheStorage.__mro__[1] is object  # no SGLang here: plain base


def test_sglang_generic_path_backup_and_prefetch(hicache_both):
    generic = {"interface_v1": 0}
    writer, reader = hicache_both(generic), hicache_both(generic)  # two engines of the same model and ranks
    tokens = list(range(50_000, 50_000 + 130 * PAGE))
    hashes = page_hashes(tokens)
    assert len(hashes) == 130 and all(len(h) == 64 for h in hashes)
    src, dst = HostPool(130, seed=1), HostPool(130)
    backup(writer, src, hashes)
    assert prefetch(reader, dst, hashes) == 130
    assert np.array_equal(dst.kv_buffer, src.kv_buffer)
    # a prompt sharing the first 5 pages, then diverging: 5 hit
    other = page_hashes(tokens[:5 * PAGE] + [7] * (3 * PAGE))
    assert other[:5] == hashes[:5] and other[5] != hashes[5]
    assert reader.batch_exists(other) == 5
    assert reader.batch_exists([]) == 0
    # a hole: pages 0, 1 and 3 of a prompt stored, so 3 are stored but the first 2 lead
    holed = page_hashes(list(range(900_000, 900_000 + 4 * PAGE)))
    backup(writer, src, [holed[0], holed[1], holed[3]])
    assert reader.batch_exists(holed) == 2 and reader.batch_exists(holed[1:]) == 1
    assert reader.batch_exists(holed[2:]) == 0 and reader.batch_exists(holed[3:]) == 1
    # single-page calls; a miss is None / False
    page = dst.get_dummy_flat_data_page()
    assert reader.get(hashes[7], page) is page and np.array_equal(page, src.get_data_page(7 * PAGE))
    assert reader.get(other[6], dst.get_dummy_flat_data_page()) is None
    assert reader.exists(hashes[0]) and not reader.exists(other[7])
    got = reader.batch_get([hashes[0], other[6], hashes[1]], [dst.get_dummy_flat_data_page() for _ in range(3)])
    assert got[1] is None and got[0] is not None and got[2] is not None
    assert reader.set(other[5], value=src.get_data_page(0)) is True
    assert reader.batch_exists(other) == 6
    # SGLang's address form (mooncake-style callers): data_ptr() and a size in bytes
    page = src.get_data_page(3 * PAGE)
    out = np.zeros_like(page)
    assert reader.set(other[7], target_location=page.ctypes.data, target_sizes=page.nbytes) is True
    assert reader.get(other[7], out.ctypes.data, out.nbytes) == out.ctypes.data
    assert np.array_equal(out, page)
    # a page of another size (another layout or dtype) is never handed back
    with QuillClient(config=reader.client.config) as c:
        c.put(reader.page_key(other[6]), b"\x00" * 100)
    assert reader.get(other[6], dst.get_dummy_flat_data_page()) is None
    big = np.zeros(4, np.float16)
    assert reader.get(hashes[0], big) is None  # the stored page does not fit: nothing written
    assert not big.any()


def test_sglang_ranks_keep_their_heads_and_mla_is_shared(hicache):
    hashes = page_hashes(list(range(8 * PAGE)))
    rank0, rank1 = hicache(tp_rank=0, tp_size=2), hicache(tp_rank=1, tp_size=2)
    pool0, pool1 = HostPool(8, seed=10), HostPool(8, seed=11)
    backup(rank0, pool0, hashes)
    assert rank1.batch_exists(hashes) == 0  # rank 1's heads are not stored yet
    backup(rank1, pool1, hashes)
    for backend, pool in ((rank0, pool0), (rank1, pool1)):
        dst = HostPool(8)
        assert prefetch(backend, dst, hashes) == 8
        assert np.array_equal(dst.kv_buffer, pool.kv_buffer)
    assert rank0.page_key(hashes[0]) == hashes[0] + "_0_2"
    mla0, mla1 = hicache(tp_rank=0, tp_size=2, is_mla_model=True), hicache(tp_rank=1, tp_size=2, is_mla_model=True)
    backup(mla0, pool0, hashes)  # only the writer rank backs up; every rank reads the one copy
    dst = HostPool(8)
    assert prefetch(mla1, dst, hashes) == 8 and np.array_equal(dst.kv_buffer, pool0.kv_buffer)
    pp = hicache(pp_rank=1, pp_size=2)
    assert pp.page_key("ab") == "ab_0_1_pp1_2"


def test_sglang_clear_settings_and_auth(hicache):
    backend = hicache()
    hashes = page_hashes(list(range(4 * PAGE)))
    backup(backend, HostPool(4, seed=5), hashes)
    other_model = hicache({"model": "meta-llama/Llama-3.1-8B"})
    assert other_model.batch_exists(hashes) == 0  # the model is the scope
    backup(other_model, HostPool(4, seed=6), hashes)
    backend.clear()
    assert backend.batch_exists(hashes) == 0
    assert other_model.batch_exists(hashes) == 4  # clear() empties its own scope only
    with pytest.raises(ValueError, match=r"unknown QuillHiCacheStorage settings \['hots'\] \(did you mean 'host'"):
        hicache({"hots": "typo"})
    with pytest.raises(ValueError, match="'port' must be int"):
        hicache({"port": "7379"})
    with pytest.raises(WrongPass):
        hicache({"password": "wrong"})


def test_sglang_accepts_sglangs_own_extra_keys(hicache, caplog):
    """--file-storage-path makes SGLang add file_storage_path to every backend's extra config;
    interface_v1 is the controller's; keys of other parts are ignored with a warning."""
    backend = hicache({"file_storage_path": "/tmp/hicache", "interface_v1": 0, "enable_metadata_cache": True})
    hashes = page_hashes(list(range(3 * PAGE)))
    backup(backend, HostPool(3, seed=8), hashes)
    assert backend.batch_exists(hashes) == 3
    assert "ignores extra config keys ['enable_metadata_cache']" in caplog.text
    assert "file_storage_path" not in caplog.text


def test_sglang_page_hashes_take_the_request_namespace(hicache):
    tokens = list(range(4 * PAGE))
    plain, salted = page_hashes(tokens), page_hashes(tokens, cache_salt="tenant-a")
    assert plain[0] != salted[0] and page_hashes(tokens, extra_key="lora-1")[0] not in (plain[0], salted[0])
    backend = hicache()
    backup(backend, HostPool(4, seed=12), salted)
    assert backend.batch_exists(salted) == 4 and backend.batch_exists(plain) == 0


def spec_backup(backend, kv_pool: HostPool, draft_pool: HostPool, hashes: list[str], host_indices) -> None:
    """HybridCacheController._page_backup_with_stable_layout with a draft pool whose indices come from
    the KV pool: batch_set_v2 for the draft pool first (one call for the operation), then
    CacheController._page_backup: the KV pages, STORAGE_BATCH_SIZE at a time, through batch_set."""
    draft = PoolTransfer(name="draft", indices_from_pool="kv")
    draft.host_indices, draft.keys = host_indices, hashes  # _resolve_sidecar_kv_derived_pool_transfers
    results = backend.batch_set_v2([draft], extra_info=None)
    assert results == {"draft": [True] * len(hashes)}
    for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
        batch = hashes[i:i + STORAGE_BATCH_SIZE]
        data = [kv_pool.get_data_page(int(host_indices[(i + j) * PAGE])) for j in range(len(batch))]
        assert backend.batch_set(batch, data) is True


def spec_prefetch(backend, kv_pool: HostPool, hashes: list[str], host_indices) -> int:
    """_storage_hit_query with pool transfers (batch_exists_v2), then per batch the KV pages
    (_generic_page_get) and the KV-derived draft pages (batch_get_v2), hits clamped to the minimum."""
    draft = PoolTransfer(name="draft", indices_from_pool="kv")
    hit = backend.batch_exists_v2(hashes, [draft], None)
    hashes = hashes[:hit.kv_hit_pages]
    done = 0
    for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
        batch = hashes[i:i + STORAGE_BATCH_SIZE]
        idx = host_indices[i * PAGE:(i + len(batch)) * PAGE]
        pages = backend.batch_get(batch, [kv_pool.get_dummy_flat_data_page() for _ in batch])
        kv_hits = next((j for j, page in enumerate(pages) if page is None), len(batch))
        for j in range(kv_hits):
            kv_pool.set_from_flat_data_page(int(idx[j * PAGE]), pages[j])
        side = backend.batch_get_v2([PoolTransfer(name="draft", host_indices=idx, keys=batch)], extra_info=None)
        draft_hits = side["draft"].index(False) if False in side["draft"] else len(batch)
        done += min(kv_hits, draft_hits)
        if min(kv_hits, draft_hits) < len(batch):
            break
    return done


def test_sglang_speculative_decoding_with_a_draft_pool_stores_and_reloads(hicache):
    """Issue 14: with a separate draft KV pool SGLang calls batch_set_v2 before the KV pages, and a
    backend that raised NotImplementedError there stored nothing at all."""
    pages = 130
    hashes = page_hashes(list(range(70_000, 70_000 + pages * PAGE)))
    kv_src, draft_src = HostPool(pages + 4, seed=20), HostPool(pages + 4, seed=21, layers=1)  # a 1-layer draft
    writer, reader = hicache(), hicache()
    for backend, kv, draft in ((writer, kv_src, draft_src), (reader, HostPool(pages), HostPool(pages, layers=1))):
        backend.register_mem_pool_host(kv)  # CacheController.attach_storage_backend
        backend.register_mem_host_pool_v2(draft, "draft")  # HybridCacheController: the host pool group's entries
        backend.on_host_pools_registered()
    spec_backup(writer, kv_src, draft_src, hashes, np.arange(4 * PAGE, (pages + 4) * PAGE))
    assert writer.batch_exists(hashes) == pages
    kv_dst, draft_dst = reader.mem_pool_host, reader.registered_pools["draft"]
    assert spec_prefetch(reader, kv_dst, hashes, np.arange(0, pages * PAGE)) == pages
    assert np.array_equal(kv_dst.kv_buffer, kv_src.kv_buffer[:, 4 * PAGE:])
    assert np.array_equal(draft_dst.kv_buffer, draft_src.kv_buffer[:, 4 * PAGE:])
    assert writer.pool_key("draft", hashes[0]) == hashes[0] + ".draft_0_1"
    # draft pages missing from page 100 on: the usable prefix stops there, KV pages or not
    with QuillClient(config=writer.client.config) as c:
        assert c.delete(*[writer.pool_key("draft", h) for h in hashes[100:]]) == pages - 100
    result = reader.batch_exists_v2(hashes, [PoolTransfer(name="draft")], None)
    assert (result.kv_hit_pages, result.extra_pool_hit_pages) == (100, {"kv": pages, "draft": 100})
    assert result.restorable_prefix_pages == list(range(1, 101))
    assert reader.batch_exists_v2([], None, None).kv_hit_pages == 0
    # indices that do not match the keys: nothing read, every page reported failed
    bad = reader.batch_get_v2([PoolTransfer(name="draft", host_indices=np.arange(PAGE), keys=hashes[:2])])
    assert bad == {"draft": [False, False]}
    assert reader.batch_set_v2([PoolTransfer(name="swa", host_indices=np.arange(PAGE), keys=hashes[:1])]) \
        == {"swa": [False]}  # no such pool registered


def test_sglang_v2_trailing_pools_and_rank_sharded_mamba(hicache):
    """Pools that hold only the tail of a prefix (SWA, Mamba state: TRAILING_PAGES), and Mamba state
    keyed by TP rank even in an MLA model, whose KV pages are shared by all ranks."""
    hashes = page_hashes(list(range(6 * PAGE)))
    mla = hicache(tp_rank=1, tp_size=2, is_mla_model=True)
    assert mla.pool_key("kv", hashes[0]) == hashes[0] and mla.pool_key("mamba", hashes[0]) == hashes[0] + ".mamba_1_2"
    assert mla.pool_key("draft", hashes[0]) == hashes[0] + ".draft"
    kv, state = HostPool(6, seed=30), HostPool(6, seed=31, layers=1)
    mla.register_mem_pool_host(kv)
    mla.register_mem_host_pool_v2(state, "mamba")
    backup(mla, kv, hashes)
    # the state of the prefix ending at pages 3 and 6 only (as offloaded nodes end there)
    for end in (3, 6):
        stored = mla.batch_set_v2([PoolTransfer(name="mamba", host_indices=np.arange((end - 1) * PAGE, end * PAGE),
                                                keys=[hashes[end - 1]], hit_policy="trailing_pages")])
        assert stored == {"mamba": [True]}
    trailing = PoolTransfer(name="mamba", keys=[hashes[-1]], hit_policy="trailing_pages")
    result = mla.batch_exists_v2(hashes, [trailing], None)
    assert result.restorable_prefix_pages == [3, 6] and result.kv_hit_pages == 6
    assert result.extra_pool_hit_pages == {"kv": 6, "mamba": 6}
    # a prefix of 5 pages cannot be restored: its state (page 5) was never stored
    result = mla.batch_exists_v2(hashes[:5], [trailing], None)
    assert result.kv_hit_pages == 3 and result.restorable_prefix_pages == [3]
    other_rank = hicache(tp_rank=0, tp_size=2, is_mla_model=True)
    assert other_rank.batch_exists(hashes) == 6  # MLA KV: one copy for every rank
    assert other_rank.batch_exists_v2(hashes, [trailing], None).kv_hit_pages == 0  # its own Mamba state: none
    with pytest.raises(ValueError, match="unsupported pool hit policy"):
        mla.batch_exists_v2(hashes, [PoolTransfer(name="dsa", hit_policy="block_groups")], None)




# ---------------------------------------------------------------------------
# issue 24: layouts checked at attach, one object a page on every path, no half page groups
# ---------------------------------------------------------------------------

V1_LAYOUTS = [("mha", "page_first"), ("mha", "layer_first"), ("mha", "page_first_direct"),
              ("mla", "page_first"), ("mla", "layer_first")]


def same_pages(a: HostPool, a_first: int, b: HostPool, b_first: int, n: int) -> bool:
    return all(np.array_equal(a.get_data_page((a_first + i) * PAGE), b.get_data_page((b_first + i) * PAGE))
               for i in range(n))


@pytest.mark.parametrize("kind,layout", V1_LAYOUTS)
def test_sglang_interface_v1_stores_every_layout_as_the_generic_page(hicache_both, kind, layout):
    """MHA layer_first gives 2 x layers host buffers a page: with interface_v1 every backup used to
    fail on it. Every layout is stored now, each page gathered into one object that holds the
    generic path's bytes, so a v1 engine and a generic one read each other's pages."""
    mla = kind == "mla"
    pool_type = MLAHostPool if mla else HostPool
    src, dst, other = (pool_type(16, seed=s, layers=3, layout=layout) for s in (40, None, None))
    v1_writer, v1_reader = (hicache_both({"interface_v1": 1}, is_mla_model=mla) for _ in range(2))
    generic = hicache_both({"interface_v1": 0}, is_mla_model=mla)
    v1_writer.register_mem_pool_host(src)
    v1_reader.register_mem_pool_host(dst)
    generic.register_mem_pool_host(other)
    hashes = page_hashes(list(range(300, 300 + 10 * PAGE)))
    # SGLang passes the host indices of the pages: here pages 6..15 of the writer's pool
    assert v1_writer.batch_set_v1(hashes, np.arange(6 * PAGE, 16 * PAGE)) == [True] * 10
    assert v1_reader.batch_exists(hashes + page_hashes([1] * 2 * PAGE)) == 10
    assert v1_reader.batch_get_v1(hashes, np.arange(0, 10 * PAGE)) == [True] * 10
    assert same_pages(dst, 0, src, 6, 10)
    assert prefetch(generic, other, hashes) == 10 and same_pages(other, 0, src, 6, 10)
    # and the other way: pages the generic path stored, read through v1
    more = page_hashes(list(range(900, 900 + 3 * PAGE)))
    backup(generic, src, more)
    assert v1_reader.batch_get_v1(more, np.arange(10 * PAGE, 13 * PAGE)) == [True] * 3
    assert same_pages(dst, 10, src, 0, 3)
    missing = page_hashes([5] * PAGE)
    assert v1_reader.batch_get_v1(missing + hashes[:1], np.arange(0, 2 * PAGE)) == [False, True]


def test_sglang_get_agrees_with_exists_under_interface_v1(hicache):
    """`exists` was True while `get` returned None: get read the page's key, v1 had stored `_k`
    and `_v` objects. One object a page now, whichever call asks."""
    backend = hicache({"interface_v1": 1})
    pool = HostPool(4, seed=41, layout="layer_first")
    backend.register_mem_pool_host(pool)
    hashes = page_hashes(list(range(4 * PAGE)))
    assert backend.batch_set_v1(hashes[:2], np.arange(0, 2 * PAGE)) == [True, True]
    for h in hashes:
        assert backend.exists(h) == (backend.get(h) is not None), h  # no target: a dummy page of the pool
    assert np.array_equal(backend.get(hashes[1]), pool.get_data_page(PAGE))
    page = pool.get_dummy_flat_data_page()
    assert backend.get(hashes[0], page) is page and np.array_equal(page, pool.get_data_page(0))
    assert backend.batch_exists(hashes) == 2
    assert [p is not None for p in backend.batch_get(hashes)] == [True, True, False, False]
    assert backend.set(hashes[2], pool.get_data_page(2 * PAGE)) is True
    assert backend.batch_exists(hashes) == 3
    assert backend.batch_get_v1(hashes[2:3], np.arange(3 * PAGE, 4 * PAGE)) == [True]
    assert np.array_equal(pool.get_data_page(3 * PAGE), pool.get_data_page(2 * PAGE))


def test_sglang_refuses_a_layout_it_cannot_store_at_registration(hicache):
    """SGLang fails its attach when register_mem_pool_host raises: a layout the backend cannot
    store shows at start (it used to attach, then fail every backup)."""
    unified = HostPool(4, layout="page_unified")  # SGLang's own calls refuse it: no flat page, no buffers
    v1 = hicache({"interface_v1": 1})
    with pytest.raises(ValueError, match=r"interface_v1 cannot use HostPool \(layout 'page_unified'\): its "
                                         r"get_page_buffer_meta refuses it \(ValueError: Unsupported layout"):
        v1.register_mem_pool_host(unified)
    assert v1.mem_pool_host is None
    generic = hicache({"interface_v1": 0})
    with pytest.raises(ValueError, match=r"cannot store pool 'kv': HostPool \(layout 'page_unified'\) gives no "
                                         r"flat data page"):
        generic.register_mem_pool_host(unified)
    generic.register_mem_pool_host(HostPool(4))
    with pytest.raises(ValueError, match="cannot store pool 'draft'"):
        generic.register_mem_host_pool_v2(unified, "draft")
    assert "draft" not in generic.registered_pools

    class Mismatched(HostPool):  # flat pages of one size, dummy pages (what reads land in) of another
        def get_dummy_flat_data_page(self) -> np.ndarray:
            return np.zeros(8, np.float16)

    with pytest.raises(ValueError, match=r"gives flat pages of 512 bytes but reads into dummy pages of 16"):
        generic.register_mem_host_pool_v2(Mismatched(4), "swa")


@pytest.mark.parametrize("v1", [False, True], ids=["generic", "v1"])
def test_sglang_v2_pages_are_deleted_when_their_kv_pages_cannot_be_stored(quilld_factory, sock_dir, backends, v1):
    """SGLang stores the draft pages (batch_set_v2) before the KV pages; when the KV pages then
    fail, the draft pages this backend stored for them are deleted, not left half a page group.
    Draft pages another engine had stored are kept, and so are the ones whose KV page is in."""
    q = start_node(quilld_factory, sock_dir, json.loads(recipe("sglang-hicache"))["password"], dram="4MiB")
    make = factory(q, backends)
    extra = {"interface_v1": int(v1)}
    big_kv = HostPool(3, seed=50, layers=256, heads=256)  # 8 MiB pages: larger than quilld's arena
    small_kv, draft = HostPool(3, seed=51), HostPool(3, seed=52, layers=1)
    failing, working, other = make(extra), make(extra), make(extra)
    for backend, kv in ((failing, big_kv), (working, small_kv), (other, small_kv)):
        backend.register_mem_pool_host(kv)
        backend.register_mem_host_pool_v2(draft, "draft")
    hashes = page_hashes(list(range(3 * PAGE)))
    indices = np.arange(0, 3 * PAGE)
    assert other.batch_set_v2([PoolTransfer("draft", host_indices=indices[:PAGE], keys=hashes[:1])]) == \
        {"draft": [True]}  # another engine's draft page for the first page

    def store(backend) -> bool:
        assert backend.batch_set_v2([PoolTransfer("draft", host_indices=indices, keys=hashes)]) == \
            {"draft": [True] * 3}
        if v1:
            return all(backend.batch_set_v1(hashes, indices))
        return backend.batch_set(hashes, [backend.mem_pool_host.get_data_page(i * PAGE) for i in range(3)])

    drafts = [failing.pool_key("draft", h) for h in hashes]
    assert store(failing) is False
    assert failing.client.exists_many(drafts) == [True, False, False]  # only the other engine's is left
    assert failing.batch_exists_v2(hashes, [PoolTransfer("draft")]).kv_hit_pages == 0
    assert store(working) is True
    assert working.client.exists_many(drafts) == [True] * 3
    assert working.batch_exists_v2(hashes, [PoolTransfer("draft")]).kv_hit_pages == 3
    assert store(failing) is True  # the KV pages are complete now (another engine's): kept, and the drafts too
    assert failing.client.exists_many(drafts) == [True] * 3


def test_sglang_shared_memory_setting_decides_at_attach(quilld_factory, backends, caplog):
    """`shared_memory`: "auto" falls back to TCP (and says why in SGLang's log), "require" fails
    the attach where quilld offers no shared memory (here: no unix socket)."""
    caplog.set_level("INFO", logger="quillclient.sglang")
    q = quilld_factory("--dram", "64MiB", "--requirepass", json.loads(recipe("sglang-hicache"))["password"])
    make = factory(q, backends)
    assert make({"shared_memory": "auto"}).client.transport == "tcp"
    assert "pages move over TCP (the server has no unix socket (server.unixsocket))" in caplog.text
    with pytest.raises(QuillError, match="shared_memory='require' but the shared-memory path is unavailable"):
        make({"shared_memory": "require"})
    with pytest.raises(ValueError, match="shared_memory must be"):
        make({"shared_memory": "yes"})
