"""What the admin API and the gateway share at their edge: protected mode, what a web page may
send, and reading JSON bodies.

Protected mode (`server.protected_mode`, on by default) is redis's
protected-mode for HTTP: while no password is in force, a request from a peer
other than loopback is refused with 403 before any handler runs. The decision
is `quilld.config.protected_mode_refuses`, the one the RESP listener uses too.

Web pages (`from_this_origin`). A page on any site can make its visitor's
browser send a "simple" cross-origin request (a form, or fetch with
`text/plain`) to 127.0.0.1 with no preflight: it cannot read the answer, but the
request is acted on. And a page whose host name its owner makes resolve to
127.0.0.1 (DNS rebinding) is same-origin with the port: it can read answers
too, though its requests still name its own host. So, where a browser could be
the sender: a request whose Host is not one of this node's names
(`own_host_names`: IP addresses, localhost, the machine's host name,
`server.bind`, `server.allowed_hosts`) is refused 403; a state-changing request
(POST, PUT, PATCH, DELETE) whose `Origin` is another origin than its Host, or
whose `Sec-Fetch-Site` says cross-site, is refused 403; and on the admin API a
POST whose body is not declared JSON (`Content-Type: application/json`) is
refused 415, which no page can send cross-origin without a preflight quilld
never grants. A credential in force (the admin token; a password for the
gateway) already stops a page, which cannot send it: then only the admin API's
state-changing requests are checked, as a second wall. Every refusal is
counted per listener and reason (`ListenerFigures.refusals`).

A JSON body is parsed by `parse_json`, which refuses (ValueError, so a 400)
what is not UTF-8 JSON or is nested deeper than `MAX_JSON_DEPTH`; no handler
ever sees a value it would recurse into without bound.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from quilld.config import PROTECTED_MODE_REFUSAL, ServerConfig, protected_mode_refuses
from quilld.context.listeners import ListenerFigures

# Nesting of a request body's arrays and objects. serde_json's default recursion limit is 128,
# and no admin or OpenAI body needs more (a tool's JSON schema is a few levels deep).
MAX_JSON_DEPTH = 128

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Refuse = Callable[[int, str, str], web.StreamResponse]  # (status, message, code) -> the app's error answer
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
WITH_BODY = frozenset({"POST", "PUT", "PATCH"})
DEFAULT_PORTS = {"http": 80, "https": 443}


def loopback_only(server: ServerConfig, passwords: Callable[[], bool],
                  refuse: Callable[[str], web.StreamResponse], figures: ListenerFigures | None = None,
                  open_paths: frozenset[str] = frozenset()):
    """An aiohttp middleware applying protected mode; `refuse(message)` is the app's 403 answer;
    `open_paths` (the admin API's probes) say nothing and are answered to anyone."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in open_paths:
            return await handler(request)
        transport = request.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        if protected_mode_refuses(server, passwords(), peer[0] if peer else None):
            if figures is not None:
                figures.refusals["protected_mode"] += 1
            return refuse(PROTECTED_MODE_REFUSAL)
        return await handler(request)

    return check


def own_host_names(server: ServerConfig) -> frozenset[str]:
    """The host names (lower case) this node's HTTP ports answer to besides IP addresses."""
    names = {"localhost", socket.gethostname().lower(), server.bind.lower()}
    names.update(h.strip().lower().rstrip(".") for h in server.allowed_hosts.split(",") if h.strip())
    return frozenset(names - {""})


def _host_and_port(netloc: str, default: int | None) -> tuple[str, int | None]:
    """("host", port) of a Host header or an origin's netloc ("[::1]:7380" -> ("::1", 7380))."""
    parts = urlsplit("//" + netloc)
    try:
        port = parts.port
    except ValueError:
        return "", None
    return (parts.hostname or "").rstrip("."), port if port is not None else default


def is_own_host(host: str, names: frozenset[str]) -> bool:
    """Whether a Host header names this node: an IP address, or one of `names`."""
    name, _ = _host_and_port(host, None)
    if not name:
        return False
    try:
        ipaddress.ip_address(name.partition("%")[0])
        return True
    except ValueError:
        return name in names


def same_origin(origin: str, host: str, scheme: str) -> bool:
    """Whether an Origin header names the origin the request was sent to (its Host, on `scheme`)."""
    parts = urlsplit(origin)
    if parts.scheme not in DEFAULT_PORTS:
        return False  # "null" (a sandboxed page, a file), or nonsense
    theirs = _host_and_port(parts.netloc, DEFAULT_PORTS[parts.scheme])
    ours = _host_and_port(host, DEFAULT_PORTS.get(scheme, 80))
    return bool(theirs[0]) and theirs == ours and parts.scheme == scheme


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or (content_type.startswith("application/")
                                                  and content_type.endswith("+json"))


def from_this_origin(server: ServerConfig, figures: ListenerFigures, refuse: Refuse, *,
                     credential: Callable[[], bool], json_writes: bool, open_paths: frozenset[str] = frozenset()):
    """An aiohttp middleware refusing what a web page elsewhere made a browser send (see above).

    `credential()`: whether the port has a credential in force (then reads are not checked, nor,
    unless `json_writes`, writes); `json_writes`: the admin API's rules for state-changing requests,
    checked always, a JSON body included; `open_paths`: GETs that say nothing (probes), not checked."""
    names = own_host_names(server)

    def refused(status: int, reason: str, message: str) -> web.StreamResponse:
        figures.refusals[reason] += 1
        return refuse(status, message, reason)

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        writes = request.method in STATE_CHANGING
        if (not (json_writes and writes) and credential()) or (request.path in open_paths and not writes):
            return await handler(request)
        host = request.headers.get("Host", "")
        if host and not is_own_host(host, names):
            return refused(403, "foreign_host", f"this port does not answer to host {host!r}: add it to "
                                                "server.allowed_hosts if it is one of this node's names")
        if writes:
            origin = request.headers.get("Origin")
            if (origin is not None and not same_origin(origin, host, request.scheme)) or \
                    request.headers.get("Sec-Fetch-Site", "") in ("cross-site", "same-site"):
                return refused(403, "cross_origin", f"a request from another origin ({origin or 'another site'}) "
                                                    "may not change anything here")
            if json_writes and request.method in WITH_BODY and not _is_json(request.content_type):
                return refused(415, "content_type", "the body must be JSON, sent as Content-Type: "
                                                    "application/json")
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
