"""The fourth stage of a gateway request: one relay strategy per way of moving the prompt's KV.

Every strategy has one method, `serve(req, prompt, choice, relay)`: it carries out the decision
(gateway_decide.py) by asking engines through the legs (gateway_answer.py) until one answers
the client, and returns None, or the choice the co-located strategy serves instead. `Strategies`
says which serves a decision:

- `CoLocated`: one engine prefills and decodes. The decision's engine is asked; one that fails
  before its first body byte cools down and the next decision (the engines not yet tried) is
  asked, `gateway.max_attempts` in all.
- A decision that pairs a prefill engine with another that decodes (index/pairing.py) is run as
  vLLM's disaggregated-serving proxy runs it (vLLM 0.33,
  tests/v1/kv_connector/nixl_integration/toy_proxy_server.py), for /v1/completions and
  /v1/chat/completions alike, streamed or not, by the strategy of the prefill engine's
  `kv_transfer` (`Disaggregated`, below):

  1. The prefill engine gets the client's request with one token to generate, not streamed,
     and `kv_transfer_params: {"do_remote_decode": true, ...}` (gateway_upstream.prefill_body);
     a prefill lease counts its uncached tokens meanwhile. A prefill engine that fails (refused,
     reset, 5xx or 429, silent for `first_byte_timeout_ms`, an answer that is not JSON) cools
     down and the next prefill candidate is tried, `gateway.max_attempts` prefills at most; when
     none is left the request is served by the decode engine alone, co-located
     (`x-quillcache-disaggregated: false`, and `x-quillcache-pair` says why).
  2. The handoff, as the engine that prefilled moves its KV:
     - `ThroughPool` (`kv_transfer = "pool"`): vLLM's proxy sends the decode request blind; here
       the gateway first checks that the prompt's blocks are in the pool (`control.resident`, or
       in a cluster the directory's owners; in the prefill engine's identity scope; index/handoff.py
       says how an engine's connector stores them), polling for at most `gateway.handoff_wait_ms`.
       When the decode engine stores through another node than the prefill engine, that node is
       asked at once to pull the blocks (cluster/prefetch.py), within the same wait, so the decode
       engine's connector reads them locally. Counted: handoffs on time, late, missing (and their
       blocks), the wait in `quilld_gateway_handoff_wait_seconds`. The decode request goes when the
       wait ends, whatever arrived: the decode engine recomputes what is missing.
     - `EngineToEngine` (`"nixl"`, vLLM's NixlConnector, P2P): the prefill engine keeps its KV for
       the decode engine to read from it directly, as vLLM's toy proxy assumes: nothing is in the
       pool, so there is no wait and no pull; the decode leg goes at once, counted `handoff_direct`.
     - `BothLegs` (`"mooncake"`, vLLM's MooncakeConnector): the two legs go at once, tied by a
       transfer_id, the decode engine pulling the KV through the prefill's bootstrap server.
  3. The decode engine gets the client's request with the `kv_transfer_params` the prefill
     answered (and `do_remote_prefill: true`) and its answer streams back, the decision headers
     (`x-quillcache-prefill-engine`, `-decode-engine`, `-disaggregated`, `-pair`: the costs
     compared, `-handoff`, `-plan`: the prefill engine's) before the first byte. A decode engine
     that fails before the first byte cools down and the next decode candidate gets the same
     request, its node pulling the blocks first if it is another (through the pool): nothing is
     prefilled again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol

from yarl import URL

from quilld.cluster.prefetch import prefetch
from quilld.config import MOONCAKE_BOOTSTRAP_PORT, EngineConfig, GatewayConfig
from quilld.http.gateway_decide import Decider, decode_decision, is_split, uncached_tokens
from quilld.http.gateway_engines import EngineBook
from quilld.http.gateway_prompt import Prompt
from quilld.http.gateway_relay import Relay
from quilld.http.gateway_request import Parsed
from quilld.http.gateway_stats import GatewayStats
from quilld.http.gateway_upstream import (HANDOFF_HEADER, Choice, UpstreamFailed, decode_body, prefill_body,
                                          upstream_headers)
from quilld.http.prompt_blocks import family
from quilld.index.control import ControlPlane
from quilld.index.handoff import kv_key
from quilld.index.router import Decision
from quilld.model import IdentityScope

log = logging.getLogger("quilld.gateway")

POLL_FIRST, POLL_MAX = 0.0005, 0.01  # seconds between two looks at the index while the handoff waits


class EngineLegs(Protocol):
    """What a strategy asks of engines (gateway_answer.Legs; a fake one in tests)."""

    async def answer(self, req: Parsed, choice: Choice, relay: Relay) -> None:
        """The client's answer from `choice`'s engine; UpstreamFailed while no body byte reached the client."""

    async def prefill(self, req: Parsed, engine: EngineConfig, data: bytes, headers: dict[str, str]) -> dict:
        """One prefill leg: the kv_transfer_params it answered; UpstreamFailed when it failed."""


@dataclass(frozen=True)
class Serving:
    """What every strategy works with: the gateway's config, the control plane, the node (its
    cluster, once joined), the counters, the engine book, the decisions and the legs."""

    cfg: GatewayConfig
    control: ControlPlane
    node: Any
    stats: GatewayStats
    book: EngineBook
    decider: Decider
    legs: EngineLegs


class Strategy(ABC):
    """One way of serving a decision: the one small interface every way of moving KV is behind."""

    kind: ClassVar[str]

    def __init__(self, s: Serving) -> None:
        self.s = s

    @abstractmethod
    async def serve(self, req: Parsed, prompt: Prompt, choice: Choice | None, relay: Relay) -> Choice | None:
        """Serve `req` by `choice`: None once it is answered (or given up), else the choice the
        co-located strategy serves instead."""

    def _failed(self, req: Parsed, relay: Relay, engine_id: str, e: UpstreamFailed, role: str) -> None:
        """A leg the client was to get the answer of failed before its first byte: counted, said, cooled."""
        s = self.s
        s.stats.counts["upstream_errors"] += 1
        relay.failures.append(f"{engine_id}: {e.reason}")
        if e.cool:
            s.book.cool(engine_id)
        log.warning("request %s: %s %s failed before its first byte (%s)", req.request_id, role, engine_id,
                    e.reason)

    async def _give_up(self, relay: Relay, what: str) -> bool:
        """No engine left: the request is counted missed; a client whose headers went out gets its
        answer ended with why. False when nothing was sent."""
        if relay.settle():
            self.s.stats.missed()
        if relay.resp is None:
            return False
        self.s.stats.counts["unavailable"] += 1
        await relay.fail(f"no {what} could answer: " + "; ".join(relay.failures))
        return True


class Strategies:
    """The strategies, one per way of moving KV, and which one serves a decision."""

    def __init__(self, s: Serving) -> None:
        self.colocated = CoLocated(s)
        self.ways: dict[str, Disaggregated] = {}  # EngineConfig.kv_transfer -> its strategy
        for way in (ThroughPool, EngineToEngine, BothLegs):
            self.ways[way.kind] = way(s, self.ways)
        self.s = s

    def pick(self, choice: Choice | None) -> Strategy:
        """The strategy of `choice`: co-located unless it splits the request, else the way the first
        prefill engine (healthy ones first) moves KV."""
        if choice is None or not is_split(choice.decision):
            return self.colocated
        order = prefill_order(self.s.book, choice.decision)
        first = self.s.control.engines.engines.get(order[0]) if order else None
        return self.ways.get(first.kv_transfer if first is not None else "pool", self.ways["pool"])

    async def carry_out(self, req: Parsed, prompt: Prompt, choice: Choice | None, relay: Relay) -> None:
        """Serve `req` by `choice` with its strategy (the decode engine alone when no prefill engine answered)."""
        instead = await self.pick(choice).serve(req, prompt, choice, relay)
        if instead is not None:  # no prefill engine answered: the decode engine prefills too
            await self.colocated.serve(req, prompt, instead, relay)


class CoLocated(Strategy):
    """One engine prefills and decodes: the decision's, then the next decisions' while they fail."""

    kind = "co-located"

    async def serve(self, req: Parsed, prompt: Prompt, choice: Choice | None, relay: Relay) -> None:
        s = self.s
        tried: set[str] = set()
        for attempt in range(s.cfg.max_attempts):
            if attempt:
                choice = await s.decider.choose(req, prompt, tried)
            if choice is None:
                break
            tried.add(choice.engine.id)
            if attempt:
                s.stats.counts["retries"] += 1
            with s.book.lease(choice.engine.id, "request", choice.uncached_tokens) as lease:
                relay.lease = lease  # its prefill ends at the answer's first byte
                try:
                    await s.legs.answer(req, choice, relay)
                    return None
                except UpstreamFailed as e:
                    self._failed(req, relay, choice.engine.id, e, "engine")
                finally:
                    relay.lease = None
        await self._give_up(relay, "engine")
        return None


class Prefilled(NamedTuple):
    """A prefill leg that answered (or, both legs at once, was sent): what its decode legs need."""

    engine: EngineConfig
    kv: dict  # the kv_transfer_params the decode engine gets
    blocks: list[int]  # the prompt's blocks in the prefill engine's family


@dataclass
class Handover:
    """One disaggregated request's KV on its way from the engine that prefilled to a decode engine."""

    req: Parsed
    prefill: EngineConfig
    blocks: list[int]  # the prompt's blocks in the prefill engine's family
    src: str  # the node the prefill engine stores through
    pulled: dict[str, int | None] = field(default_factory=dict)  # decode node -> blocks it held after its pull

    @property
    def scope(self) -> IdentityScope:
        """The prefill engine's identity scope, the blocks' in the pool."""
        p = self.prefill
        return IdentityScope(p.tenant, p.model, p.tokenizer, self.req.adapter)


