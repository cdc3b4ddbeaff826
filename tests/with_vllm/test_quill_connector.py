"""QuillConnector against vLLM 0.33's own classes on CPU: a real Scheduler and KVCacheManager built
from a VllmConfig (its model config from a config.json this test writes, nothing from a hub),
requests hashed by vLLM's block hasher, and a worker side whose KV tensors vLLM's own
allocate_kv_cache made. Two engines share a prefix through one quilld byte for byte; a block
deleted or damaged in the pool is reported as a load error and recomputed; a prefill/decode
pair hands its blocks over through the pool."""

from __future__ import annotations

import re
import time

import pytest
import redis

from needs_vllm import require_vllm

require_vllm()

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import get_forward_context, set_forward_context
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

import vllm_configs
from vllm_configs import vllm_config, write_model

from quillclient.vllm import QuillConnector
from quillclient.vllm.connector import HEADER_BYTES, block_object_key
from quillclient.vllm.keys import index_hash

BS, LAYERS, KV_HEADS, HEAD = 16, 2, 2, 64
NUM_BLOCKS = 64
PAGE = 2 * BS * KV_HEADS * HEAD * 2  # K and V of one layer's block, float16
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
ENGINES = '[[engines]]\nid = "e1"\nurl = "http://127.0.0.1:9001"\nmodel = "m"\n'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model"), LAYERS, KV_HEADS, HEAD)


@pytest.fixture
def pool(quilld_factory, tmp_path):
    conf = tmp_path / "engines.toml"
    conf.write_text(ENGINES)
    return quilld_factory("--config", str(conf))


def kv_cache_config(layout: KVCacheLayout) -> KVCacheConfig:
    return vllm_configs.kv_cache_config(layout, LAYER_NAMES, NUM_BLOCKS, BS, KV_HEADS, HEAD)


def kv_value(layer: int, pos: int, token: int) -> float:
    """What the "model" writes for a token: a function of the layer, the position and the token."""
    return float((layer * 7919 + pos * 31 + token) % 2039) / 64.0


