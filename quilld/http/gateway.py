"""OpenAI-compatible gateway: routes each request to the cache-hottest engine and streams it through.

Routes (one table, ROUTES): POST /v1/chat/completions and /v1/completions,
GET /v1/models (the union of the engines' models) and /v1/models/{model}, and
GET /v1/quillcache/stats (`Gateway.info()` as JSON). Errors are OpenAI-shaped
(quilld/http/gateway_request.py).

Per request: the API key gives the tenant, the model picks the engines, the
prompt becomes block hashes (quilld/http/prompt_blocks.py), the router scores
the engines, and the chosen one is asked with one pooled aiohttp session. The
`x-quillcache-*` decision headers go out with the engine's status and headers,
before the first body byte; the body is relayed chunk by chunk (SSE events
whole, so a failure never leaves half an event).

Identity. The tenant is the user whose password is the bearer API key (when
quilld has users; `default` otherwise). A request for `base:adapter`, where no
engine serves a model of that exact name, is a request for LoRA `adapter` on
the engines of `base`: it is sent to them with `"model": "adapter"` (vLLM
serves a LoRA under its own name). The scope of its blocks is
(tenant, engine model, engine tokenizer, adapter) — the same as
`ControlPlane.engine_tag` gives the engine's own KV events whenever the tenant
is the engine's `tenant`, so the gateway's lookups, the residencies it records
and the engine's events meet in one scope, and a repeated prefix is a hit
either way. Another tenant's requests look in their own scope: they get no
credit for prefixes someone else sent, so the overlap header never tells them
what others asked.

Load and failures. The engine's in-flight count is taken before the upstream
call and given back when the request ends, however it ends. An engine that
refuses, resets, answers 5xx/429 or sends no byte within
`first_byte_timeout_ms` cools down for `ENGINE_COOLDOWN` seconds (it is tried
only when no other engine is left) and the request moves to the next-best
engine, up to `max_attempts`. That holds until the first body byte reached the
client; if the engine had already answered headers, they (and the decision
headers naming it) were sent, and the body comes from the next engine. After a
body byte, a failure (or a silence longer than `first_byte_timeout_ms` between
chunks) ends an SSE stream with `data: {"error": ...}` and closes the
connection (a plain body is cut short by closing it). A client that goes away
cancels the handler, which closes the upstream response: the engine sees the
request go.

Sessions. `x-quillcache-session` keeps a conversation on the engine its last
request went to (the control plane's `SessionAffinity`, shared with ROUTE's
`session`): per tenant, at most `gateway.session_max` of them, each forgotten
`gateway.session_idle_s` after its last use; an id over 256 bytes is a 400.

Residency. When the engine's first body byte of a 2xx answer arrives, it has
prefilled the prompt: the prompt's blocks are recorded as in that engine's
HBM, unless the engine publishes KV events (they stay the authority).

Roles. With prefill and decode engines (EngineConfig.role), a prefill engine never
answers a client itself, and a decision that pairs two engines is served as
vLLM's disaggregated-serving proxy serves it, with a handoff checked in the pool
(gateway_disagg.py); a decision for one engine is served as above. A model whose
engines are all prefill engines is a 503 (`no_decode_engine`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
import time
from collections import OrderedDict, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import Histogram
from yarl import URL

from quilld.config import EngineConfig
from quilld.http.gateway_disagg import Disaggregation
from quilld.http.gateway_relay import Relay
from quilld.http.gateway_request import (CHAT, COMPLETIONS, ApiError, Parsed, bad_request, decode_tokens, drop_owned,
                                        prompt_of, read_body)
from quilld.http.gateway_stats import GatewayStats
from quilld.http.gateway_upstream import (REQUEST_ID_HEADER, Choice, UpstreamFailed, answer_ok, decision_headers,
                                          describe, engine_headers, upstream_headers, upstream_url)
from quilld.context.listeners import http_budget, soft_nofile
from quilld.http.listener import Listener
from quilld.http.perimeter import from_this_origin, loopback_only
from quilld.index.engine_prompts import EngineBlocks, NotCovered, caller_salt
from quilld.http.prompt_blocks import Family, PromptHasher, TokenizerUnavailable, family
from quilld.index.affinity import SessionIdTooLong, check_session_id
from quilld.index.pairing import NoDecodeEngine
from quilld.index.router import Candidate, Decision
from quilld.model import IdentityScope
from quilld.scopes import NO_SCOPE, ScopeLimit

log = logging.getLogger("quilld.gateway")

ENGINE_COOLDOWN = 3.0  # seconds a failed engine is passed over while others are left
MAX_BODY = 64 * 1024 * 1024  # largest request body (long prompts, inline images)
UPSTREAM_KEEPALIVE = 4.0  # below uvicorn's 5 s, so a pooled connection is never one the engine is closing
SHUTDOWN_TIMEOUT = 2.0  # seconds open streams get at shutdown before they are cancelled
WATCHDOG_TICKS = 8  # byte deadlines are checked this often per first_byte_timeout_ms (at least once a second)
SLO_HEADER = "x-quillcache-ttft-slo-ms"
SESSION_HEADER = "x-quillcache-session"


class Gateway:
    def __init__(self, node: Any, ttft: Histogram | None = None, handoff: Histogram | None = None) -> None:
        """`ttft`, `handoff`: the node's TTFT and handoff-wait histograms (metrics.py)."""
        self.node = node
        self.cfg = node.cfg.gateway
        self.control = node.control
        self.hasher = PromptHasher(self.cfg.chunk_chars)
        self.engine_prompts = node.control.engine_prompts  # engines' own block hashes (engine_prompts.py)
        self._fallback_said: set = set()  # engine families whose first fallback was logged
        self.stats = GatewayStats(ttft, handoff)
        self.disaggregation = Disaggregation(self)
        self.cooling: dict[str, float] = {}  # engine id -> monotonic time its cooldown ends
        self._urls: dict[tuple[str, str], URL] = {}  # (engine base URL, path) -> parsed upstream URL
        self._rid_prefix = secrets.token_hex(4)  # request ids: this run's prefix + a counter
        self._rid = itertools.count(1)
        self.session: aiohttp.ClientSession | None = None
        self._listener: Listener | None = None
        self._handlers: set[asyncio.Task] = set()  # completion requests being served
        self._reading: dict[Relay, aiohttp.ClientResponse] = {}  # answers being relayed, for the watchdog
        self._leases: set[str] = set()  # in-flight leases, renewed so a long stream keeps counting
        self._recorded: dict[str, OrderedDict] = {}  # engine -> (tag, block hash) it recorded, oldest first
        self._watch_task: asyncio.Task | None = None

    # -- lifecycle ----------------------------------------------------------------
    async def start(self, host: str, port: int) -> int:
        c = self.cfg
        cap = http_budget(self.node.cfg, soft_nofile()).gateway
        if cap < c.max_connections:
            log.warning("gateway: at most %d connections (gateway.max_connections is %d): the HTTP listeners "
                        "hold at most a quarter of the descriptor limit", cap, c.max_connections)
        self.session = aiohttp.ClientSession(  # at most as many connections to engines as from clients
            connector=aiohttp.TCPConnector(limit=cap, keepalive_timeout=UPSTREAM_KEEPALIVE),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=c.connect_timeout_ms / 1000),
            auto_decompress=False, skip_auto_headers=("User-Agent",), cookie_jar=aiohttp.DummyCookieJar())
        self._listener = Listener("gateway", "gateway", build_app(self), self.node.listeners["gateway"], cap,
                                  c.header_timeout_ms / 1000, c.body_timeout_ms / 1000, _answer,
                                  handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT)
        self._watch_task = asyncio.create_task(self._watchdog(), name="gateway-watchdog")
        bound = await self._listener.start(host, port)
        log.info("OpenAI-compatible gateway on %s:%d", host, bound)
        return bound

    async def stop(self) -> None:
        """Stop accepting, give open requests SHUTDOWN_TIMEOUT to end, cancel the rest, close the pool."""
        if self._listener is not None:
            await self._listener.stop_accepting()
        if self._handlers:
            _, late = await asyncio.wait(set(self._handlers), timeout=SHUTDOWN_TIMEOUT)
            for task in late:  # each closes its engine response and gives its engine's load back
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        if self._listener is not None:
            await self._listener.stop()
            self._listener = None
        if self._watch_task is not None:
            self._watch_task.cancel()
            await asyncio.gather(self._watch_task, return_exceptions=True)
            self._watch_task = None
        if self.session is not None:
            await self.session.close()
            self.session = None

    def info(self) -> list[tuple[str, int | float | str]]:
        now = time.monotonic()
        return self.stats.info(self.cfg.ttft_slo_ms, sum(1 for t in self.cooling.values() if t > now))

    # -- identity and parsing -------------------------------------------------------
    def tenant(self, request: web.Request) -> str:
        users = self.node.users
        if not users.required:
            return "default"
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "You didn't provide an API key: send `Authorization: Bearer <key>`.",
                           "invalid_request_error", "invalid_api_key", counter="unauthorized")
        user = users.user_for_token(key)
        if user is None:
            self.node.stats["auth_failures"] += 1
            raise ApiError(401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key",
                           counter="unauthorized")
        return user

    def resolve_model(self, model: str) -> tuple[str, str]:
        """(engines' model, adapter) for a requested model name; 404 when no engine serves it."""
        engines = self.control.engines
        if engines.for_model(model):
            return model, ""
        base, sep, adapter = model.rpartition(":")
        if sep and base and adapter and engines.for_model(base):
            return base, adapter
        raise ApiError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model_not_found",
                       "model", "unknown_model")

    async def parse(self, request: web.Request, path: str, t0: float) -> Parsed:
        tenant = self.tenant(request)
        slo_ms = float(self.cfg.ttft_slo_ms)
        if SLO_HEADER in request.headers:
            try:
                slo_ms = float(request.headers[SLO_HEADER])
            except ValueError:
                slo_ms = -1.0
            if not 0 < slo_ms < float("inf"):
                raise bad_request(f"{SLO_HEADER} must be a positive number of milliseconds")
        raw = await request.read()
        body = read_body(raw)
        base, adapter = self.resolve_model(body["model"])
        prompt = prompt_of(path, body)
        dropped = drop_owned(body)  # every engine request is built from this body: none carries them
        if dropped:
            self.stats.dropped(dropped, tenant)
        if adapter or dropped:
            raw = json.dumps(dict(body, model=adapter or body["model"])).encode()
        session = request.headers.get(SESSION_HEADER) or None
        if session is not None:  # kept per tenant by the control plane: tenants' sessions never meet
            try:
                check_session_id(session)
            except SessionIdTooLong as e:
                raise bad_request(f"{SESSION_HEADER}: {e.message}", SESSION_HEADER, "session_id_too_long") from None
        return Parsed(path, raw, base, adapter, tenant, prompt, decode_tokens(body), slo_ms, t0,
                      f"{self._rid_prefix}{next(self._rid) & 0xFFFFFFFF:08x}", session, body)

    # -- routing ----------------------------------------------------------------
    def _cool(self, engine_id: str) -> None:
        self.cooling[engine_id] = time.monotonic() + ENGINE_COOLDOWN

    def scope_tag(self, req: Parsed, fam: Family, blocks: list[int]) -> tuple[IdentityScope, bytes]:
        """The request's identity for engines of family `fam`, and the scope tag its `blocks` are
        looked up and recorded under: the engines' own scope for their own hashes (a request of
        another identity is salted, engine_prompts.py), else the request's."""
        scope = IdentityScope(req.tenant, req.model, fam.tokenizer, req.adapter)
        if isinstance(blocks, EngineBlocks):  # where the engines' KV events record them
            return scope, self.node.scopes.tag(IdentityScope(fam.tenant, req.model, fam.tokenizer, req.adapter))
        try:
            return scope, self.node.scopes.tag(scope, capped=True)
        except ScopeLimit:  # over the tenant's cap: routed without this scope's cache, nothing recorded
            return scope, self.node.scopes.find(scope)

    async def prompt_blocks(self, req: Parsed, fam: Family, hashes: dict[Family, list[int]]) -> list[int]:
        blocks = hashes.get(fam)
        if blocks is None:
            if fam.hashing is not None:
                blocks = await self._engine_blocks(req, fam)
            if blocks is None:
                blocks = await self.hasher.blocks(req.prompt, fam)
            hashes[fam] = blocks
        return blocks

    async def _engine_blocks(self, req: Parsed, fam: Family) -> EngineBlocks | None:
        """The prompt in the engines' own block hashes, computed off the loop; None when not covered."""
        salt = caller_salt(self.node.salt_key, fam.tenant, IdentityScope(req.tenant, req.model, "", req.adapter),
                           fam.tokenizer)
        try:
            blocks = await asyncio.to_thread(self.engine_prompts.hashes, fam.hashing, req.path == CHAT,
                                             req.fields, salt, req.adapter)
        except NotCovered as e:
            self.stats.counts["engine_hash_fallbacks"] += 1
            if fam.hashing not in self._fallback_said:
                self._fallback_said.add(fam.hashing)
                log.warning("gateway: %s: routing on quilld's own prompt hashes instead of the engine's (%s); "
                            "said once per engine family", fam.tokenizer, e.message)
            return None
        self.stats.counts["engine_hashed"] += 1
        return blocks

    def salted_body(self, req: Parsed, blocks: list[int]) -> bytes | None:
        """The body sent to an engine for `blocks`: the request's with their cache_salt; None: as it is."""
        salt = getattr(blocks, "salt", None)
        if salt is None:
            return None
        body = json.loads(req.body)
        body["cache_salt"] = salt
        return json.dumps(body).encode()

    async def choose(self, req: Parsed, tried: set[str], hashes: dict[Family, list[int]]) -> Choice | None:
        """The next engine to try: healthy before cooling, the router's pick, then by cost. Prefill
        engines (role prefill) never answer a request themselves; a model with only those is a 503."""
        groups: dict[Family, set[str]] = defaultdict(set)
        served = self.control.engines.for_model(req.model)
        for e in served:
            if e.id not in tried and e.role != "prefill":
                groups[family(e)].add(e.id)
        if served and all(e.role == "prefill" for e in served):
            raise ApiError(503, NoDecodeEngine(req.model).message, "service_unavailable", "no_decode_engine",
                           counter="unavailable")
        now = time.monotonic()
        best: tuple | None = None
        for fam, ids in groups.items():
            blocks = await self.prompt_blocks(req, fam, hashes)
            scope, tag = self.scope_tag(req, fam, blocks)
            per_block = self.hasher.tokens_per_block(fam)
            cluster = self.node.cluster  # in a cluster, the blocks' residencies from the directory's owners
            view = None if cluster is None else await cluster.route_view(tag, blocks)
            d = self.control.route(scope, tag, blocks, req.decode_tokens / per_block,
                                   session=None if tried else req.session,  # a retry may leave it
                                   block_tokens=per_block, view=view)
            split = not tried and d.pair is not None and d.pair.prefill is not None  # gateway_disagg.py orders
            for c in d.candidates:                                                    # its engines itself
                if c.engine not in ids:
                    continue
                cooling = self.cooling.get(c.engine, 0.0) > now and not (split and c.engine == d.engine)
                key = (cooling, c.engine != d.engine, c.cost, c.engine)
                if best is None or key < best[0]:
                    best = (key, c, d, tag, blocks, per_block, view)
        if best is None:
            return None
        _, c, d, tag, blocks, per_block, view = best
        engine = self.control.engines.get(c.engine)
        if c.engine != d.engine:  # not the router's pick (it failed or cools down)
            d = self._decision_for(engine, c, d, tag, blocks, view)
        uncached = int(round(max(0.0, len(blocks) - c.credit) * per_block))
        return Choice(engine, d, tag, blocks, uncached, self.salted_body(req, blocks))

    def _decision_for(self, engine: EngineConfig, c: Candidate, d: Decision, tag: bytes,
                      blocks: list[int], view=None) -> Decision:
        """Decision `d` with `engine` (its candidate `c`) chosen instead: `c`'s cost and the engine's own plan
        (and, with roles, the engine alone: it prefills and decodes)."""
        pair = None if d.pair is None else replace(d.pair, decode=engine.id, prefill=None, prefill_url=None,
                                                   prefill_lease=None)
        return Decision(engine.id, c.cost, d.candidates, self.control.plan_for(engine.id, tag, blocks, view),
                        engine.url, None, pair)

    def _record(self, choice: Choice) -> None:
        """The engine prefilled the prompt (or loaded its KV): its blocks are in that engine's HBM now."""
        self.record(choice.engine, choice.tag, choice.blocks)

    def record(self, engine: EngineConfig, tag: bytes, blocks: list[int]) -> None:
        """`engine` holds the prompt's `blocks` (of scope `tag`) in its HBM now."""
        if engine.kv_events or self.control.engines.engines.get(engine.id) is not engine:
            return  # its events are the authority, or it was removed or replaced meanwhile
        if tag == NO_SCOPE:
            return
        control, engine_id = self.control, engine.id
        self.stats.counts["residencies_recorded"] += control.record(engine_id, tag, blocks)
        # a bounded LRU of what was recorded: the engine evicts too, and nothing says what
        recorded = self._recorded.setdefault(engine_id, OrderedDict())
        for h in reversed(blocks):  # leading blocks last: a prefix is forgotten from its tail
            recorded[(tag, h)] = None
            recorded.move_to_end((tag, h))
        while len(recorded) > self.cfg.recorded_blocks:
            (old_tag, old_h), _ = recorded.popitem(last=False)
            control.unrecord(engine_id, old_tag, old_h)
            self.stats.counts["residencies_forgotten"] += 1

    # -- the request --------------------------------------------------------------
    async def completion(self, request: web.Request, path: str) -> web.StreamResponse:
        t0 = time.perf_counter()
        counts = self.stats.counts
        counts["requests"] += 1
        try:
            req = await self.parse(request, path, t0)
        except ApiError as e:
            counts[e.counter] += 1
            return e.response()
        relay = Relay(request)
        self.stats.in_flight += 1
        task = asyncio.current_task()
        self._handlers.add(task)
        try:
            await self._relay(req, relay)
        except ApiError as e:  # nothing was sent: no engine can answer this request
            counts[e.counter] += 1
            self._settle_missed(relay)
            return e.response({REQUEST_ID_HEADER: req.request_id})
        except TokenizerUnavailable as e:
            log.error("%s", e)
            self._settle_missed(relay)
            if relay.resp is not None:  # an earlier attempt's headers went out
                await relay.fail(str(e))
                return relay.resp
            return ApiError(500, str(e), "server_error", "tokenizer_unavailable").response(
                {REQUEST_ID_HEADER: req.request_id})
        except (asyncio.CancelledError, ConnectionResetError):
            counts["client_disconnects"] += 1
            if (time.perf_counter() - t0) * 1000 > req.slo_ms:
                self._settle_missed(relay)
            raise
        finally:
            self.stats.in_flight -= 1
            self._handlers.discard(task)
        if relay.resp is None:
            counts["unavailable"] += 1
            why = "; ".join(relay.failures) or "no engine left to try"
            return ApiError(503, f"No healthy engine for model `{req.model}`: {why}", "service_unavailable",
                            "no_healthy_engine").response({REQUEST_ID_HEADER: req.request_id})
        return relay.resp

    def _settle_missed(self, relay: Relay) -> None:
        if not relay.settled:
            relay.settled = True
            self.stats.missed()

    async def _relay(self, req: Parsed, relay: Relay) -> None:
        """Try engines, best first, until one answers or the attempts run out."""
        counts = self.stats.counts
        engines = self.control.engines
        tried: set[str] = set()
        hashes: dict[Family, list[int]] = {}
        for attempt in range(self.cfg.max_attempts):
            choice = await self.choose(req, tried, hashes)
            if choice is None:
                break
            pair = choice.decision.pair
            if not tried and pair is not None and pair.prefill is not None:  # a prefill engine, then this one
                choice = await self.disaggregation.serve(req, choice, relay, hashes, tried)
                if choice is None:
                    return
            tried.add(choice.engine.id)
            if attempt:
                counts["retries"] += 1
            lease = relay.lease = engines.acquire(choice.engine.id, "request", choice.uncached_tokens)
            self._leases.add(lease)
            try:
                await self._attempt(req, choice, relay)
                return
            except UpstreamFailed as e:
                counts["upstream_errors"] += 1
                relay.failures.append(f"{choice.engine.id}: {e.reason}")
                if e.cool:
                    self._cool(choice.engine.id)
                log.warning("request %s: engine %s failed before its first byte (%s)", req.request_id,
                            choice.engine.id, e.reason)
            finally:
                self._leases.discard(lease)
                engines.release(lease)
                relay.lease = None
        self._settle_missed(relay)
        if relay.resp is not None:  # headers went out with an engine that failed before its first byte
            counts["unavailable"] += 1
            await relay.fail("no engine could answer: " + "; ".join(relay.failures))

    async def _attempt(self, req: Parsed, choice: Choice, relay: Relay) -> None:
        """Ask one engine and relay its answer; UpstreamFailed while nothing reached the client's body."""
        deadline = asyncio.get_running_loop().time() + self.cfg.first_byte_timeout_ms / 1000
        upstream = await self._ask(req, choice, relay, deadline)
        try:
            ok = await self._answer(req, choice, relay, upstream)
            if await self._stream(req, choice, relay, upstream, ok, deadline):
                await self._finish(req, choice, relay, ok)
        finally:
            self._reading.pop(relay, None)
            _let_go(upstream)

    async def _ask(self, req: Parsed, choice: Choice, relay: Relay, deadline: float) -> aiohttp.ClientResponse:
        """Send the request to the engine; its status and headers are due by `deadline` (loop time)."""
        headers = engine_headers(upstream_headers(relay.request.headers, req.request_id), choice.engine)
        try:
            async with asyncio.timeout_at(deadline):
                return await self.session.post(self._url(choice.engine.url, req.path),
                                               data=req.body if choice.body is None else choice.body, headers=headers)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise UpstreamFailed(describe(e)) from None

    async def _answer(self, req: Parsed, choice: Choice, relay: Relay, upstream: aiohttp.ClientResponse) -> bool:
        """Judge the engine's status and, for the first answer, send the client its status and headers
        with the decision's; True for a 2xx."""
        ok = answer_ok(upstream.status, relay.resp is not None)
        if relay.resp is None:
            headers = decision_headers(choice.decision, req.request_id, choice.fallback)
            await relay.prepare(upstream, headers | choice.headers if choice.headers else headers)
            if not ok:  # the engine refused the request itself: relayed as is, not counted for goodput
                self.stats.counts["upstream_client_errors"] += 1
                relay.settled = True
        return ok

    async def _stream(self, req: Parsed, choice: Choice, relay: Relay, upstream: aiohttp.ClientResponse, ok: bool,
                      deadline: float) -> bool:
        """Relay the engine's body as it comes, each wait bounded by the watchdog.

        False when the engine broke off after bytes reached the client (the client's answer is ended).
        """
        content, loop = upstream.content, asyncio.get_running_loop()
        limit = self.cfg.first_byte_timeout_ms / 1000
        relay.stalled, relay.pending = False, b""  # nothing of an earlier attempt carries over
        self._reading[relay] = upstream  # the watchdog bounds each wait for the engine's bytes
        while True:
            relay.deadline = loop.time() + limit if relay.started else deadline
            try:
                chunk = await content.readany()
            except (aiohttp.ClientError, OSError) as e:
                chunk, error = b"", describe(e)
            else:
                error = ""
            relay.deadline = 0.0
            if relay.stalled or error:
                why = f"no byte for {self.cfg.first_byte_timeout_ms} ms" if relay.stalled else error
                if not relay.started:
                    raise UpstreamFailed(why)
                await self._broken(req, choice, relay, why)
                return False
            if not chunk:
                return True
            if await relay.forward(chunk):
                self._first_byte(req, choice, ok, relay)

    async def _finish(self, req: Parsed, choice: Choice, relay: Relay, ok: bool) -> None:
        """The engine's answer ended: its held-back tail goes out, then the end of the client's body."""
        if await relay.flush():
            self._first_byte(req, choice, ok, relay)
        if not relay.started and ok:
            raise UpstreamFailed("the answer ended before its first byte")
        await relay.resp.write_eof()
        if ok:
            self.stats.counts["completed"] += 1

    async def _broken(self, req: Parsed, choice: Choice, relay: Relay, why: str) -> None:
        self.stats.counts["stream_errors"] += 1
        log.warning("request %s: engine %s failed mid-answer (%s)", req.request_id, choice.engine.id, why)
        await relay.fail(f"engine {choice.engine.id} failed mid-answer: {why}")

    async def _watchdog(self) -> None:
        """Close the engine response of every relay whose engine missed its byte deadline.

        The first body byte is due first_byte_timeout_ms after the request was
        sent, each later chunk first_byte_timeout_ms after the one before. One
        timer for all streams, checked WATCHDOG_TICK times a timeout (at least
        once a second), instead of a timer per chunk read.
        """
        loop = asyncio.get_running_loop()
        tick = min(1.0, self.cfg.first_byte_timeout_ms / 1000 / WATCHDOG_TICKS)
        renew = self.control.engines.renew
        while True:
            await asyncio.sleep(tick)
            for lease in self._leases:
                renew(lease)
            now = loop.time()
            for relay, upstream in list(self._reading.items()):
                if relay.deadline and now > relay.deadline:
                    relay.stalled = True
                    upstream.close()

    def _url(self, base: str, path: str) -> URL:
        url = self._urls.get((base, path))
        if url is None:
            if len(self._urls) > 1024:  # engines come and go: never let it grow without bound
                self._urls.clear()
            url = self._urls[(base, path)] = URL(upstream_url(base, path))
        return url

    def _first_byte(self, req: Parsed, choice: Choice, ok: bool, relay: Relay) -> None:
        if not ok:
            return
        self.stats.first_byte((time.perf_counter() - req.t0) * 1000, req.slo_ms)
        relay.settled = True
        self.cooling.pop(choice.engine.id, None)  # tried as a last resort and it answered: healthy again
        if relay.lease is not None:
            self.control.engines.prefilled(relay.lease)  # its prefill is done: no longer queued prefill work
        self._record(choice)

    # -- the other endpoints: their answers once the API key is checked -----------------
    def models(self, request: web.Request) -> web.Response:
        names = sorted({e.model for e in self.control.engines.engines.values()})
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "quillcache"} for name in names]})

    def model(self, request: web.Request) -> web.Response:
        base, adapter = self.resolve_model(request.match_info["model"])
        return web.json_response({"id": request.match_info["model"], "object": "model", "created": 0,
                                  "owned_by": "quillcache", **({"parent": base} if adapter else {})})

    def own_stats(self, request: web.Request) -> web.Response:
        return web.json_response(dict(self.info()))


