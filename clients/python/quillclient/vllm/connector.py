"""QuillConnector: a vLLM 0.33 KV connector that saves and loads whole KV blocks through quilld.

    vllm serve meta-llama/Llama-3.1-8B-Instruct --kv-transfer-config '{"kv_connector": "QuillConnector",
      "kv_connector_module_path": "quillclient.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"url": "quill://quilld.internal:7379?model=llama-3-8b&tokenizer=llama3"}}'

The scheduler side asks the pool, in one pipelined round trip per request, which of the request's
leading blocks it holds under vLLM's own block hashes (`request.block_hashes`); the worker side
moves them between the pool and vLLM's paged KV tensors. Blocks are saved once computed (all of
them, or only the prompt's) and loaded before use, synchronously in the step or asynchronously
between steps (`load`).

A block in the pool is ONE object: every layer's K and V for that block on this worker.
Its key is `<hex of the vLLM block hash>.<layout>.r<rank>` (`block_object_key`): the layout id
names the model, the cache spec (dtype, block size, KV heads, head size, page bytes) and the layer
count, and the rank the tensor-parallel slice, so engines share blocks only when every byte
means the same. Its value (`BlockObject`): a 32-byte header (magic `QKV1`, version, layer
count, page bytes, the layout id, CRC32C of the payload) then each layer's page in vLLM's
logical per-layer order `[H, N, C]` (KV heads, tokens of the block, channels), layers in the
model's order. The logical order, not the tensors' physical one, so an engine whose backend
lays its cache out otherwise (`VLLM_KV_CACHE_LAYOUT`) reads the same bytes. Blocks are stored
with `PUT2PHASE ... HASH h PARENT p` (`put_blocks(hashes=)`), h the low 64 bits of vLLM's
hash: ROUTE's fetch plan, LOCATE and the gateway's handoff check count them under the hash
the engine's own KV events carry. A block that is missing, of another length, of another
layout or whose CRC does not match is reported through `get_block_ids_with_load_errors` and
vLLM recomputes it: it is never used.

Prefill/decode through the pool: a request whose `kv_transfer_params` say
`{"do_remote_decode": true}` (what vLLM's P/D proxies send the prefill leg) finishes with
`kv_transfer_params = {"quill_blocks": n, "quill_layout": id}`: the n leading blocks it saved.
The decode leg, given those params, waits (up to `handoff_wait_ms`) until the pool holds
them, then loads them; a decode leg whose blocks are all there never waits.

vLLM's `kv_load_failure_policy` follows the `load_errors` option (default "recompute": a block
evicted between lookup and load is recomputed; vLLM's own default, "fail", would fail the request).

Supported: one KV-cache group of full attention (any physical layout vLLM 0.33 allocates:
the per-layer `[B, H, N, C]` views), CPU and CUDA tensors. Not supported, refused at start:
the hybrid allocator's several groups (vLLM turns HMA off for a connector without
`SupportsHMA`, so a hybrid model runs with one group), MLA's and Mamba's state layouts.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import crc32c
import torch
import xxhash
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from quillclient.client import QuillClient
from quillclient.config import ClientConfig, _safe
from quillclient.errors import BufferTooSmall, QuillError
from quillclient.vllm.keys import block_key, index_hash
from quillclient.vllm.seed import SeedGuard, check_seed_at_start

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<4sHHIIQI4x")  # magic, version, reserved, layers, page bytes, layout, crc32c
_MAGIC, _VERSION = b"QKV1", 1
HEADER_BYTES = _HEADER.size  # 32


# -- the block object ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockObject:
    """The layout of one block's object in the pool, as this worker's tensors define it."""

    layout: int  # 64-bit id: model, cache spec, layer count, tensor-parallel size
    layers: int
    page_bytes: int  # one layer's [H, N, C] page
    rank: int = 0

    @property
    def nbytes(self) -> int:
        return HEADER_BYTES + self.layers * self.page_bytes

    @property
    def tag(self) -> str:
        return f"{self.layout:016x}"

    def header(self, payload: memoryview) -> bytes:
        return _HEADER.pack(_MAGIC, _VERSION, 0, self.layers, self.page_bytes, self.layout,
                            crc32c.crc32c(payload))

    def check(self, header: memoryview, payload: memoryview, verify: bool) -> str:
        """'' when the object is this layout's and intact, else what is wrong with it."""
        magic, version, _, layers, page, layout, crc = _HEADER.unpack(header)
        if magic != _MAGIC or version != _VERSION:
            return "not a QuillConnector block"
        if (layers, page, layout) != (self.layers, self.page_bytes, self.layout):
            return f"another layout ({layout:016x}: {layers} layers of {page} bytes)"
        if verify and crc32c.crc32c(payload) != crc:
            return "CRC32C mismatch"
        return ""