class Disaggregated(Strategy):
    """A split decision (the module's docstring): prefill leg(s), the handoff, then decode legs. The
    ways differ in how the prefill goes (`prefill`) and how its KV reaches a decode engine's node
    (`handoff` before the first decode leg, `again` before a retry on another engine)."""

    def __init__(self, s: Serving, ways: dict[str, Disaggregated]) -> None:
        super().__init__(s)
        self.ways = ways  # every way, by kv_transfer: the engine that prefilled says how its KV moves

    async def serve(self, req: Parsed, prompt: Prompt, choice: Choice, relay: Relay) -> Choice | None:
        s = self.s
        body = json.loads(req.body if choice.body is None else choice.body)  # with its cache_salt, if any
        headers = upstream_headers(relay.request.headers, req.request_id) | {"Accept-Encoding": "identity"}
        done, failures = await self.prefill(req, prompt, choice, body, headers)
        if done is None:
            s.stats.counts["prefill_fallbacks"] += 1
            return s.decider.alone(choice, "prefill_failed: " + ("; ".join(failures) or "no prefill engine left"))
        s.book.record(done.engine, prompt.tag(family(done.engine), done.blocks), done.blocks)  # it prefills them
        way = self.ways.get(done.engine.kv_transfer, self)
        src = done.engine.locality or s.control.node_id
        await self._decode(req, prompt, choice, Handover(req, done.engine, done.blocks, src), way,
                           decode_body(body, done.kv), relay)
        return None

    # -- the prefill ---------------------------------------------------------------------------------
    async def prefill(self, req: Parsed, prompt: Prompt, choice: Choice, body: dict,
                      headers: dict[str, str]) -> tuple[Prefilled | None, list[str]]:
        """Ask prefill engines in the pair's order (healthy ones first) until one answers: (what it
        answered, the failures before it); (None, failures) when none did."""
        s = self.s
        engines = s.control.engines
        data = prefill_body(body)
        failures: list[str] = []
        for engine_id in prefill_order(s.book, choice.decision)[:s.cfg.max_attempts]:
            engine = engines.engines.get(engine_id)
            if engine is None:  # removed meanwhile
                continue
            lease, blocks = await self._lease_prefill(prompt, choice.decision, engine)
            try:
                kv = await s.legs.prefill(req, engine, data, headers)
            except UpstreamFailed as e:
                failures.append(f"{engine_id}: {e.reason}")
                self._prefill_failed(req, engine, e)
                continue
            finally:
                s.book.give_back(lease)
            s.book.answered(engine_id)
            return Prefilled(engine, kv, blocks), failures
        return None, failures

    async def _lease_prefill(self, prompt: Prompt, d: Decision, engine: EngineConfig) -> tuple[str, list[int]]:
        """A prefill by `engine` begins: counted, and leased for the prompt's tokens it cannot reuse;
        (the lease, the prompt's blocks in its family's hashes)."""
        s = self.s
        s.stats.counts["prefills"] += 1
        fam = family(engine)
        blocks = await prompt.blocks(fam)
        return s.book.take(engine.id, "prefill", uncached_tokens(d, engine.id, len(blocks),
                                                                 prompt.tokens_per_block(fam))), blocks

    def _prefill_failed(self, req: Parsed, engine: EngineConfig, e: BaseException, how: str = "") -> None:
        """A prefill engine failed: counted, cooled down when the failure says so, logged."""
        self.s.stats.counts["prefill_failures"] += 1
        if isinstance(e, UpstreamFailed) and e.cool:
            self.s.book.cool(engine.id)
        log.warning("request %s: prefill engine %s failed (%s)%s", req.request_id, engine.id,
                    getattr(e, "reason", None) or repr(e), how)

    # -- the handoff -----------------------------------------------------------------------------------
    @abstractmethod
    async def handoff(self, h: Handover, dst: str) -> str:
        """Before the first decode leg, on node `dst`: the KV on its way; the handoff header's text."""

    async def again(self, h: Handover, dst: str) -> None:
        """Before a decode leg on another engine, on node `dst`, after one failed."""

    # -- the decode ------------------------------------------------------------------------------------
    async def _decode(self, req: Parsed, prompt: Prompt, choice: Choice, h: Handover, way: Disaggregated,
                      data: bytes, relay: Relay) -> None:
        """The handoff, then decode engines in the pair's order until one answers."""
        s, d = self.s, choice.decision
        engines, counts = s.control.engines, s.stats.counts
        order = s.book.healthy_first(e for e in d.pair.decode_order if e != h.prefill.id)
        attempts, handoff = 0, ""
        for engine_id in order:
            engine = engines.engines.get(engine_id)
            if engine is None:
                continue
            if attempts >= s.cfg.max_attempts:
                break
            dst = engine.locality or s.control.node_id
            if attempts:
                counts["decode_retries"] += 1
                await way.again(h, dst)
            else:
                handoff = await way.handoff(h, dst)
            attempts += 1
            fam = family(engine)
            blocks = await prompt.blocks(fam)
            pull = h.pulled.get(dst)
            attempt = Choice(engine, decode_decision(d, engine, h.prefill, dst), prompt.tag(fam, blocks), blocks, 0,
                             data, {HANDOFF_HEADER: handoff + f" prefetched={'-' if pull is None else pull}"})
            with s.book.lease(engine_id, "decode"):
                try:
                    await s.legs.answer(req, attempt, relay)
                    counts["disaggregated"] += 1
                    return
                except UpstreamFailed as e:
                    self._failed(req, relay, engine_id, e, "decode engine")
        if not await self._give_up(relay, "decode engine") and not attempts:
            relay.failures.append("no decode engine left")


