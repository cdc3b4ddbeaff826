"""The last stage of a gateway request: one engine's leg, and the answer with its headers.

`Legs` holds the one pooled aiohttp session to the engines and runs the two kinds of leg a
relay strategy (kv_handoff.py) asks for:

- `answer`: the leg whose answer the client gets. The request goes to the engine; its status
  and headers are due within `first_byte_timeout_ms`. The first answer prepares the client's
  response with the engine's status and headers and the decision's `x-quillcache-*` headers
  (gateway_upstream.decision_headers) before the first body byte; the body is relayed as it
  comes (gateway_relay.py: SSE events whole), each wait for the engine's next bytes bounded by
  the watchdog (`check_deadlines`). UpstreamFailed while no body byte reached the client (the
  strategy tries the next engine); after that, a failure ends the client's answer.
  The first body byte of a 2xx answer is the request's time to first token: counted against
  its SLO, the engine healthy again, its lease's prefill done, its blocks recorded as in its
  HBM (gateway_engines.py).
- `prefill`: a prefill leg (vLLM's proxy protocol): a JSON answer read whole, its
  `kv_transfer_params` returned; UpstreamFailed when it fails.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
from yarl import URL

from quilld.config import EngineConfig, GatewayConfig
from quilld.http.gateway_engines import EngineBook
from quilld.http.gateway_relay import Relay
from quilld.http.gateway_request import Parsed
from quilld.http.gateway_stats import GatewayStats
from quilld.http.gateway_upstream import (Choice, UpstreamFailed, answer_ok, decision_headers, describe,
                                          engine_headers, upstream_headers, upstream_url)

log = logging.getLogger("quilld.gateway")

UPSTREAM_KEEPALIVE = 4.0  # below uvicorn's 5 s, so a pooled connection is never one the engine is closing


class Legs:
    def __init__(self, cfg: GatewayConfig, stats: GatewayStats, book: EngineBook) -> None:
        self.cfg = cfg
        self.stats = stats
        self.book = book
        self.session: aiohttp.ClientSession | None = None
        self._urls: dict[tuple[str, str], URL] = {}  # (engine base URL, path) -> parsed upstream URL
        self._reading: dict[Relay, aiohttp.ClientResponse] = {}  # answers being relayed, for the watchdog

    def open(self, connections: int) -> None:
        """The pooled session: at most `connections` to engines (as many as from clients)."""
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=connections, keepalive_timeout=UPSTREAM_KEEPALIVE),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_ms / 1000),
            auto_decompress=False, skip_auto_headers=("User-Agent",), cookie_jar=aiohttp.DummyCookieJar())

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    def check_deadlines(self, now: float) -> None:
        """Close the engine response of every relay whose engine missed its byte deadline (loop time `now`)."""
        for relay, upstream in list(self._reading.items()):
            if relay.deadline and now > relay.deadline:
                relay.stalled = True
                upstream.close()

    # -- a prefill leg --------------------------------------------------------------------------
    async def prefill(self, req: Parsed, engine: EngineConfig, data: bytes, headers: dict[str, str]) -> dict:
        """One prefill request: its answer's kv_transfer_params ({} when it names none)."""
        deadline = asyncio.get_running_loop().time() + self.cfg.first_byte_timeout_ms / 1000
        try:
            async with asyncio.timeout_at(deadline):
                async with self.session.post(self._url(engine.url, req.path), data=data,
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

    # -- the leg the client gets the answer of -----------------------------------------------------
    async def answer(self, req: Parsed, choice: Choice, relay: Relay) -> None:
        """Ask one engine and relay its answer; UpstreamFailed while nothing reached the client's body."""
        deadline = asyncio.get_running_loop().time() + self.cfg.first_byte_timeout_ms / 1000
        upstream = await self._ask(req, choice, relay, deadline)
        try:
            ok = await self._headers(req, choice, relay, upstream)
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

    async def _headers(self, req: Parsed, choice: Choice, relay: Relay, upstream: aiohttp.ClientResponse) -> bool:
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

    def _first_byte(self, req: Parsed, choice: Choice, ok: bool, relay: Relay) -> None:
        if not ok:
            return
        self.stats.first_byte((time.perf_counter() - req.t0) * 1000, req.slo_ms)
        relay.settled = True
        book = self.book
        book.answered(choice.engine.id)  # tried as a last resort and it answered: healthy again
        if relay.lease is not None:
            book.control.engines.prefilled(relay.lease)  # its prefill is done: no longer queued prefill work
        book.record(choice.engine, choice.tag, choice.blocks)  # it prefilled the prompt (or loaded its KV)

    def _url(self, base: str, path: str) -> URL:
        url = self._urls.get((base, path))
        if url is None:
            if len(self._urls) > 1024:  # engines come and go: never let it grow without bound
                self._urls.clear()
            url = self._urls[(base, path)] = URL(upstream_url(base, path))
        return url


def _let_go(upstream: aiohttp.ClientResponse) -> None:
    """Return a read answer's connection to the pool; one cancelled or failed mid-body is dropped
    instead, so the engine sees the request go."""
    if upstream.content.at_eof():
        upstream.release()
    else:
        upstream.close()
