"""The client's side of a gateway request: one response, relayed from one or more engine attempts.

The response is prepared once, with the first engine's status and headers and
the decision headers. Server-sent events are relayed whole: a chunk is held
back up to the end of its last complete event, so when an engine fails
mid-stream the client gets the complete events so far and then a final
`data: {"error": ...}` event, never half an event.
"""

from __future__ import annotations

import json

import aiohttp
from aiohttp import web

FORWARDED_HEADERS = ("Content-Type", "Content-Encoding", "Cache-Control")


def event_end(buf: bytes) -> int:
    """Length of the leading run of whole SSE events in `buf`."""
    lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def error_event(message: str) -> bytes:
    body = {"error": {"message": message, "type": "upstream_error", "param": None, "code": "engine_failed"}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class Relay:
    """The client's response: prepared once, then fed upstream chunks (whole SSE events)."""

    __slots__ = ("request", "resp", "sse", "pending", "started", "settled", "failures", "deadline", "stalled",
                 "lease")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.resp: web.StreamResponse | None = None
        self.sse = False
        self.pending = b""
        self.started = False  # a body byte reached the client
        self.settled = False  # the request's goodput outcome is counted
        self.failures: list[str] = []  # "engine: reason" of the failed attempts
        self.deadline = 0.0  # loop time by which the engine owes its next byte; 0 while not waiting for one
        self.stalled = False  # the engine missed that deadline and its response was closed
        self.lease: str | None = None  # the attempt's whole-request lease: its prefill ends at the first byte

    def settle(self) -> bool:
        """The request's goodput outcome is known now; True when it was not before (count it then)."""
        if self.settled:
            return False
        self.settled = True
        return True

    async def prepare(self, upstream: aiohttp.ClientResponse, headers: dict[str, str]) -> None:
        resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for name in FORWARDED_HEADERS:
            value = upstream.headers.get(name)
            if value is not None:
                resp.headers[name] = value
        resp.headers.update(headers)
        self.sse = resp.headers.get("Content-Type", "").startswith("text/event-stream")
        self.resp = resp
        await resp.prepare(self.request)

    async def forward(self, chunk: bytes) -> bool:
        """Relay a chunk; True when it carried the first body byte."""
        if self.sse:
            buf = self.pending + chunk if self.pending else chunk
            cut = event_end(buf)
            if not cut:
                self.pending = buf
                return False
            self.pending, chunk = buf[cut:], buf[:cut]
        first = not self.started
        self.started = True
        await self.resp.write(chunk)
        return first

    async def flush(self) -> bool:
        """At the end of the engine's answer: relay a trailing partial event; True when it was the first byte."""
        if not self.pending:
            return False
        chunk, self.pending = self.pending, b""
        first = not self.started
        self.started = True
        await self.resp.write(chunk)
        return first

    async def fail(self, message: str) -> None:
        """End a started answer after an upstream failure."""
        resp = self.resp
        resp.force_close()
        if self.sse:
            self.pending = b""
            await resp.write(error_event(message))
            await resp.write_eof()
        elif self.request.transport is not None:  # a plain body can only be cut short
            self.request.transport.close()
