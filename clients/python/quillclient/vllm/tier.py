"""QuillTier: quilld as a secondary tier of vLLM 0.33's own KV offloading.

vLLM's `OffloadingConnector` with `TieringOffloadingSpec` keeps offloaded KV in a CPU region it
copies to and from the GPU itself; a secondary tier moves chunks between that region and
somewhere else, from the scheduler process, never touching the GPU. This tier's somewhere else
is a quilld pool:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8e9,
        "secondary_tiers": [{"type": "QuillTier", "module_path": "quillclient.vllm",
                             "url": "quill://quilld.internal:7379?model=llama-3-8b&tokenizer=llama3"}]}}'

Keys. A chunk is named by vLLM's own block hash (the `OffloadKey`'s hash: the hash of the
chunk's last block, exactly what `request.block_hashes` and the engine's KV events carry):
`keys.block_key`, the lowercase hex for KV-cache group 0, `<hex>.g<group>` for the hybrid
allocator's other groups, in the identity scope the URL names (none: the user's default scope).
Its value is the chunk's bytes as the CPU region holds them. Group 0's chunks are stored with
their hash and their parent's (`put_blocks(..., hashes=...)`), so ROUTE, LOCATE and the
gateway's handoff check credit them as pool copies under the hash the engine reports.

Engines find each other's chunks only when their hashes agree: same model, block size, hash
algorithm, and the same NONE_HASH seed. vLLM derives that seed from PYTHONHASHSEED, and for
`xxhash`/`xxhash_cbor` without PYTHONHASHSEED it is random per process: then nothing this
engine stores could ever be found by another engine (or by itself after a restart). The tier
refuses to start in that case (`allow_private_seed: true` keeps it, with a warning).

Threads. Everything vLLM calls here is non-blocking: a lookup is answered from
`_PoolLookup` (vLLM's AsyncLookupManager: the step's new keys go to quilld in one pipelined
EXISTS round trip on its thread, the answer is there by the next step: RETRY until then);
stores and loads run on `io_threads` threads (one quillclient, thread-safe), and their results
wait in a queue for `get_finished_jobs`. A load writes straight into the CPU region
(`get_many_into`, over shared memory on quilld's host, TCP elsewhere); a chunk that is missing,
of the wrong length, or unreadable fails its load and is marked a miss, so vLLM recomputes it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from quillclient.client import QuillClient
from quillclient.config import ClientConfig, _safe
from quillclient.errors import BufferTooSmall, QuillError
from quillclient.vllm.keys import block_key, index_hash, split_offload_key
from quillclient.vllm.seed import SeedGuard, check_seed_at_start

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger(__name__)

class _PoolLookup(AsyncLookupManager):
    """vLLM's async lookup bookkeeping, with one existence query per step for all its keys.

    vLLM's worker asks `batch_lookup` once per request of the step; the tier's keys do not
    depend on the request (the scope is the tier's), so this worker sends the whole step's
    keys at once instead. It overrides AsyncLookupManager's `_worker` (vLLM 0.33's queues:
    `_lookup_queue` in, `_pending_results` out, one (key, generation, found) per entry)."""

    def __init__(self, tier: QuillTier) -> None:
        self._tier = tier
        super().__init__(tier_type=tier.tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.exists(keys)

    def _worker(self) -> None:
        while True:
            pending = self._lookup_queue.get()
            if pending is None:
                break
            keys = list(dict.fromkeys(key for key, _, _ in pending))
            try:
                found = dict(zip(keys, self._tier.exists(keys)))
            except Exception as e:  # noqa: BLE001 - a lookup that fails is a miss, never a crash
                log.warning("QuillTier: existence query of %d keys failed: %s", len(keys), e)
                found = {}
            self._pending_results.put([(key, gen, found.get(key, False)) for key, _, gen in pending])


@dataclass
class _Chain:
    """A request's chunk hashes by (group, end token), to name each stored chunk's parent."""

    hashes: dict[tuple[int, int], bytes] = field(default_factory=dict)


class QuillTier(SecondaryTierManager):
    """A secondary tier of vLLM's offloading whose chunks live in a quilld pool.

    Options (the tier's entry in `secondary_tiers`, besides `type` and `module_path`):
    - `url`: `quill://[user[:password]@]host[:port][?model=M&tokenizer=T&adapter=A]`
      (`password_file=` or `password_env=` in the query instead of a password in the URL);
    - `shared_memory`: "auto" (default: on quilld's host when it offers it), "require", "off";
    - `io_threads` (4): stores and loads in flight at once;
    - `store_batch` (64): chunks per put_blocks call of a store job;
    - `allow_private_seed` (false): start even when the hash seed is random (see the module doc);
    - `enable_kv_events` (false): report stored chunks as this tier's KV events;
    - `locality` ("REMOTE"): what this tier's events say of it.
    """

    medium: ClassVar[Medium] = Medium.CPU  # quilld's DRAM (and its SSD tier behind it)
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str,
                 url: str = "quill://127.0.0.1:7379", shared_memory: str = "auto", io_threads: int = 4,
                 store_batch: int = 64, allow_private_seed: bool = False, enable_kv_events: bool = False,
                 locality: str | None = "REMOTE", backpressure_detector: BackpressureDetector | None = None,
                 **client_options: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if int(io_threads) < 1:
            raise ValueError(f"QuillTier: io_threads must be at least 1, not {io_threads!r}")
        if int(store_batch) < 1:
            raise ValueError(f"QuillTier: store_batch must be at least 1, not {store_batch!r}")
        self.locality = Locality(locality) if locality is not None else None
        check_seed_at_start("QuillTier", bool(allow_private_seed))
        cfg = ClientConfig.from_url(url, shared_memory=shared_memory, **client_options)
        self._where = _safe(url)
        self._client = QuillClient(config=cfg)
        try:
            self._client.ping()
        except QuillError as e:
            self._client.close()
            raise ValueError(f"QuillTier: quilld at {self._where} does not answer: {e}") from None
        self._view = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 or primary_kv_view.format != "B" \
            else primary_kv_view
        self._chunk_bytes = self.block_size_bytes
        cache = offloading_spec.config.cache
        self._tokens_per_chunk = cache.tokens_per_hash * cache.blocks_per_chunk
        self._store_batch = int(store_batch)
        self._pool = ThreadPoolExecutor(max_workers=int(io_threads), thread_name_prefix="quilltier")
        self._done: queue.SimpleQueue[tuple[JobResult, list[OffloadKey]]] = queue.SimpleQueue()
        self._inflight: dict[JobId, Future] = {}
        self._lock = threading.Lock()  # _inflight is written by the I/O threads as jobs end
        self._events: list[OffloadingEvent] | None = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self._events = []
            else:
                log.warning("QuillTier: enable_kv_events is set but vLLM's KV cache events are off; no events")
        self._store_keys: dict[JobId, list[OffloadKey]] = {}
        self._seed = SeedGuard("QuillTier", bool(allow_private_seed))
        self._lookup = _PoolLookup(self)
        log.info("QuillTier: quilld at %s over %s, %d-byte chunks, scope %s", self._where,
                 "shared memory" if self._client.transport == "shm" else "TCP", self._chunk_bytes,
                 cfg.scope or "default")

    # -- what vLLM calls (scheduler thread, under the tiering manager's lock) ----------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._seed.refused():
            return LookupResult.MISS
        self._note(key, req_context)
        found = self._lookup.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        if len(keys) != len(job_metadata.chunk_ids):
            raise ValueError(f"QuillTier: store job {job_metadata.job_id}: {len(keys)} keys, "
                             f"{len(job_metadata.chunk_ids)} chunk ids")
        ctx = job_metadata.req_context
        for key in keys:
            self._note(key, ctx)
        chain = ctx.get_state(_Chain)
        hashes = [self._chain_of(key, ctx, chain) for key in keys]
        views = [self._chunk(int(c)) for c in job_metadata.chunk_ids]
        if self._events is not None:
            self._store_keys[job_metadata.job_id] = keys
        self._start(job_metadata, keys, lambda: self._store(keys, views, hashes))

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        if len(keys) != len(job_metadata.chunk_ids):
            raise ValueError(f"QuillTier: load job {job_metadata.job_id}: {len(keys)} keys, "
                             f"{len(job_metadata.chunk_ids)} chunk ids")
        views = [self._chunk(int(c)) for c in job_metadata.chunk_ids]
        self._start(job_metadata, keys, lambda: self._load(keys, views))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out = []
        while True:
            try:
                result, failed = self._done.get_nowait()
            except queue.Empty:
                break
            if failed:
                self._lookup.mark_miss(failed)  # recomputed, and not offered again
            keys = self._store_keys.pop(result.job_id, None)
            if keys and result.success and self._events is not None:
                self._events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=False,
                                                    locality=self.locality))
            out.append(result)
        return out

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._inflight)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events:
            events, self._events = self._events, []
            yield from events

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return  # quilld keeps its own recency: every read of a chunk refreshes it

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookup.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookup.flush()

    def drain_jobs(self) -> None:
        with self._lock:
            futures = list(self._inflight.values())
        for f in futures:
            f.exception()  # waits; the job's result is queued for get_finished_jobs either way

    def shutdown(self) -> None:
        self._lookup.shutdown()
        self._pool.shutdown(wait=True)
        self._client.close()

    def config_info(self) -> dict[str, str]:
        return {"quilld": self._where}

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("quilld",)

    # -- the pool (I/O threads) --------------------------------------------------------------------

    def exists(self, keys: list[OffloadKey]) -> list[bool]:
        """Whether each chunk is in the pool: one pipelined round trip."""
        return self._client.exists_many([_pool_key(k) for k in keys])

    def _store(self, keys: list[OffloadKey], views: list[memoryview],
               hashes: list[tuple[int, int | None] | None]) -> list[OffloadKey]:
        for lo in range(0, len(keys), self._store_batch):
            part = range(lo, min(lo + self._store_batch, len(keys)))
            chained = [i for i in part if hashes[i] is not None]
            plain = [i for i in part if hashes[i] is None]
            if chained:
                self._client.put_blocks([(_pool_key(keys[i]), views[i]) for i in chained],
                                        hashes=[hashes[i] for i in chained])
            if plain:
                self._client.put_blocks([(_pool_key(keys[i]), views[i]) for i in plain])
        return []

    def _load(self, keys: list[OffloadKey], views: list[memoryview]) -> list[OffloadKey]:
        """The keys that did not load (missing, of another length, or too large for a chunk)."""
        try:
            got: list[int | None] = self._client.get_many_into([_pool_key(k) for k in keys], views)
        except BufferTooSmall as e:  # a value larger than a chunk: not this engine's layout
            got = list(e.results or [None] * len(keys))
        return [k for k, n in zip(keys, got) if n != self._chunk_bytes]

    # -- helpers -----------------------------------------------------------------------------------

    def _start(self, job: TransferJob, keys: list[OffloadKey], work) -> None:
        if self._seed.refused():
            self._done.put((JobResult(job_id=job.job_id, success=False),
                            [] if not job.is_promotion else keys))
            return
        nbytes = len(keys) * self._chunk_bytes

        def run() -> None:
            failed: list[OffloadKey]
            try:
                failed = work()
            except Exception as e:  # noqa: BLE001 - the job fails, vLLM recomputes or drops it
                log.warning("QuillTier: %s job %d of %d chunks failed: %s", "load" if job.is_promotion else "store",
                            job.job_id, len(keys), e)
                failed = keys
            lost = set(failed)
            ok = [k for k in keys if k not in lost] if lost else keys
            result = JobResult(job_id=job.job_id, success=not failed,
                               successful_keys=tuple(ok) if failed and ok and job.is_promotion else None,
                               transfer_bytes=nbytes if not failed else len(ok) * self._chunk_bytes)
            with self._lock:
                self._inflight.pop(job.job_id, None)
            self._done.put((result, failed if job.is_promotion else []))

        with self._lock:
            self._inflight[job.job_id] = self._pool.submit(run)

    def _chunk(self, chunk_id: int) -> memoryview:
        start = chunk_id * self._chunk_bytes
        if start < 0 or start + self._chunk_bytes > self._view.nbytes:
            raise ValueError(f"QuillTier: chunk id {chunk_id} is outside the CPU region")
        return self._view[start:start + self._chunk_bytes]

    def _note(self, key: OffloadKey, ctx: ReqContext) -> None:
        """Remember the key's hash at its position in the request, to name its successor's parent."""
        pos = ctx.get_offload_key_position(key)
        if pos is None:
            return
        chain = ctx.get_state(_Chain)
        if chain is None:
            chain = _Chain()
            ctx.set_state(chain)
        block_hash, group = split_offload_key(key)
        chain.hashes[(group, pos)] = block_hash

    def _chain_of(self, key: OffloadKey, ctx: ReqContext, chain: _Chain | None) -> tuple[int, int | None] | None:
        """(hash, parent hash) for PUT2PHASE's HASH and PARENT: group 0's chunks only (the other
        groups hash the same tokens, and one copy of a prefix is credited once)."""
        block_hash, group = split_offload_key(key)
        if group != 0:
            return None
        pos = ctx.get_offload_key_position(key)
        parent = None
        if pos is not None and chain is not None:
            parent = chain.hashes.get((0, pos - self._tokens_per_chunk))
        return index_hash(block_hash), None if parent is None else index_hash(parent)


def _pool_key(key: OffloadKey) -> str:
    block_hash, group = split_offload_key(key)
    return block_key(block_hash, group)