def layout_id(model: str, spec: FullAttentionSpec, layers: int, tp_size: int) -> int:
    """The layout id both sides derive from vLLM's config: equal ids, equal bytes."""
    text = (f"{model}|{spec.dtype}|{spec.block_size}|{spec.num_kv_heads}|{spec.head_size}|"
            f"{getattr(spec, 'head_size_v', spec.head_size)}|{spec.page_size_bytes}|{layers}|tp{tp_size}")
    return xxhash.xxh64_intdigest(text.encode())


def block_object_key(block_hash: bytes, obj: BlockObject) -> str:
    """`<hex>.<layout>.r<rank>`: a vLLM block's object for one tensor-parallel rank."""
    return f"{block_key(block_hash)}.{obj.tag}.r{obj.rank}"


# -- options --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """`kv_connector_extra_config`, checked at engine start."""

    url: str = "quill://127.0.0.1:7379"
    shared_memory: str = "auto"  # auto | require | off
    load: str = "async"  # async: between steps, the request waits; sync: inside the step that uses it
    save: str = "all"  # all: every full block once computed; prompt: the prompt's blocks only
    io_threads: int = 4
    batch_blocks: int = 32  # blocks per put/get call
    handoff_wait_ms: int = 2000  # a decode leg waits at most this long for the blocks its prefill names
    verify_crc: bool = True
    load_errors: str = "recompute"  # what vLLM does with a block that fails to load: recompute | fail
    allow_private_seed: bool = False

    @classmethod
    def parse(cls, extra: dict[str, Any]) -> Options:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"QuillConnector: unknown kv_connector_extra_config key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        opts = cls(**extra)
        choices = {"shared_memory": ("auto", "require", "off"), "load": ("async", "sync"), "save": ("all", "prompt"),
                   "load_errors": ("recompute", "fail")}
        for name, allowed in choices.items():
            if getattr(opts, name) not in allowed:
                raise ValueError(f"QuillConnector: {name} must be one of {', '.join(allowed)}, "
                                 f"not {getattr(opts, name)!r}")
        for name in ("verify_crc", "allow_private_seed"):
            if not isinstance(getattr(opts, name), bool):
                raise ValueError(f"QuillConnector: {name} must be true or false, not {getattr(opts, name)!r}")
        for name in ("io_threads", "batch_blocks"):
            if not isinstance(getattr(opts, name), int) or getattr(opts, name) < 1:
                raise ValueError(f"QuillConnector: {name} must be a positive integer, not {getattr(opts, name)!r}")
        if not isinstance(opts.handoff_wait_ms, int) or opts.handoff_wait_ms < 0:
            raise ValueError(f"QuillConnector: handoff_wait_ms must be a non-negative integer, "
                             f"not {opts.handoff_wait_ms!r}")
        return opts


# -- what the scheduler tells the workers each step -------------------------------------------


@dataclass
class Transfer:
    """Blocks of one request to move: vLLM block hashes, the GPU block ids they go to or come from."""

    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    parents: list[bytes | None] = field(default_factory=list)  # saves: each block's parent hash
    sync: bool = True  # loads: inside this step (False: between steps, reported by get_finished)


@dataclass
class QuillConnectorMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