def _let_go(upstream: aiohttp.ClientResponse) -> None:
    """Return a read answer's connection to the pool; one cancelled or failed mid-body is dropped
    instead, so the engine sees the request go."""
    if upstream.content.at_eof():
        upstream.release()
    else:
        upstream.close()


GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)


async def completion(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions and /v1/completions: the route's path says which."""
    return await request.app[GATEWAY].completion(request, request.match_info.route.resource.canonical)


def authorized(answer: Callable[[Gateway, web.Request], web.Response]) \
        -> Callable[[web.Request], Awaitable[web.Response]]:
    """A handler answering with `answer` once the API key is checked; an ApiError is the answer otherwise."""

    async def handler(request: web.Request) -> web.Response:
        gateway = request.app[GATEWAY]
        try:
            gateway.tenant(request)
            return answer(gateway, request)
        except ApiError as e:
            gateway.stats.counts[e.counter] += 1
            return e.response()

    return handler


async def not_found(request: web.Request) -> web.Response:
    return ApiError(404, f"Unknown request URL: {request.method} {request.path}.", "invalid_request_error",
                    "unknown_url").response()


ROUTES = [
    ("POST", CHAT, completion),
    ("POST", COMPLETIONS, completion),
    ("GET", "/v1/models", authorized(Gateway.models)),
    ("GET", "/v1/models/{model:.+}", authorized(Gateway.model)),
    ("GET", "/v1/quillcache/stats", authorized(Gateway.own_stats)),
    ("*", "/{tail:.*}", not_found),
]


def _refused(message: str) -> web.Response:
    return ApiError(403, message, "permission_error", "protected_mode").response()


def _answer(status: int, message: str, code: str) -> web.Response:
    """The gateway's own error response (listener.py's refusals), OpenAI-shaped."""
    return ApiError(status, message, "invalid_request_error", code).response()


def build_app(gateway: Gateway) -> web.Application:
    node = gateway.node
    # protected mode: with no password, loopback peers only (the gateway's port follows the RESP port's rule);
    # with no password, nothing a web page elsewhere made a browser send (perimeter.py)
    figures = node.listeners["gateway"]
    app = web.Application(client_max_size=MAX_BODY, middlewares=[
        loopback_only(node.cfg.server, lambda: node.users.required, _refused, figures),
        from_this_origin(node.cfg.server, figures, _answer, credential=lambda: node.users.required,
                         json_writes=False)])
    app[GATEWAY] = gateway
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
    return app