class ThroughPool(Disaggregated):
    """The prefill engine's connector writes the pool; the decode engine's reads it (the handoff waits)."""

    kind = "pool"

    async def handoff(self, h: Handover, dst: str) -> str:
        """Wait (gateway.handoff_wait_ms at most) until the prompt's blocks are in the pool, pulling them
        to `dst` meanwhile when it is not the prefill's node; the handoff header's text."""
        s = self.s
        control, counts, blocks, src = s.control, s.stats.counts, h.blocks, h.src
        tag = control.engine_tag(h.prefill.id, h.req.adapter or None)
        wait = s.cfg.handoff_wait_ms / 1000
        t0 = time.perf_counter()
        pull = asyncio.ensure_future(self._pull(dst, h.scope, blocks)) if dst != src and blocks else None
        cluster = s.node.cluster

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
                h.pulled[dst] = await pull
        finally:
            if pull is not None and not pull.done():  # the client went away meanwhile
                pull.cancel()
        waited = time.perf_counter() - t0
        s.stats.handoff.observe(waited)
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

    async def again(self, h: Handover, dst: str) -> None:
        """The next decode engine's node pulls the blocks first when it is another (once a node)."""
        if dst != h.src and dst not in h.pulled:
            h.pulled[dst] = await self._pull(dst, h.scope, h.blocks)

    async def _pull(self, dst: str, scope: IdentityScope, blocks: list[int]) -> int:
        """Ask node `dst` to pull the prompt's blocks now (cluster/prefetch.py); the blocks it holds then."""
        s = self.s
        counts = s.stats.counts
        counts["prefetches"] += 1
        got = await prefetch(s.node.cluster, dst, scope, [kv_key(h) for h in blocks], s.cfg.handoff_wait_ms / 1000)
        counts["prefetch_blocks"] += got
        return got