@dataclass
class QuillConnectorStats(KVConnectorStats):
    """Blocks and bytes saved and loaded, pool hits and load errors, seconds spent, per interval."""

    KEYS = ("blocks_saved", "bytes_saved", "blocks_loaded", "bytes_loaded", "load_errors", "save_errors",
            "save_seconds", "load_seconds")

    def __post_init__(self) -> None:
        for k in self.KEYS:
            self.data.setdefault(k, 0)

    def reset(self) -> None:
        self.data = {k: 0 for k in self.KEYS}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class QuillPromMetrics(KVConnectorPromMetrics):
    """The stats as Prometheus counters on vLLM's /metrics: `vllm:quill_connector_<stat>_total`,
    labelled as vLLM labels its own (model name, engine)."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[tuple[int, str], Any] = {}
        for key in QuillConnectorStats.KEYS:
            counter = self._counter_cls(name=f"vllm:quill_connector_{key}",
                                        documentation=f"QuillConnector: {key.replace('_', ' ')}",
                                        labelnames=labelnames)
            for engine, values in per_engine_labelvalues.items():
                self._counters[(engine, key)] = counter.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            counter = self._counters.get((engine_idx, key))
            if counter is not None and value:
                counter.inc(value)


# -- the connector ------------------------------------------------------------------------------


@dataclass
class _ReqState:
    request: Request
    present: list[bool] = field(default_factory=list)  # prompt blocks the pool held at lookup
    computed_at_lookup: int = 0
    handled: int = 0  # blocks [0, handled) are saved, loaded or known in the pool
    waiting_since: float | None = None


class QuillConnector(KVConnectorBase_V1):
    """vLLM's KV connector for a quilld pool (see the module doc)."""

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.opts = Options.parse(dict(ktc.kv_connector_extra_config or {}))
        check_seed_at_start("QuillConnector", self.opts.allow_private_seed, vllm_config)
        if ktc.kv_load_failure_policy != self.opts.load_errors:
            # A pooled block can be evicted between the lookup and the load: that is a recompute,
            # not a failed request (vLLM's own default is "fail"). The scheduler reads the policy
            # after it made its connector, so this is where it is set.
            object.__setattr__(ktc, "kv_load_failure_policy", self.opts.load_errors)
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"QuillConnector: {len(groups)} KV-cache groups; it supports one group of full "
                             "attention (start vLLM with --disable-hybrid-kv-cache-manager)")
        spec = groups[0].kv_cache_spec
        if type(spec) is not FullAttentionSpec:
            raise ValueError(f"QuillConnector: {type(spec).__name__} layers are not supported (full attention only)")
        self._block_size = spec.block_size
        hash_bs = getattr(kv_cache_config, "hash_block_size", None)
        if hash_bs not in (None, spec.block_size):
            raise ValueError(f"QuillConnector: hash block size {hash_bs} differs from the block size "
                             f"{spec.block_size}; it needs one hash per block")
        parallel = vllm_config.parallel_config
        self._tp_size = parallel.tensor_parallel_size
        if parallel.pipeline_parallel_size != 1:
            raise ValueError("QuillConnector: pipeline parallelism is not supported")
        self._layer_names = list(groups[0].layer_names)
        model = vllm_config.model_config.served_model_name or vllm_config.model_config.model
        if isinstance(model, list):
            model = model[0]
        self._layout = layout_id(str(model), spec, len(self._layer_names), self._tp_size)
        self._page_bytes = spec.page_size_bytes
        self._objects = [BlockObject(self._layout, len(self._layer_names), self._page_bytes, r)
                         for r in range(self._tp_size)]  # one per tensor-parallel rank
        self._where = _safe(self.opts.url)
        cfg = ClientConfig.from_url(self.opts.url, shared_memory=self.opts.shared_memory)
        self._client = QuillClient(config=cfg)
        try:
            self._client.ping()
        except QuillError as e:
            self._client.close()
            raise ValueError(f"QuillConnector: quilld at {self._where} does not answer: {e}") from None
        self._seed = SeedGuard("QuillConnector", self.opts.allow_private_seed)
        if role == KVConnectorRole.SCHEDULER:
            self._reqs: dict[str, _ReqState] = {}
            self._loads: list[Transfer] = []
            self._producer = ktc.is_kv_producer
            self._consumer = ktc.is_kv_consumer
        else:
            self._worker = _Worker(self)
        log.info("QuillConnector (%s): quilld at %s over %s, layout %016x, %s loads, saves %s", role.name,
                 self._where, "shared memory" if self._client.transport == "shm" else "TCP", self._layout,
                 self.opts.load, self.opts.save if ktc.is_kv_producer else "off")

    # -- scheduler side ---------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self._reqs.setdefault(request.request_id, _ReqState(request))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._reqs.setdefault(request.request_id, _ReqState(request))
        if not self._consumer or self._seed.refused():
            return 0, False
        bs = self._block_size
        n = min(len(request.block_hashes), request.num_prompt_tokens // bs)
        try:
            present = self._exists(request.block_hashes[:n])
        except QuillError as e:
            log.warning("QuillConnector: lookup of %s failed, computing it: %s", request.request_id, e)
            return 0, False
        state.present, state.computed_at_lookup = present, num_computed_tokens
        lead = 0
        while lead < n and present[lead]:
            lead += 1
        wanted = _handoff_blocks(request)
        if wanted and lead < min(wanted, n):  # the prefill leg's blocks are on their way
            now = time.monotonic()
            if state.waiting_since is None:
                state.waiting_since = now
            if (now - state.waiting_since) * 1000 < self.opts.handoff_wait_ms:
                return None, False
            log.warning("QuillConnector: %s: %d of the %d blocks its prefill saved are in the pool after %d ms",
                        request.request_id, lead, wanted, self.opts.handoff_wait_ms)
        hit = min(lead * bs, request.num_prompt_tokens - 1) - num_computed_tokens
        if hit <= 0:
            return 0, False
        return hit, self.opts.load == "async"

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._reqs.setdefault(request.request_id, _ReqState(request))
        if num_external_tokens <= 0:
            return
        bs = self._block_size
        start = state.computed_at_lookup // bs
        end = -(-(state.computed_at_lookup + num_external_tokens) // bs)
        ids = blocks.get_block_ids()[0]
        self._loads.append(Transfer(request.request_id, list(request.block_hashes[start:end]), list(ids[start:end]),
                                    sync=self.opts.load == "sync"))
        state.handled = max(state.handled, end)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = QuillConnectorMetadata(loads=self._loads)
        self._loads = []
        if not self._producer or self._seed.why:
            return meta
        bs = self._block_size
        cached = scheduler_output.scheduled_cached_reqs
        req_ids = [r.req_id for r in scheduler_output.scheduled_new_reqs] + list(cached.req_ids)
        for req_id in req_ids:
            state = self._reqs.get(req_id)
            if state is None:
                continue
            req = state.request
            scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            drafts = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
            full = min((req.num_computed_tokens + scheduled - drafts) // bs, len(req.block_hashes))
            if self.opts.save == "prompt":
                full = min(full, req.num_prompt_tokens // bs)
            if full <= state.handled:
                continue
            ids = self._kv_cache_manager.get_blocks(req_id).get_block_ids()[0]
            todo = [i for i in range(state.handled, full) if not (i < len(state.present) and state.present[i])]
            if todo:
                hashes = req.block_hashes
                meta.saves.append(Transfer(req_id, [hashes[i] for i in todo], [ids[i] for i in todo],
                                           parents=[hashes[i - 1] if i else None for i in todo]))
            state.handled = full
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        state = self._reqs.pop(request.request_id, None)
        params = request.kv_transfer_params or {}
        if state is None or not params.get("do_remote_decode"):
            return False, None
        n = min(state.handled, request.num_prompt_tokens // self._block_size)
        return False, {"quill_blocks": n, "quill_layout": f"{self._layout:016x}"}

    # -- worker side --------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, QuillConnectorMetadata)
        self._worker.start_loads(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a sync load is whole before the forward starts: a block's object holds every layer

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # saved whole in wait_for_save, once every layer of the step is written

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, QuillConnectorMetadata)
        self._worker.save(meta.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self._worker.finished_loads() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._role != KVConnectorRole.WORKER:
            return None
        return self._worker.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return QuillConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics:
        return QuillPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER:
            self._worker.shutdown()
        self._client.close()

    # -- helpers ---------------------------------------------------------------------------------------

    def _keys(self, block_hash: bytes) -> list[str]:
        """The block's object keys, one per tensor-parallel rank."""
        return [block_object_key(block_hash, obj) for obj in self._objects]

    def _exists(self, hashes: list[bytes]) -> list[bool]:
        """Whether every rank's object of each block is in the pool: one pipelined round trip."""
        if not hashes:
            return []
        ranks = self._tp_size
        found = self._client.exists_many([k for h in hashes for k in self._keys(h)])
        return [all(found[i * ranks:(i + 1) * ranks]) for i in range(len(hashes))]



def _handoff_blocks(request: Request) -> int:
    """How many blocks the request's prefill leg saved for it (0: not a decode leg of ours)."""
    params = request.kv_transfer_params or {}
    try:
        return max(0, int(params.get("quill_blocks") or 0))
    except (TypeError, ValueError):
        return 0


class _Worker:
    """The worker half: the layer tensors, a staging area per transfer, and the I/O threads."""

    def __init__(self, conn: QuillConnector) -> None:
        self._conn = conn
        self._client = conn._client
        self._opts = conn.opts
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized
        self._rank = get_tensor_model_parallel_rank() if model_parallel_is_initialized() else 0
        self._obj = conn._objects[self._rank]
        self._layers: list[torch.Tensor] = []
        self._pool = ThreadPoolExecutor(max_workers=self._opts.io_threads, thread_name_prefix="quillconn")
        self._lock = threading.Lock()
        self._errors: set[int] = set()
        self._done_loads: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._saves: list[Future] = []
        self._stats = QuillConnectorStats()
        self._free: list[torch.Tensor] = []  # staging areas to reuse: a fresh one costs its page faults

    def _staging(self, n: int) -> torch.Tensor:
        """At least n rows of object bytes in host memory, reused across transfers (`_release`)."""
        with self._lock:
            for i, t in enumerate(self._free):
                if t.shape[0] >= n:
                    return self._free.pop(i)
        return torch.empty((max(n, self._opts.batch_blocks), self._obj.nbytes), dtype=torch.uint8,
                           pin_memory=self._device.type == "cuda")

    def _release(self, staged: torch.Tensor) -> None:
        with self._lock:
            if len(self._free) < 2 * self._opts.io_threads:
                self._free.append(staged)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self._conn._layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"QuillConnector: no KV tensor for layer(s) {', '.join(missing[:4])}")
        layers = [kv_caches[n] for n in self._conn._layer_names]
        first = layers[0]
        if first.dim() != 4:
            raise ValueError(f"QuillConnector: expected vLLM's [B, H, N, C] per-layer KV view, got shape "
                             f"{tuple(first.shape)}")
        for name, t in zip(self._conn._layer_names, layers):
            if t.shape[1:] != first.shape[1:] or t.dtype != first.dtype:
                raise ValueError(f"QuillConnector: layer {name} is {tuple(t.shape)} {t.dtype}, not "
                                 f"{tuple(first.shape)} {first.dtype} like the first layer")
        page = first[0].numel() * first.element_size()
        if page != self._obj.page_bytes:
            raise ValueError(f"QuillConnector: a layer's block page is {page} bytes, the cache spec says "
                             f"{self._obj.page_bytes}")
        self._layers = layers
        self._device = first.device
        self._stream = torch.cuda.Stream(device=first.device) if first.device.type == "cuda" else None
        log.info("QuillConnector: %d layers of %s on %s, %d-byte block objects", len(layers),
                 tuple(first.shape), first.device, self._obj.nbytes)

    # -- saves -----------------------------------------------------------------------------------------

    def save(self, saves: list[Transfer]) -> None:
        """Copy each block out of the tensors now (they may be reused once this returns), put them
        into the pool on the I/O threads."""
        self._saves = [f for f in self._saves if not f.done()]
        for t in saves:
            for lo in range(0, len(t.hashes), self._opts.batch_blocks):
                part = slice(lo, lo + self._opts.batch_blocks)
                staged = self._gather(t.block_ids[part])
                self._saves.append(self._pool.submit(self._put, t.hashes[part], t.parents[part], staged))

    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        """A staging area whose first n rows are each a header's room, then the block's pages in the
        model's layer order (the header is written on the I/O thread, with the payload's CRC)."""
        n, page = len(block_ids), self._obj.page_bytes
        out = self._staging(n)
        pages = out[:n, HEADER_BYTES:].view(n, len(self._layers), page)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self._device)
        for i, layer in enumerate(self._layers):
            src = layer.index_select(0, idx).reshape(n, -1).view(torch.uint8)
            pages[:, i].copy_(src, non_blocking=self._device.type == "cuda")
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()
        return out

    def _put(self, hashes: list[bytes], parents: list[bytes | None], staged: torch.Tensor) -> None:
        t0 = time.perf_counter()
        rows = staged.numpy()
        items, chain = [], []
        for h, p, row in zip(hashes, parents, rows):  # the first len(hashes) rows
            view = memoryview(row)
            view[:HEADER_BYTES] = self._obj.header(view[HEADER_BYTES:])
            items.append((block_object_key(h, self._obj), view))
            chain.append((index_hash(h), None if p is None else index_hash(p)))
        try:
            self._client.put_blocks(items, hashes=chain if self._rank == 0 else None)
        except Exception as e:  # noqa: BLE001 - a lost save is a later miss, never a wrong block
            log.warning("QuillConnector: saving %d blocks failed: %s", len(items), e)
            with self._lock:
                self._stats.data["save_errors"] += len(items)
            return
        finally:
            count = len(items)
            del items, rows
            self._release(staged)
        with self._lock:
            self._stats.data["blocks_saved"] += count
            self._stats.data["bytes_saved"] += count * self._obj.nbytes
            self._stats.data["save_seconds"] += time.perf_counter() - t0

    # -- loads -----------------------------------------------------------------------------------------

    def start_loads(self, loads: list[Transfer]) -> None:
        for t in loads:
            if t.sync:
                self._load(t)
            else:
                self._pool.submit(self._load_async, t)

    def _load_async(self, t: Transfer) -> None:
        try:
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    self._load(t)
                self._stream.synchronize()
            else:
                self._load(t)
        finally:
            self._done_loads.put(t.req_id)

    def _load(self, t: Transfer) -> None:
        """Read the blocks into a staging area, check each, copy the good ones into the tensors;
        the others' block ids are load errors (vLLM recomputes them)."""
        t0 = time.perf_counter()
        n, obj, batch = len(t.hashes), self._obj, self._opts.batch_blocks
        staged = self._staging(n)
        rows = [memoryview(r) for r in staged.numpy()[:n]]
        keys = [block_object_key(h, obj) for h in t.hashes]
        got: list[int | None] = []
        try:
            for lo in range(0, n, batch):
                try:
                    got += self._client.get_many_into(keys[lo:lo + batch], rows[lo:lo + batch])
                except BufferTooSmall as e:  # a larger value: not this layout
                    got += list(e.results or [None] * len(keys[lo:lo + batch]))
        except Exception as e:  # noqa: BLE001 - an unreadable pool is a miss of every block left
            log.warning("QuillConnector: loading %d blocks of %s failed: %s", n, t.req_id, e)
        got += [None] * (n - len(got))
        good, bad = [], []
        for i, size in enumerate(got):
            if size is None or size < 0:
                why = "missing"
            elif size != obj.nbytes:
                why = f"{size} bytes, not {obj.nbytes}"
            else:
                why = obj.check(rows[i][:HEADER_BYTES], rows[i][HEADER_BYTES:], self._opts.verify_crc)
            if why:
                bad.append(i)
                log.warning("QuillConnector: block %s of %s is not loaded (%s); it is recomputed", keys[i],
                            t.req_id, why)
            else:
                good.append(i)
        if good:
            self._scatter(staged, good, [t.block_ids[i] for i in good])
        del rows
        self._release(staged)
        with self._lock:
            self._errors.update(t.block_ids[i] for i in bad)
            self._stats.data["blocks_loaded"] += len(good)
            self._stats.data["bytes_loaded"] += len(good) * obj.nbytes
            self._stats.data["load_errors"] += len(bad)
            self._stats.data["load_seconds"] += time.perf_counter() - t0

    def _scatter(self, staged: torch.Tensor, rows: list[int], block_ids: list[int]) -> None:
        page, n = self._obj.page_bytes, len(rows)
        src = staged[:n] if rows == list(range(n)) else staged[torch.tensor(rows, dtype=torch.long)]
        src = src.to(self._device, non_blocking=True)[:, HEADER_BYTES:].reshape(n, len(self._layers), page)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self._device)
        for i, layer in enumerate(self._layers):
            part = src[:, i].contiguous().view(layer.dtype).view((n,) + tuple(layer.shape[1:]))
            layer.index_copy_(0, idx, part)

    def finished_loads(self) -> set[str]:
        out = set()
        while True:
            try:
                out.add(self._done_loads.get_nowait())
            except queue.Empty:
                return out

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def take_stats(self) -> QuillConnectorStats | None:
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, QuillConnectorStats()
        return stats

    def drain(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        for f in list(self._saves):
            e = f.exception(timeout=max(0.0, deadline - time.monotonic()))
            if e is not None:
                log.error("QuillConnector: a save failed: %r", e)
        self._saves = []

    def shutdown(self) -> None:
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)

