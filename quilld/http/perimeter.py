"""What the admin API and the gateway share at their edge: protected mode and reading JSON bodies.

Protected mode (`server.protected_mode`, on by default) is redis's
protected-mode for HTTP: while no password is in force, a request from a peer
other than loopback is refused with 403 before any handler runs. The decision
is `quilld.config.protected_mode_refuses`, the one the RESP listener uses too.

A JSON body is parsed by `parse_json`, which refuses (ValueError, so a 400)
what is not UTF-8 JSON or is nested deeper than `MAX_JSON_DEPTH`; no handler
ever sees a value it would recurse into without bound.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from quilld.config import PROTECTED_MODE_REFUSAL, ServerConfig, protected_mode_refuses

# Nesting of a request body's arrays and objects. serde_json's default recursion limit is 128,
# and no admin or OpenAI body needs more (a tool's JSON schema is a few levels deep).
MAX_JSON_DEPTH = 128

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def loopback_only(server: ServerConfig, passwords: Callable[[], bool],
                  refuse: Callable[[str], web.StreamResponse]):
    """An aiohttp middleware applying protected mode; `refuse(message)` is the app's 403 answer."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        transport = request.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        if protected_mode_refuses(server, passwords(), peer[0] if peer else None):
            return refuse(PROTECTED_MODE_REFUSAL)
        return await handler(request)

    return check


def parse_json(raw: bytes) -> Any:
    """A request body's JSON value; ValueError when it is not UTF-8 JSON or nests deeper than MAX_JSON_DEPTH."""
    try:
        value = json.loads(raw)
    except RecursionError:  # json's C scanner gives up near the interpreter's recursion limit
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    # A body with at most MAX_JSON_DEPTH brackets cannot nest deeper: only others are walked.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _depth(value) > MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def _depth(value: Any) -> int:
    """The nesting of arrays and objects in `value`, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, d)
        if deepest > MAX_JSON_DEPTH:
            return deepest
        stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return deepest
