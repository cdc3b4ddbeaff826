"""One HTTP port: an aiohttp app behind a connection cap, header and body deadlines, and a quiet log.

aiohttp by itself waits for a request's head as long as a client likes (its
keep-alive timer is an hour), so a client sending a header line now and then
(slowloris) holds a connection, and its descriptor, for as long as it likes;
enough of them and the process has no descriptor left for a RESP client. Here:

- **A cap.** At most `max_connections` connections are open at once on the port
  (cut to the HTTP listeners' share of the descriptor limit: context/listeners.py);
  one more is answered `503` with `Retry-After` and closed at once, counted.
- **A header deadline.** A connection has `header_timeout` seconds from when it
  opens, and again from each answer, to deliver a complete request head. One that
  started a head and did not finish it is aborted and counted; an idle keep-alive
  connection is just closed.
- **A body deadline.** Once the head has arrived, the body has `body_timeout`
  seconds: a handler still reading it then gets `BodyTimeout` out of its read, and
  the request is answered `408` and its connection closed (counted). A body cut short
  or badly framed is a `400`, counted as malformed, never a 500 with a traceback.
  Nothing reads a body before the handler does, so a request the perimeter or the
  handler refuses first (a wrong key) costs no more than its head.
- **One log line per kind of malformed request.** aiohttp logs a traceback for
  every request it cannot parse (a bad request line, an invalid header, a line too
  long ...), before any credential is checked: 200 such requests were 200
  tracebacks. Here each is counted by kind (`ListenerFigures.malformed`, in
  `/metrics`), and only the first of each kind is logged, in one line.

The middleware that sees each parsed request (`_guard`) is put first in the app's
list by `Listener`; the connection wrapper (`_Connection`) sits between asyncio and
aiohttp's own protocol object and forwards every call.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from quilld.context.listeners import ListenerFigures

log = logging.getLogger("quilld.http")

REFUSAL_LOG_EVERY = 60.0  # seconds between two log lines about connections refused at the cap
BACKLOG = 1024


class BodyTimeout(Exception):
    """Raised out of a handler's read of a body that did not arrive within the body deadline."""


def _kind(exc: BaseException) -> str:
    """A malformed request's kind, from aiohttp's exception class: BadStatusLine -> bad_status_line."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(exc).__name__).lower()


class RequestErrorLog(logging.LoggerAdapter):
    """aiohttp's server logger for one listener: a request aiohttp could not parse is counted
    by kind and logged once per kind, in one line; anything else (a handler's bug) is logged as is."""

    def __init__(self, listener: str, figures: ListenerFigures) -> None:
        super().__init__(log, {})
        self.listener = listener
        self.figures = figures

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if isinstance(exc, BodyTimeout):
            return  # answered 408 and counted; aiohttp, reading what is left of the body, met it again
        if isinstance(exc, RequestPayloadError):  # a body badly framed, met by aiohttp's read of the rest
            exc = exc.__cause__ or exc.__context__ or exc
            self.malformed(exc, None)
            return
        if isinstance(exc, HttpProcessingError):
            self.malformed(exc, args[0] if args else None)
            return
        super().log(level, msg, *args, **kwargs)

    def malformed(self, exc: BaseException, peer: object) -> None:
        kind = _kind(exc)
        first = kind not in self.figures.malformed
        self.figures.malformed[kind] += 1
        if first:
            text = " ".join(str(getattr(exc, "message", "") or exc).split())  # one line
            log.warning("%s: a malformed HTTP request from %s (%s: %s); further ones of this kind are counted "
                        "in quilld_http_malformed_requests_total, not logged", self.listener, peer, kind,
                        text[:200])


BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
        b"Retry-After: 1\r\nConnection: close\r\n\r\n%s")
Answer = Callable[[int, str, str], web.Response]  # (status, message, code) -> the port's JSON error response