class Engine:
    """One vLLM engine: its real Scheduler (with the connector's scheduler side), and a worker that
    runs steps as vLLM's model runner does around the connector (bind, load, forward, save, report)."""

    def __init__(self, model_dir: str, url: str, layout: KVCacheLayout = KVCacheLayout.LBHNC,
                 role: str = "kv_both", **extra) -> None:
        self.config = vllm_config(model_dir, url, role, **extra)
        self.kvc = kv_cache_config(layout)
        self.config.cache_config.num_gpu_blocks = NUM_BLOCKS  # what vLLM's worker reports after profiling
        self.sched = Scheduler(vllm_config=self.config, kv_cache_config=self.kvc,
                               structured_output_manager=StructuredOutputManager(self.config), block_size=BS,
                               log_stats=True)
        assert isinstance(self.sched.connector, QuillConnector)
        self.worker = QuillConnector(self.config, KVConnectorRole.WORKER, self.kvc)
        self.kv = allocate_kv_cache(self.kvc, torch.device("cpu"), layout)
        self.worker.register_kv_caches(self.kv)
        self.computed: dict[str, list[int]] = {}  # req id -> positions the "model" computed
        self.invalid: set[int] = set()
        self.stats: dict = {}
        self.params: dict[str, dict] = {}  # kv_transfer_params of each finished request

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 1, kv_params: dict | None = None) -> Request:
        sp = SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": kv_params} if kv_params else None)
        req = Request(req_id, prompt, sp, None, block_hasher=get_request_block_hasher(BS, sha256))
        self.sched.add_request(req)
        return req

    def step(self) -> None:
        so = self.sched.schedule()
        w = self.worker
        w.bind_connector_metadata(so.kv_connector_metadata)
        with set_forward_context(None, self.config):
            if so.has_sync_kv_loads:
                w.start_load_kv(get_forward_context())
            self._forward(so)
            if not so.has_sync_kv_loads:
                w.start_load_kv(get_forward_context())
            w.wait_for_save()
        results = w.get_transfer_results(so.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        self.invalid |= invalid
        self.collect()
        w.clear_connector_metadata()
        req_ids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=[[7] for _ in req_ids],
                                kv_connector_output=KVConnectorOutput(
                                    finished_sending=results.finished_sending or None,
                                    finished_recving=results.finished_recving or None,
                                    invalid_block_ids=invalid))
        for outs in self.sched.update_from_output(so, out).values():
            for o in outs.outputs:
                if o.kv_transfer_params:
                    self.params[o.request_id] = o.kv_transfer_params

    def collect(self) -> dict:
        """Add the worker's stats since the last call (vLLM reads them once a step) to self.stats."""
        stats = self.worker.get_kv_connector_stats()
        if stats is not None:
            for k, v in stats.data.items():
                self.stats[k] = self.stats.get(k, 0) + v
        return self.stats

    def _forward(self, so) -> None:
        """Write each scheduled token's K and V into its slot, as attention would."""
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[req_id]
            ids = self.sched.kv_cache_manager.get_blocks(req_id).get_block_ids()[0]
            start = req.num_computed_tokens - n  # schedule() has already counted this step's tokens
            for pos in range(start, start + n):
                tok = req.all_token_ids[pos]
                for li, name in enumerate(LAYER_NAMES):
                    self.kv[name][ids[pos // BS], :, pos % BS, :] = kv_value(li, pos, tok)
                self.computed.setdefault(req_id, []).append(pos)

    def run(self, until, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, "the engine never got there"
            self.step()
            time.sleep(0.002)

    def block(self, block_id: int) -> bytes:
        return b"".join(self.kv[n][block_id].contiguous().numpy().tobytes() for n in LAYER_NAMES)

    def close(self) -> None:
        self.worker.wait_for_save() if self.worker.has_connector_metadata() else None
        self.worker.shutdown()
        self.sched.connector.shutdown()


@pytest.fixture
def engines(model_dir, pool):
    init_none_hash(sha256)
    made: list[Engine] = []

    def make(**kw) -> Engine:
        e = Engine(model_dir, f"quill://127.0.0.1:{pool.port}?model=m&tokenizer=t", **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def finished(engine: Engine, req_id: str):
    return lambda: req_id not in engine.sched.requests


def expected_block(prompt: list[int], i: int) -> bytes:
    """Block i's bytes as the model writes them: each layer's [H, N, C] page."""
    out = []
    for li in range(LAYERS):
        t = torch.empty((KV_HEADS, BS, 2 * HEAD), dtype=torch.float16)
        for j in range(BS):
            t[:, j, :] = kv_value(li, i * BS + j, prompt[i * BS + j])
        out.append(t.numpy().tobytes())
    return b"".join(out)


def scoped(pool) -> redis.Redis:
    """A connection in the engines' identity scope (model m, tokenizer t), as an operator would use."""
    r = redis.Redis(port=pool.port, single_connection_client=True)
    r.execute_command("SCOPE", "m", "t")
    return r


def wait_saved(pool, keys: list[str], timeout: float = 10.0) -> None:
    r = scoped(pool)
    deadline = time.monotonic() + timeout
    while sum(r.exists(k) for k in keys) < len(keys):
        assert time.monotonic() < deadline, "the saves never reached the pool"
        time.sleep(0.02)


@pytest.mark.parametrize("load", ["sync", "async"])
def test_a_second_engine_loads_exactly_the_blocks_the_first_saved(engines, pool, load):
    a = engines(load=load)
    b = engines(load=load, )
    prompt = [(i * 37) % 997 + 1 for i in range(5 * BS + 3)]  # 5 full blocks and a tail
    req = a.add("a1", prompt)
    a.run(finished(a, "a1"))
    obj = a.worker._worker._obj
    assert (obj.layers, obj.page_bytes, obj.nbytes) == (LAYERS, PAGE, HEADER_BYTES + LAYERS * PAGE)
    keys = [block_object_key(h, obj) for h in req.block_hashes[:5]]
    assert keys[0] == f"{req.block_hashes[0].hex()}.{obj.layout:016x}.r0"
    a.worker._worker.drain()
    assert a.collect()["blocks_saved"] == 5
    wait_saved(pool, keys)
    r = scoped(pool)
    # each block's object: the header, then the model's bytes, layer by layer; found by vLLM's own hash
    for i, k in enumerate(keys):
        value = r.get(k)
        assert value[:4] == b"QKV1" and value[HEADER_BYTES:] == expected_block(prompt, i)
    # the pool counts them under the hash vLLM's KV events carry (LOCATE finds a pool copy)
    where = r.execute_command("LOCATE", str(index_hash(req.block_hashes[0])))
    assert where, "the pool does not index the block under vLLM's hash"

    breq = b.add("b1", prompt + [5, 6])
    b.run(finished(b, "b1"))
    # b computed only what the pool did not have: the 5 blocks were loaded, the rest computed
    assert min(b.computed["b1"]) == 5 * BS
    assert b.stats.get("blocks_loaded") == 5 and not b.invalid
    ids = [bid for bid in range(NUM_BLOCKS)]  # the blocks b's request used are in its cache
    got = {b.block(i) for i in ids}
    for i in range(5):
        assert expected_block(prompt, i) in got, f"block {i} did not load byte for byte"
    assert breq.block_hashes[:5] == req.block_hashes[:5]


def test_blocks_in_another_layout_load_alike(engines, pool):
    """An engine whose cache is block-outermost reads what a layer-outermost engine saved."""
    a = engines(layout=KVCacheLayout.LBHNC)
    b = engines(layout=KVCacheLayout.BLHNC, load="sync")
    prompt = list(range(100, 100 + 3 * BS + 1))
    a.add("a1", prompt)
    a.run(finished(a, "a1"))
    a.worker._worker.drain()
    b.add("b1", prompt)
    b.run(finished(b, "b1"))
    assert b.stats.get("blocks_loaded") == 3 and min(b.computed["b1"]) == 3 * BS
    got = {b.block(i) for i in range(NUM_BLOCKS)}
    assert all(expected_block(prompt, i) in got for i in range(3))


@pytest.mark.parametrize("damage", ["deleted", "corrupted", "truncated"])
def test_a_block_missing_or_damaged_in_the_pool_is_recomputed_never_used(engines, pool, damage):
    a = engines()
    b = engines(load="sync")
    prompt = list(range(200, 200 + 4 * BS + 2))
    req = a.add("a1", prompt)
    a.run(finished(a, "a1"))
    a.worker._worker.drain()
    obj = a.worker._worker._obj
    key = block_object_key(req.block_hashes[1], obj)
    r = scoped(pool)
    value = r.get(key)
    assert value is not None
    # the lookup sees all four blocks; then the second one goes bad before b loads it
    breq = b.add("b1", prompt)
    if damage == "deleted":
        hook = lambda: r.delete(key)  # noqa: E731
    elif damage == "corrupted":
        hook = lambda: r.set(key, value[:HEADER_BYTES] + bytes([value[HEADER_BYTES] ^ 1]) + value[HEADER_BYTES + 1:])  # noqa: E731
    else:
        hook = lambda: r.set(key, value[:-1])  # noqa: E731
    original = b.sched.connector.update_state_after_alloc

    def damaged_after_lookup(request, blocks, n):
        hook()
        return original(request, blocks, n)

    b.sched.connector.update_state_after_alloc = damaged_after_lookup
    b.run(finished(b, "b1"))
    assert b.invalid, "the damaged block was not reported"
    assert b.stats.get("load_errors") == 1 and b.stats.get("blocks_loaded") == 3
    # vLLM recomputed from the bad block on: the positions of block 1 were computed by the model
    assert set(range(BS, 2 * BS)) <= set(b.computed["b1"])
    # what b's cache holds for block 1 is the model's bytes, never the pool's damaged ones
    got = {b.block(i) for i in range(NUM_BLOCKS)}
    assert expected_block(prompt, 1) in got
    if damage == "corrupted":
        assert value[HEADER_BYTES:] == expected_block(prompt, 1)
        assert (bytes([value[HEADER_BYTES] ^ 1]) + value[HEADER_BYTES + 1:]) not in got
    assert breq.block_hashes[:4] == req.block_hashes[:4]


def test_prefill_then_decode_through_the_pool(engines, pool):
    p = engines(role="kv_producer")
    d = engines(role="kv_consumer", load="async", handoff_wait_ms=20000)
    prompt = list(range(300, 300 + 6 * BS + 5))
    # the decode leg arrives first (its proxy sent both legs at once): it waits for the 6 blocks
    # its prefill will save, and computes nothing meanwhile
    d.add("d1", prompt, max_tokens=2, kv_params={"quill_blocks": 6})
    for _ in range(3):
        d.step()
    assert "d1" not in d.computed and "d1" in d.sched.requests
    p.add("p1", prompt, kv_params={"do_remote_decode": True})
    p.run(finished(p, "p1"))
    params = p.params["p1"]
    assert params["quill_blocks"] == 6 and params["quill_layout"] == f"{p.worker._worker._obj.layout:016x}"
    d.run(finished(d, "d1"))
    assert d.stats.get("blocks_loaded") == 6 and min(d.computed["d1"]) == 6 * BS and not d.invalid
    got = {d.block(i) for i in range(NUM_BLOCKS)}
    assert all(expected_block(prompt, i) in got for i in range(6))
    assert not d.stats.get("blocks_saved")  # a consumer saves nothing
    # a decode leg whose blocks are all there does not wait: it loads them in its first step
    d2 = engines(role="kv_consumer", load="sync", handoff_wait_ms=20000)
    d2.add("d2", prompt, max_tokens=2, kv_params=params)
    d2.step()
    assert d2.stats.get("blocks_loaded") == 6 and min(d2.computed["d2"]) == 6 * BS


def test_bad_options_fail_at_engine_start(model_dir, pool):
    url = f"quill://127.0.0.1:{pool.port}"
    kvc = kv_cache_config(KVCacheLayout.LBHNC)
    for extra, said in (({"lod": "sync"}, "unknown kv_connector_extra_config key(s) lod"),
                        ({"load": "later"}, "load must be one of async, sync"),
                        ({"batch_blocks": 0}, "batch_blocks must be a positive integer"),
                        ({"verify_crc": "no"}, "verify_crc must be true or false, not 'no'")):
        with pytest.raises(ValueError, match=re.escape(said)):
            QuillConnector(vllm_config(model_dir, url, **extra), KVConnectorRole.SCHEDULER, kvc)
    with pytest.raises(ValueError, match="does not answer"):
        QuillConnector(vllm_config(model_dir, "quill://127.0.0.1:1"), KVConnectorRole.SCHEDULER, kvc)


def test_stats_reach_vllms_prometheus_metrics(engines, pool, model_dir):
    """The worker's stats, aggregated as vLLM aggregates them, become counters on vLLM's /metrics."""
    import prometheus_client
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
    a = engines(load="sync")
    a.add("a1", list(range(500, 500 + 2 * BS + 1)))
    a.run(finished(a, "a1"))
    a.worker._worker.drain()
    assert a.collect()["blocks_saved"] == 2
    stats = QuillConnector.build_kv_connector_stats(dict(a.stats))
    merged = QuillConnector.build_kv_connector_stats(dict(a.stats)).aggregate(stats)
    prom = KVConnectorProm(a.config, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(merged.reduce(), 0)
    value = prometheus_client.REGISTRY.get_sample_value("vllm:quill_connector_blocks_saved_total",
                                                       {"model_name": "m", "engine": "0"})
    assert value == 4  # two blocks, counted twice by the aggregate of two workers' stats
