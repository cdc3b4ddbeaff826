"""QuillTier, quilld as a secondary tier of vLLM 0.33's offloading, driven through vLLM's own
TieringOffloadingSpec and TieringOffloadingManager (the CPU primary tier in a real shared
region), as vLLM's scheduler drives them: two "engines" share chunks through one quilld, byte
for byte, under vLLM's own block hashes; what is missing or damaged in the pool is a miss that
vLLM recomputes, never loaded; a random hash seed is refused."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid

import numpy as np
import pytest

from needs_vllm import require_vllm

require_vllm()

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                       OffloadingModelConfig, OffloadingParallelConfig)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from quillclient.vllm import QuillTier
from quillclient.vllm.keys import block_key, index_hash

BLOCK_BYTES = 64 * 1024  # one chunk of the CPU region (one GPU block of one worker here)
ENGINES = """
[[engines]]
id = "e1"
url = "http://127.0.0.1:9001"
model = "m"
"""


@pytest.fixture
def pool(quilld_factory, tmp_path):
    conf = tmp_path / "engines.toml"
    conf.write_text(ENGINES)
    sock_dir = tempfile.mkdtemp(prefix="qt", dir="/tmp")
    try:
        yield quilld_factory("--config", str(conf), "--unixsocket", os.path.join(sock_dir, "q.sock"),
                             "--map-users", "default")
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def _config(url: str, **tier) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer.0",), 0),),
        worker_kv_bytes_per_block=BLOCK_BYTES,
        enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 16 * BLOCK_BYTES,
                      "secondary_tiers": [{"type": "QuillTier", "module_path": "quillclient.vllm", "url": url,
                                           **tier}]},
        engine_id=f"quilltier-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name="m", dtype="float16", max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False),
    )


class Engine:
    """One engine's offloading manager, as vLLM's OffloadingConnector scheduler holds it."""

    def __init__(self, url: str, **tier) -> None:
        self.spec = TieringOffloadingSpec(_config(url, **tier))
        self.manager = self.spec.get_manager()
        self.tier = self.manager.secondary_tiers[0]
        assert isinstance(self.tier, QuillTier)
        self.region = np.frombuffer(self.manager.primary_tier.get_kv_memoryview(), dtype=np.uint8).reshape(
            -1, BLOCK_BYTES)

    def step(self, new=()) -> None:
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=list(new), preempted_req_ids=()))
        list(self.manager.take_events())

    def request(self, req_id: str, hashes: list[bytes]) -> tuple[ReqContext, list]:
        ctx = ReqContext(req_id=req_id)
        self.manager.on_new_request(ctx)
        keys = [make_offload_key(h, 0) for h in hashes]
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, 16 * (i + 1))
        return ctx, keys

    def offload(self, ctx: ReqContext, keys: list, data: list[bytes]) -> None:
        """The GPU->CPU copy vLLM's worker does, then the cascade into the pool; waits for it."""
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None and len(out.keys_to_store) == len(keys)
        for cid, d in zip(out.store_spec.chunk_ids, data):
            self.region[int(cid)] = np.frombuffer(d, dtype=np.uint8)
        self.manager.complete_store(keys, ctx, success=True)
        deadline = time.monotonic() + 20
        while self.manager.has_pending_work() and time.monotonic() < deadline:
            time.sleep(0.01)
            self.step()
        assert not self.manager.has_pending_work(), "the pool never finished the store"

    def hits(self, ctx: ReqContext, keys: list, timeout: float = 20) -> list[LookupResult]:
        """Each key's lookup once its answer settled (RETRY and HIT_PENDING resolve over steps)."""
        deadline = time.monotonic() + timeout
        while True:
            results = [self.manager.lookup(k, ctx) for k in keys]
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in results) or time.monotonic() > deadline:
                return results
            self.step()
            time.sleep(0.01)

    def read(self, ctx: ReqContext, keys: list) -> list[bytes]:
        spec = self.manager.prepare_load(keys, ctx)
        out = [self.region[int(c)].tobytes() for c in spec.chunk_ids]
        self.manager.complete_load(keys, ctx)
        return out

    def close(self) -> None:
        self.manager.shutdown()


@pytest.fixture
def engines(pool):
    made: list[Engine] = []

    def make(**tier) -> Engine:
        e = Engine(f"quill://127.0.0.1:{pool.port}?model=m&tokenizer=t", **tier)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def _hashes(n: int, salt: bytes = b"") -> list[bytes]:
    import hashlib
    return [hashlib.sha256(salt + i.to_bytes(4, "big")).digest() for i in range(n)]


def _data(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8).tobytes() for _ in range(n)]