class _Connection(asyncio.Protocol):
    """One accepted connection: refused at the cap, or handed to aiohttp's protocol under the header deadline."""

    __slots__ = ("listener", "inner", "transport", "timer", "body_timer", "busy", "heard")

    def __init__(self, listener: "Listener") -> None:
        self.listener = listener
        self.inner: Any = None  # aiohttp's RequestHandler, once admitted
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None  # the header deadline
        self.body_timer: asyncio.TimerHandle | None = None  # the body deadline of the request being handled
        self.busy = 0  # requests being handled (past their head)
        self.heard = False  # bytes arrived since the header deadline was set

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        listener = self.listener
        self.transport = transport  # type: ignore[assignment]
        if len(listener.open) >= listener.cap:
            listener.refuse(transport)  # type: ignore[arg-type]
            return
        listener.open[transport] = self
        listener.figures.open = len(listener.open)
        self.inner = listener.runner.server()  # type: ignore[misc]
        self.inner.connection_made(transport)
        self.wait_for_head()

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.heard = True
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        listener = self.listener
        for timer in (self.timer, self.body_timer):
            if timer is not None:
                timer.cancel()
        self.timer = self.body_timer = None
        if listener.open.pop(self.transport, None) is not None:
            listener.figures.open = len(listener.open)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    # -- the header deadline --------------------------------------------------
    def wait_for_head(self) -> None:
        """Start (again) the time the next request's head has to arrive."""
        if self.timer is not None:
            self.timer.cancel()
        self.heard = False
        self.timer = asyncio.get_running_loop().call_later(self.listener.header_timeout, self._late)

    def request_started(self, request: web.Request) -> None:
        """A request's head arrived: no header deadline while it is handled; its body's deadline starts."""
        self.busy += 1
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if request.body_exists and not request.content.is_eof():
            self.body_timer = asyncio.get_running_loop().call_later(self.listener.body_timeout, self._body_late,
                                                                    request)

    def request_ended(self) -> None:
        self.busy -= 1
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None
        if not self.busy and self.transport is not None and not self.transport.is_closing():
            self.wait_for_head()

    def _body_late(self, request: web.Request) -> None:
        self.body_timer = None
        if not request.content.is_eof():
            self.listener.figures.body_timeouts += 1
            request.content.set_exception(BodyTimeout())

    def _late(self) -> None:
        self.timer = None
        if self.busy or self.transport is None or self.transport.is_closing():
            return
        if self.heard:  # a head begun and never finished: a slow sender, cut off
            self.listener.figures.header_timeouts += 1
            self.transport.abort()
        else:  # an idle keep-alive connection
            self.transport.close()


class Listener:
    """An aiohttp app served on one port behind the perimeter above.

    `name` is the listener's key in the node's figures ("admin", "gateway"); `cap` its
    connection cap in force (context/listeners.py's `http_budget`); the timeouts in seconds;
    `answer` makes the port's own error responses (the admin API's and the gateway's differ).
    """

    def __init__(self, name: str, what: str, app: web.Application, figures: ListenerFigures, cap: int,
                 header_timeout: float, body_timeout: float, answer: Answer, **runner_kwargs: Any) -> None:
        self.name = name
        self.what = what  # for people: "admin API", "gateway"
        self.figures = figures
        self.answer = answer
        self.errors = RequestErrorLog(name, figures)
        self.cap = cap
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.open: dict[asyncio.BaseTransport, _Connection] = {}
        self._refusals_logged = -REFUSAL_LOG_EVERY
        self._refused_since_log = 0
        figures.max_connections = cap
        app.middlewares.insert(0, self._guard)
        runner_kwargs.setdefault("access_log", None)
        # aiohttp's own idle timer (an hour by default) stays as a backstop behind the header deadline
        self.runner = web.AppRunner(app, logger=self.errors, keepalive_timeout=2 * header_timeout, **runner_kwargs)
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: a free port); the port bound."""
        await self.runner.setup()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, reuse_address=True,
                                                backlog=BACKLOG)
        return self._server.sockets[0].getsockname()[1]

    async def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def stop(self) -> None:
        """Stop accepting, then let aiohttp end the open requests (its shutdown) and close the rest."""
        await self.stop_accepting()
        await self.runner.cleanup()
        for transport in list(self.open):
            transport.close()

    # -- refusals ---------------------------------------------------------------
    def refuse(self, transport: asyncio.Transport) -> None:
        """A connection over the cap: answered 503, closed, counted (and logged once a minute at most)."""
        self.figures.refused += 1
        self._refused_since_log += 1
        body = self.answer(503, f"too many connections to the {self.what} ({self.cap} open, the most it takes); "
                                "try again", "too_many_connections").body
        transport.write(BUSY % (len(body), body))
        transport.close()
        now = time.monotonic()
        if now - self._refusals_logged >= REFUSAL_LOG_EVERY:
            log.warning("%s: %d connection(s) refused: %d are open, the most it takes (%s.max_connections, "
                        "within the HTTP listeners' share of the descriptor limit); counted in "
                        "quilld_http_connections_refused_total", self.what, self._refused_since_log, self.cap,
                        self.name)
            self._refusals_logged, self._refused_since_log = now, 0

    # -- the middleware --------------------------------------------------------
    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Outermost: the request's head has arrived; until it is answered its connection has no header
        deadline, and its body has the body deadline. A late or malformed body is answered here."""
        conn = self.open.get(request.transport) if request.transport is not None else None
        if conn is not None:
            conn.request_started(request)
        try:
            return await handler(request)
        except BodyTimeout:
            return self._closing(408, f"the request's body did not arrive within {self.body_timeout:g} s",
                                 "body_timeout")
        except RequestPayloadError as e:  # cut short, or badly framed (chunks, length)
            cause = e.__cause__ or e.__context__ or e
            self.errors.malformed(cause, request.remote)
            return self._closing(400, f"the request's body is malformed: {cause}", "malformed_body")
        finally:
            if conn is not None:
                conn.request_ended()

    def _closing(self, status: int, message: str, code: str) -> web.Response:
        response = self.answer(status, message, code)
        response.force_close()
        return response