class EngineToEngine(Disaggregated):
    """vLLM's NixlConnector (P2P): the decode engine reads the prefill's KV from it; no wait, no pull."""

    kind = "nixl"
    how = ""  # what the handoff header adds about the legs

    async def handoff(self, h: Handover, dst: str) -> str:
        self.s.stats.counts["handoff_direct"] += 1
        return (f"kv_transfer={h.prefill.kv_transfer} engine-to-engine{self.how} "
                f"blocks={len(h.blocks)} waited_ms=0 from={h.prefill.id}")


class BothLegs(EngineToEngine):
    """vLLM's MooncakeConnector: the prefill and the decode legs at once, tied by one transfer_id; the
    decode engine pulls the prefill's KV through the prefill's bootstrap server while it computes it.
    The prefill leg runs on in the background (its lease held until it answers); a prefill that fails
    is counted and cools down, the decode engine recomputes what it lacks."""

    kind = "mooncake"
    how = " both-legs-at-once"

    def __init__(self, s: Serving, ways: dict[str, Disaggregated]) -> None:
        super().__init__(s, ways)
        self._legs: set[asyncio.Task] = set()  # prefill legs still running beside their decode

    async def prefill(self, req: Parsed, prompt: Prompt, choice: Choice, body: dict,
                      headers: dict[str, str]) -> tuple[Prefilled | None, list[str]]:
        s = self.s
        order = prefill_order(s.book, choice.decision)
        engine = s.control.engines.engines.get(order[0]) if order else None
        if engine is None:  # removed meanwhile: the prefills in turn, as the other ways
            return await super().prefill(req, prompt, choice, body, headers)
        transfer_id = f"{req.request_id}-{secrets.token_hex(8)}"
        lease, blocks = await self._lease_prefill(prompt, choice.decision, engine)
        leg = asyncio.ensure_future(s.legs.prefill(req, engine, prefill_body(body, {"transfer_id": transfer_id}),
                                                   headers))
        self._legs.add(leg)

        def prefilled(task: asyncio.Task) -> None:
            self._legs.discard(task)
            s.book.give_back(lease)
            e = asyncio.CancelledError("cancelled") if task.cancelled() else task.exception()
            if e is not None:
                self._prefill_failed(req, engine, e, " while its decode ran (mooncake)")
            else:
                s.book.answered(engine.id)

        leg.add_done_callback(prefilled)
        kv = {"remote_engine_id": engine.kv_engine_id, "remote_bootstrap_addr": bootstrap_addr(engine),
              "transfer_id": transfer_id}
        return Prefilled(engine, kv, blocks), []


def prefill_order(book: EngineBook, d: Decision) -> list[str]:
    """The pair's prefill candidates but its decode engine, healthy ones first."""
    pair = d.pair
    return book.healthy_first(e for e in pair.prefill_order if e != pair.decode)


def bootstrap_addr(engine: EngineConfig) -> str:
    """The engine's Mooncake bootstrap server: kv_bootstrap, else its url's host on vLLM's default port."""
    if engine.kv_bootstrap:
        return engine.kv_bootstrap
    host = URL(engine.url).host or "127.0.0.1"
    return f"[{host}]:{MOONCAKE_BOOTSTRAP_PORT}" if ":" in host else f"{host}:{MOONCAKE_BOOTSTRAP_PORT}"
