"""OpenAI-compatible gateway: routes each request to the cache-hottest engine and streams it through.

Routes (one table, ROUTES): POST /v1/chat/completions and /v1/completions,
GET /v1/models (the union of the engines' models) and /v1/models/{model}, and
GET /v1/quillcache/stats (`Gateway.info()` as JSON). Errors are OpenAI-shaped
(quilld/http/gateway_request.py).

A request is one pipeline, one stage a module, each testable alone (`Gateway.completion`):

1. parse (gateway_request.py): the API key gives the tenant, the model picks the
   engines, the body is checked;
2. the engine family's tokens and hashes (gateway_prompt.py): the prompt as each
   family of engines hashes it, computed when a stage first asks for that family;
3. the decision (gateway_decide.py): the router scores the engines, the best healthy
   one (or a pair of a prefill and a decode engine) is chosen;
4. one relay strategy per way of moving KV, behind one small interface
   (gateway_strategy.py): co-located, through the pool, engine to engine (NIXL),
   both legs at once (Mooncake);
5. the answer and its headers (gateway_answer.py, gateway_relay.py): each engine leg
   over one pooled aiohttp session; the `x-quillcache-*` decision headers
   (gateway_upstream.py) go out with the engine's status and headers, before the
   first body byte; the body is relayed chunk by chunk (SSE events whole, so a
   failure never leaves half an event).

What the gateway keeps of engines between requests (cooldowns, leases, the blocks it
recorded) is gateway_engines.py's.

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
`first_byte_timeout_ms` cools down for `gateway_engines.ENGINE_COOLDOWN` seconds (it is tried
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
vLLM's disaggregated-serving proxy serves it, the KV moved as the prefill engine's
`kv_transfer` says (gateway_strategy.py); a decision for one engine is served as
above. A model whose engines are all prefill engines is a 503 (`no_decode_engine`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import Histogram

from quilld.context.listeners import http_budget, soft_nofile
from quilld.http.gateway_answer import Legs
from quilld.http.gateway_decide import Decider
from quilld.http.gateway_engines import EngineBook
from quilld.http.gateway_prompt import PromptHashing
from quilld.http.gateway_relay import Relay
from quilld.http.gateway_request import CHAT, COMPLETIONS, ApiError, RequestReader
from quilld.http.gateway_stats import GatewayStats
from quilld.http.gateway_strategy import Serving, Strategies
from quilld.http.gateway_upstream import REQUEST_ID_HEADER
from quilld.http.listener import Listener
from quilld.http.perimeter import from_this_origin, loopback_only
from quilld.http.prompt_blocks import TokenizerUnavailable

log = logging.getLogger("quilld.gateway")

MAX_BODY = 64 * 1024 * 1024  # largest request body (long prompts, inline images)
SHUTDOWN_TIMEOUT = 2.0  # seconds open streams get at shutdown before they are cancelled
WATCHDOG_TICKS = 8  # byte deadlines are checked this often per first_byte_timeout_ms (at least once a second)


class Gateway:
    def __init__(self, node: Any, ttft: Histogram | None = None, handoff: Histogram | None = None) -> None:
        """`ttft`, `handoff`: the node's TTFT and handoff-wait histograms (metrics.py)."""
        self.node = node
        self.cfg = node.cfg.gateway
        self.control = node.control
        self.stats = GatewayStats(ttft, handoff)
        counts = self.stats.counts
        self.book = EngineBook(node.control, self.cfg.recorded_blocks, counts)
        # the stages, in the order a request meets them
        self.reader = RequestReader(node, self.cfg, self.stats)
        self.hashing = PromptHashing(self.cfg.chunk_chars, node.control.engine_prompts, node.scopes,
                                     lambda: node.salt_key(), counts)
        self.decider = Decider(node.control, node, self.book)
        self.legs = Legs(self.cfg, self.stats, self.book)
        self.strategies = Strategies(Serving(self.cfg, node.control, node, self.stats, self.book, self.decider,
                                             self.legs))
        self._listener: Listener | None = None
        self._handlers: set[asyncio.Task] = set()  # completion requests being served
        self._watch_task: asyncio.Task | None = None

    # -- lifecycle ----------------------------------------------------------------
    async def start(self, host: str, port: int) -> int:
        c = self.cfg
        cap = http_budget(self.node.cfg, soft_nofile()).gateway
        if cap < c.max_connections:
            log.warning("gateway: at most %d connections (gateway.max_connections is %d): the HTTP listeners "
                        "hold at most a quarter of the descriptor limit", cap, c.max_connections)
        self.legs.open(cap)  # at most as many connections to engines as from clients
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
        await self.legs.close()

    async def _watchdog(self) -> None:
        """Renew the legs' leases, and close the engine response of every relay whose engine missed its
        byte deadline.

        The first body byte is due first_byte_timeout_ms after the request was
        sent, each later chunk first_byte_timeout_ms after the one before. One
        timer for all streams, checked WATCHDOG_TICKS times a timeout (at least
        once a second), instead of a timer per chunk read.
        """
        loop = asyncio.get_running_loop()
        tick = min(1.0, self.cfg.first_byte_timeout_ms / 1000 / WATCHDOG_TICKS)
        while True:
            await asyncio.sleep(tick)
            self.book.renew()
            self.legs.check_deadlines(loop.time())

    def info(self) -> list[tuple[str, int | float | str]]:
        return self.stats.info(self.cfg.ttft_slo_ms, self.book.cooling_now())

    # -- the request --------------------------------------------------------------
    async def completion(self, request: web.Request, path: str) -> web.StreamResponse:
        t0 = time.perf_counter()
        counts = self.stats.counts
        counts["requests"] += 1
        try:
            req = await self.reader.read_request(request, path, t0)  # 1. parse
        except ApiError as e:
            counts[e.counter] += 1
            return e.response()
        relay = Relay(request)
        self.stats.in_flight += 1
        task = asyncio.current_task()
        self._handlers.add(task)
        try:
            prompt = self.hashing.prompt(req)  # 2. the engine family's tokens and hashes, as stages ask
            choice = await self.decider.choose(req, prompt, set())  # 3. the decision
            await self.strategies.carry_out(req, prompt, choice, relay)  # 4. its way of moving KV, 5. the answer
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
        if relay.settle():
            self.stats.missed()

    # -- the other endpoints: their answers once the API key is checked -----------------
    def models(self, request: web.Request) -> web.Response:
        names = sorted({e.model for e in self.control.engines.engines.values()})
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "quillcache"} for name in names]})

    def model(self, request: web.Request) -> web.Response:
        base, adapter = self.reader.resolve_model(request.match_info["model"])
        return web.json_response({"id": request.match_info["model"], "object": "model", "created": 0,
                                  "owned_by": "quillcache", **({"parent": base} if adapter else {})})

    def own_stats(self, request: web.Request) -> web.Response:
        return web.json_response(dict(self.info()))


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
            gateway.reader.tenant(request)
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
