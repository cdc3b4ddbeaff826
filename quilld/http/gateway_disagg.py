"""A disaggregated request through the gateway: vLLM's proxy protocol, with a handoff quilld can check.

When ROUTE's decision pairs a prefill engine with another engine that decodes
(index/pairing.py), the gateway runs what vLLM's disaggregated-serving proxy runs
(vLLM 0.33, tests/v1/kv_connector/nixl_integration/toy_proxy_server.py), for
/v1/completions and /v1/chat/completions alike, streamed or not:

1. The prefill engine gets the client's request with one token to generate, not
   streamed, and `kv_transfer_params: {"do_remote_decode": true, ...}`
   (gateway_upstream.prefill_body); a prefill lease counts its uncached tokens
   meanwhile. A prefill engine that fails (refused, reset, 5xx or 429, silent for
   `first_byte_timeout_ms`, an answer that is not JSON) cools down and the next
   prefill candidate is tried, `gateway.max_attempts` prefills at most; when none is
   left the request is served by the decode engine alone, as an aggregated request
   (`x-quillcache-disaggregated: false`, and `x-quillcache-pair` says why).
2. Once it answered: the handoff. vLLM's proxy sends the decode request blind; here the
   gateway first checks that the prompt's blocks are in the pool (`control.resident`:
   the residency index of this node, one lookup a block, in the prefill engine's
   identity scope; index/handoff.py says how an engine's connector stores them), polling
   for at most `gateway.handoff_wait_ms`. When the decode engine stores through another
   node than the prefill engine, that node is asked at once to pull the blocks
   (cluster/prefetch.py), within the same wait, so the decode engine's connector reads
   them locally. Counted: handoffs on time, late, missing (and their blocks), the wait
   in `quilld_gateway_handoff_wait_seconds`. The decode request goes when the wait ends,
   whatever arrived: the decode engine recomputes what is missing.
   A prefill engine with `kv_transfer = "nixl"` (vLLM's NixlConnector, P2P) keeps its KV
   for the decode engine to read from it directly, as vLLM's toy proxy assumes: nothing is
   in the pool, so there is no wait and no pull; the decode leg goes at once, counted as
   `handoff_direct` (engine to engine). With `kv_transfer = "mooncake"` (vLLM's
   MooncakeConnector) the two legs go at once, tied by a transfer_id, the decode engine
   pulling the KV through the prefill's bootstrap server (`_both_legs`).
3. The decode engine gets the client's request with the `kv_transfer_params` the
   prefill answered (and `do_remote_prefill: true`) and its answer streams back, the
   decision headers (`x-quillcache-prefill-engine`, `-decode-engine`,
   `-disaggregated`, `-pair`: the costs compared, `-handoff`, `-plan`: the prefill
   engine's) before the first byte. A decode engine that fails before the first byte
   cools down and the next decode candidate gets the same request, its node pulling
   the blocks first if it is another: the KV is in the pool, nothing is prefilled again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import aiohttp
from yarl import URL

from quilld.cluster.prefetch import prefetch
from quilld.config import MOONCAKE_BOOTSTRAP_PORT, EngineConfig
from quilld.http.gateway_relay import Relay
from quilld.http.gateway_request import Parsed
from quilld.http.gateway_upstream import (HANDOFF_HEADER, Choice, UpstreamFailed, decode_body, describe,
                                          engine_headers, prefill_body, upstream_headers)
from quilld.http.prompt_blocks import Family, family
from quilld.index.handoff import kv_key
from quilld.index.pairing import Pair
from quilld.index.router import Decision
from quilld.model import IdentityScope

if TYPE_CHECKING:  # annotations only: the gateway imports this module
    from quilld.http.gateway import Gateway

log = logging.getLogger("quilld.gateway")

POLL_FIRST, POLL_MAX = 0.0005, 0.01  # seconds between two looks at the index while the handoff waits


class Disaggregation:
    """The gateway's disaggregated path (the module's docstring)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self._legs: set[asyncio.Task] = set()  # Mooncake prefill legs still running beside their decode

    async def serve(self, req: Parsed, choice: Choice, relay: Relay, hashes: dict[Family, list[int]],
                    tried: set[str]) -> Choice | None:
        """Serve `req` by `choice`'s pair; None once it is answered (or given up), else the aggregated
        attempt the caller makes instead (every prefill engine failed)."""
        gw, pair = self.gw, choice.decision.pair
        body = json.loads(req.body if choice.body is None else choice.body)  # with its cache_salt, if any
        headers = upstream_headers(relay.request.headers, req.request_id) | {"Accept-Encoding": "identity"}
        order = self._prefill_order(choice.decision)
        first = gw.control.engines.engines.get(order[0]) if order else None
        if first is not None and first.kv_transfer == "mooncake":
            await self._both_legs(req, choice, first, body, headers, relay, hashes, tried)
            return None
        kv, prefill, failures = await self._prefill(req, choice.decision, body, headers, hashes)
        if prefill is None:
            gw.stats.counts["prefill_fallbacks"] += 1
            alone = replace(pair, prefill=None, prefill_url=None, prefill_lease=None)
            d = choice.decision
            plan = gw.control.plan_for(choice.engine.id, choice.tag, choice.blocks)
            return replace(choice, decision=Decision(d.engine, d.cost, d.candidates, plan, d.url, None, alone),
                           fallback="prefill_failed: " + ("; ".join(failures) or "no prefill engine left"))
        prefill_fam = family(prefill)
        prefill_blocks = await gw.prompt_blocks(req, prefill_fam, hashes)
        gw.record(prefill, gw.scope_tag(req, prefill_fam, prefill_blocks)[1], prefill_blocks)  # it prefilled the prompt
        await self._decode(req, choice, prefill, prefill_blocks, decode_body(body, kv), relay, hashes, tried)
        return None

    # -- the prefill ------------------------------------------------------------------------
    async def _prefill(self, req: Parsed, d: Decision, body: dict, headers: dict[str, str],
                       hashes: dict[Family, list[int]]) -> tuple[dict | None, EngineConfig | None, list[str]]:
        """Ask prefill engines in the pair's order (healthy ones first) until one answers:
        (its kv_transfer_params, the engine, the failures before it); (None, None, failures) when none did."""
        gw = self.gw
        engines = gw.control.engines
        data = prefill_body(body)
        failures: list[str] = []
        for engine_id in self._prefill_order(d)[:gw.cfg.max_attempts]:
            engine = engines.engines.get(engine_id)
            if engine is None:  # removed meanwhile
                continue
            lease, _ = await self._lease_prefill(req, d, engine, hashes)
            try:
                kv = await self._ask(req, engine, data, headers)
            except UpstreamFailed as e:
                failures.append(f"{engine_id}: {e.reason}")
                self._prefill_failed(req, engine, e)
                continue
            finally:
                self._end_prefill(lease)
            gw.cooling.pop(engine_id, None)
            return kv, engine, failures
        return None, None, failures

    async def _lease_prefill(self, req: Parsed, d: Decision, engine: EngineConfig,
                             hashes: dict[Family, list[int]]) -> tuple[str, list[int]]:
        """A prefill by `engine` begins: counted, and leased for the prompt's tokens it cannot reuse;
        (the lease, the prompt's blocks in its family's hashes)."""
        gw = self.gw
        gw.stats.counts["prefills"] += 1
        fam = family(engine)
        blocks = await gw.prompt_blocks(req, fam, hashes)
        lease = gw.control.engines.acquire(engine.id, "prefill", _uncached(d, engine.id, len(blocks),
                                                                           gw.hasher.tokens_per_block(fam)))
        gw._leases.add(lease)
        return lease, blocks

    def _end_prefill(self, lease: str) -> None:
        self.gw._leases.discard(lease)
        self.gw.control.engines.release(lease)

    def _prefill_failed(self, req: Parsed, engine: EngineConfig, e: BaseException, how: str = "") -> None:
        """A prefill engine failed: counted, cooled down when the failure says so, logged."""
        self.gw.stats.counts["prefill_failures"] += 1
        if isinstance(e, UpstreamFailed) and e.cool:
            self.gw._cool(engine.id)
        log.warning("request %s: prefill engine %s failed (%s)%s", req.request_id, engine.id,
                    getattr(e, "reason", None) or repr(e), how)

    def _prefill_order(self, d: Decision) -> list[str]:
        """The pair's prefill candidates but its decode engine, healthy ones first."""
        pair, now = d.pair, time.monotonic()
        return sorted((e for e in pair.prefill_order if e != pair.decode),
                      key=lambda e: self.gw.cooling.get(e, 0.0) > now)

    async def _both_legs(self, req: Parsed, choice: Choice, prefill: EngineConfig, body: dict,
                         headers: dict[str, str], relay: Relay, hashes: dict[Family, list[int]],
                         tried: set[str]) -> None:
        """vLLM's MooncakeConnector: the prefill and the decode legs at once, tied by one transfer_id;
        the decode engine pulls the prefill's KV through the prefill's bootstrap server while it
        computes it. The prefill leg runs on in the background (its lease held until it answers);
        a prefill that fails is counted and cools down, the decode engine recomputes what it lacks."""
        gw = self.gw
        transfer_id = f"{req.request_id}-{secrets.token_hex(8)}"
        lease, blocks = await self._lease_prefill(req, choice.decision, prefill, hashes)
        leg = asyncio.ensure_future(self._ask(req, prefill, prefill_body(body, {"transfer_id": transfer_id}), headers))
        self._legs.add(leg)

        def prefilled(task: asyncio.Task) -> None:
            self._legs.discard(task)
            self._end_prefill(lease)
            e = asyncio.CancelledError("cancelled") if task.cancelled() else task.exception()
            if e is not None:
                self._prefill_failed(req, prefill, e, " while its decode ran (mooncake)")
            else:
                gw.cooling.pop(prefill.id, None)

        leg.add_done_callback(prefilled)
        gw.record(prefill, gw.scope_tag(req, family(prefill), blocks)[1], blocks)  # it prefills the prompt
        kv = {"remote_engine_id": prefill.kv_engine_id, "remote_bootstrap_addr": bootstrap_addr(prefill),
              "transfer_id": transfer_id}
        await self._decode(req, choice, prefill, blocks, decode_body(body, kv), relay, hashes, tried)

    async def _ask(self, req: Parsed, engine: EngineConfig, data: bytes, headers: dict[str, str]) -> dict:
        """One prefill request: its answer's kv_transfer_params ({} when it names none)."""
        gw = self.gw
        deadline = asyncio.get_running_loop().time() + gw.cfg.first_byte_timeout_ms / 1000
        try:
            async with asyncio.timeout_at(deadline):
                async with gw.session.post(gw._url(engine.url, req.path), data=data,
                                           headers=engine_headers(headers, engine)) as resp:
                    status, raw = resp.status, await resp.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise UpstreamFailed(describe(e)) from None
        if status >= 500 or status == 429:
            raise UpstreamFailed(f"HTTP {status}")
        if status >= 300:
            raise UpstreamFailed(f"HTTP {status}: the prefill engine refused the request", cool=False)
        try:
            answer = json.loads(raw)
        except ValueError:
            raise UpstreamFailed("its answer is not JSON") from None
        kv = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if kv is not None and not isinstance(kv, dict):
            raise UpstreamFailed("its kv_transfer_params is not an object")
        return kv or {}

    # -- the handoff and the decode -------------------------------------------------------------
    async def _decode(self, req: Parsed, choice: Choice, prefill: EngineConfig, blocks: list[int], data: bytes,
                      relay: Relay, hashes: dict[Family, list[int]], tried: set[str]) -> None:
        """The handoff, then decode engines in the pair's order until one answers."""
        gw, d = self.gw, choice.decision
        pair: Pair = d.pair
        engines, counts, control = gw.control.engines, gw.stats.counts, gw.control
        now = time.monotonic()
        order = sorted((e for e in pair.decode_order if e != prefill.id), key=lambda e: gw.cooling.get(e, 0.0) > now)
        src = prefill.locality or control.node_id
        scope = IdentityScope(prefill.tenant, prefill.model, prefill.tokenizer, req.adapter)
        pulled: dict[str, int | None] = {}  # decode node -> blocks it held after its pull
        attempts = 0
        for engine_id in order:
            engine = engines.engines.get(engine_id)
            if engine is None:
                continue
            if attempts >= gw.cfg.max_attempts:
                break
            dst = engine.locality or control.node_id
            # engine to engine: the decode engine reads the prefill's KV itself
            direct = prefill.kv_transfer in ("nixl", "mooncake")
            if attempts:
                counts["decode_retries"] += 1
                if not direct and dst != src and dst not in pulled:
                    pulled[dst] = await self._pull(dst, scope, blocks)
            elif direct:
                counts["handoff_direct"] += 1
                handoff = (f"kv_transfer={prefill.kv_transfer} engine-to-engine"
                           f"{' both-legs-at-once' if prefill.kv_transfer == 'mooncake' else ''} "
                           f"blocks={len(blocks)} waited_ms=0 from={prefill.id}")
            else:
                handoff = await self._handoff(req, prefill, src, dst, scope, blocks, pulled)
            attempts += 1
            fam = family(engine)
            engine_blocks = await gw.prompt_blocks(req, fam, hashes)
            cost = next((c.cost for c in d.candidates if c.engine == engine_id), d.cost)
            decision = Decision(engine_id, cost, d.candidates, d.plan, engine.url, None,
                                replace(pair, decode=engine_id, prefill=prefill.id, prefill_url=prefill.url,
                                        prefill_lease=None, decode_node=dst))
            pull = pulled.get(dst)
            attempt = Choice(engine, decision, gw.scope_tag(req, fam, engine_blocks)[1], engine_blocks, 0, data,
                             {HANDOFF_HEADER: handoff + f" prefetched={'-' if pull is None else pull}"})
            tried.add(engine_id)
            lease = engines.acquire(engine_id, "decode")
            gw._leases.add(lease)
            try:
                await gw._attempt(req, attempt, relay)
                counts["disaggregated"] += 1
                return
            except UpstreamFailed as e:
                counts["upstream_errors"] += 1
                relay.failures.append(f"{engine_id}: {e.reason}")
                if e.cool:
                    gw._cool(engine_id)
                log.warning("request %s: decode engine %s failed before its first byte (%s)", req.request_id,
                            engine_id, e.reason)
            finally:
                gw._leases.discard(lease)
                engines.release(lease)
        gw._settle_missed(relay)
        if relay.resp is not None:  # headers went out with a decode engine that failed before its first byte
            counts["unavailable"] += 1
            await relay.fail("no decode engine could answer: " + "; ".join(relay.failures))
        elif not attempts:
            relay.failures.append("no decode engine left")

    async def _handoff(self, req: Parsed, prefill: EngineConfig, src: str, dst: str, scope: IdentityScope,
                       blocks: list[int], pulled: dict[str, int | None]) -> str:
        """Wait (gateway.handoff_wait_ms at most) until the prompt's blocks are in the pool, pulling them
        to `dst` meanwhile when it is not `src`; the handoff header's text."""
        gw = self.gw
        control, counts = gw.control, gw.stats.counts
        tag = control.engine_tag(prefill.id, req.adapter or None)
        wait = gw.cfg.handoff_wait_ms / 1000
        t0 = time.perf_counter()
        pull = asyncio.ensure_future(self._pull(dst, scope, blocks)) if dst != src and blocks else None
        cluster = gw.node.cluster

        async def resident() -> int:  # this node's index, or in a cluster the directory's owners
            return control.resident(tag, blocks) if cluster is None else await cluster.pool_resident(tag, blocks)

        try:
            n = len(blocks)
            first = have = await resident() if n else 0
            deadline, delay = t0 + wait, POLL_FIRST
            while have < n:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                await asyncio.sleep(min(delay, left))
                delay = min(delay * 2, POLL_MAX)
                have = await resident()
            if pull is not None:
                pulled[dst] = await pull
        finally:
            if pull is not None and not pull.done():  # the client went away meanwhile
                pull.cancel()
        waited = time.perf_counter() - t0
        gw.stats.handoff.observe(waited)
        counts["handoff_blocks"] += n
        if first == n:
            counts["handoff_on_time"] += 1
        elif have == n:
            counts["handoff_late"] += 1
        else:
            counts["handoff_missing"] += 1
            counts["handoff_blocks_missing"] += n - have
        counts["handoff_blocks_late"] += have - first
        return f"blocks={n} resident={have} late={have - first} waited_ms={waited * 1000:.1f} from={src} to={dst}"

    async def _pull(self, dst: str, scope: IdentityScope, blocks: list[int]) -> int:
        """Ask node `dst` to pull the prompt's blocks now (cluster/prefetch.py); the blocks it holds then."""
        gw = self.gw
        counts = gw.stats.counts
        counts["prefetches"] += 1
        got = await prefetch(gw.node.cluster, dst, scope, [kv_key(h) for h in blocks], gw.cfg.handoff_wait_ms / 1000)
        counts["prefetch_blocks"] += got
        return got


def bootstrap_addr(engine: EngineConfig) -> str:
    """The engine's Mooncake bootstrap server: kv_bootstrap, else its url's host on vLLM's default port."""
    if engine.kv_bootstrap:
        return engine.kv_bootstrap
    host = URL(engine.url).host or "127.0.0.1"
    return f"[{host}]:{MOONCAKE_BOOTSTRAP_PORT}" if ":" in host else f"{host}:{MOONCAKE_BOOTSTRAP_PORT}"


def _uncached(d: Decision, engine_id: str, blocks: int, block_tokens: float) -> int:
    """The prompt's tokens `engine_id` cannot reuse, by its candidate's credit."""
    for c in d.candidates:
        if c.engine == engine_id:
            return int(round(max(0.0, blocks - c.credit) * block_tokens))
    return int(blocks * block_tokens)