@pytest.mark.parametrize("transport", ["require", "off"], ids=["shm", "tcp"])
def test_a_second_engine_loads_the_chunks_the_first_stored_byte_for_byte(pool, engines, transport):
    a, b = engines(shared_memory=transport), engines(shared_memory=transport)
    assert a.tier._client.transport == ("shm" if transport == "require" else "tcp")
    hashes, data = _hashes(6), _data(6, 1)
    ctx_a, keys = a.request("a-1", hashes)
    assert a.hits(ctx_a, keys) == [LookupResult.MISS] * 6
    a.offload(ctx_a, keys, data)
    a.manager.on_request_finished(ctx_a)

    r = pool.client(protocol=2, decode_responses=False)
    assert r.execute_command("SCOPE", "m", "t") == b"OK"
    assert r.get(hashes[0].hex()) == data[0]  # an operator finds a chunk by its vLLM hash
    ctx_b, keys_b = b.request("b-1", hashes + _hashes(1, b"other"))
    assert b.hits(ctx_b, keys_b) == [LookupResult.HIT] * 6 + [LookupResult.MISS]
    assert b.read(ctx_b, keys_b[:6]) == data
    # ROUTE credits the pool's copies under the hash vLLM's events carry, one chain of them
    plan = dict(zip(*[iter(r.execute_command("ROUTE", json.dumps({"blocks": [index_hash(h) for h in hashes]})))] * 2))
    assert plan[b"plan"] == [plan[b"plan"][0]] * 6 and plan[b"plan"][0].startswith(b"fetch:"), plan[b"plan"]
    r.close()


def test_a_chunk_deleted_or_damaged_in_the_pool_is_recomputed_never_loaded(pool, engines):
    a, b = engines(), engines()
    hashes, data = _hashes(4, b"d"), _data(4, 2)
    ctx_a, keys = a.request("a-1", hashes)
    a.hits(ctx_a, keys)
    a.offload(ctx_a, keys, data)
    r = pool.client(protocol=2, decode_responses=False)
    assert r.execute_command("SCOPE", "m", "t") == b"OK"
    ctx_b, keys_b = b.request("b-1", hashes)
    # found, then lost before the load: one deleted, one replaced by a value of another length
    assert [b.tier.lookup(k, ctx_b) for k in keys_b] == [LookupResult.RETRY] * 4
    b.tier.on_schedule_end(ScheduleEndContext((), ()))
    deadline = time.monotonic() + 10
    while b.tier.lookup(keys_b[0], ctx_b) is LookupResult.RETRY and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.delete(block_key(hashes[1])) == 1
    r.set(block_key(hashes[2]), b"short")
    results = b.hits(ctx_b, keys_b)
    assert results == [LookupResult.HIT, LookupResult.MISS, LookupResult.MISS, LookupResult.HIT], results
    assert b.read(ctx_b, [keys_b[0], keys_b[3]]) == [data[0], data[3]]
    r.close()


def test_a_missing_pool_or_a_bad_option_fails_at_start_with_its_reason(pool):
    from socket import socket
    s = socket()
    s.bind(("127.0.0.1", 0))
    dead = s.getsockname()[1]
    s.close()
    with pytest.raises(ValueError, match=f"quilld at quill://127.0.0.1:{dead} does not answer"):
        Engine(f"quill://127.0.0.1:{dead}")
    with pytest.raises(ValueError, match="io_threads must be at least 1"):
        Engine(f"quill://127.0.0.1:{pool.port}", io_threads=0)
    with pytest.raises(ValueError, match="unknown option 'bogus'"):
        Engine(f"quill://127.0.0.1:{pool.port}?bogus=1")
    with pytest.raises(ValueError, match=r"quill://u:\*\*\*@127.0.0.1"):  # the password never in an error
        Engine(f"quill://u:hunter2@127.0.0.1:{dead}")


def test_a_random_hash_seed_is_refused(pool, monkeypatch):
    from vllm.v1.core import kv_cache_utils
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    e = Engine(f"quill://127.0.0.1:{pool.port}")
    try:
        monkeypatch.setattr(kv_cache_utils, "_NONE_HASH_SEED", os.urandom(32).hex())  # what init_none_hash does
        ctx, keys = e.request("r", _hashes(2, b"seed"))
        assert e.tier.lookup(keys[0], ctx) is LookupResult.MISS
        assert "seeded its block hashes randomly" in e.tier._seed.why
    finally:
        e.close()
    kept = Engine(f"quill://127.0.0.1:{pool.port}", allow_private_seed=True)
    try:
        monkeypatch.setattr(kv_cache_utils, "_NONE_HASH_SEED", os.urandom(32).hex())
        ctx, keys = kept.request("r", _hashes(2, b"seed"))
        assert kept.tier.lookup(keys[0], ctx) is LookupResult.RETRY and not kept.tier._seed.why
    finally:
        kept.close()
