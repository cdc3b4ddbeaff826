"""Admin HTTP API (aiohttp): health, stats, Prometheus metrics, effective config, the status page.

Routes live in one table; the node is kept in a typed AppKey. With
`admin.token` set, every request needs `Authorization: Bearer <token>`; the
config refuses to start a node whose clients need passwords without one. With
no password at all, protected mode admits loopback peers only (perimeter.py).
A body that is not JSON, or nests too deeply, is answered 400.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import time
from importlib import resources
from typing import Any

from aiohttp import web

from quilld import __version__
from quilld.cluster.cluster import standalone_meta
from quilld.config import engine_from
from quilld.errors import CommandError, QuillError
from quilld.http.metrics import CONTENT_TYPE, NodeMetrics, tenant_stats
from quilld.http.perimeter import loopback_only, parse_json
from quilld.index.engines import OPERATOR
from quilld.index.events import decode_json
from quilld.index.residency import ResidencyIndex
from quilld.index.route_request import RouteRequest
from quilld.index.route_request import route as route_in_scope
from quilld.index.router import Decision
from quilld.model import CacheTier, IdentityScope
from quilld.context.node_context import NodeContext
from quilld.context.figures import counters, tier_stats

NODE: web.AppKey[NodeContext] = web.AppKey("node", NodeContext)
METRICS: web.AppKey[NodeMetrics] = web.AppKey("metrics", NodeMetrics)
STATUS_PAGE: web.AppKey[bytes] = web.AppKey("status_page", bytes)


async def healthz(request: web.Request) -> web.Response:
    node = request.app[NODE]
    body = {"status": "ok", "node_id": node.node_id, "version": __version__}
    tiering = node.tiering
    if tiering is not None and tiering.ssd.failed:
        # still serving from DRAM, so still healthy enough to take traffic: say what broke
        body.update(status="degraded", ssd_error=tiering.ssd.failed)
    return web.json_response(body)


async def stats(request: web.Request) -> web.Response:
    node = request.app[NODE]
    return web.json_response({
        "node_id": node.node_id,
        "version": __version__,
        "tiers": {"dram": {k: v for k, v in tier_stats(node).items() if k.startswith("dram_")},
                  "ssd": dict(node.tiering.info()) if node.tiering else {"ssd_enabled": 0}},
        "counters": counters(node),
        "clients": {"connected": len(node.clients.connections), "max": node.cfg.server.max_clients},
        "cluster": dict(node.cluster.info()) if node.cluster else None,
        "gateway": dict(node.gateway.info()) if node.gateway else None,
        "tenants": tenant_stats(node),
        "engines": {e: node.control.feed_view(e) for e in node.control.engines.engines},
    })


async def clients(request: web.Request) -> web.Response:
    """GET /v1/clients: every RESP connection, of every tenant (CLIENT LIST shows a tenant its own)."""
    node = request.app[NODE]
    now = time.monotonic()
    return web.json_response({"clients": [
        {"id": s.id, "addr": s.addr, "laddr": s.laddr, "user": s.user, "name": (s.name or b"").decode(errors="replace"),
         "scope": {"model": s.scope.model, "tokenizer": s.scope.tokenizer, "adapter": s.scope.adapter},
         "age": int(now - s.created), "idle": int(now - s.last_active), "cmd": s.last_cmd, "resp": 3 if s.resp3 else 2,
         "peer": s.peer}
        for s in node.clients.sessions.values()]})


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: the node's registry (metrics.py) in Prometheus's text format."""
    return web.Response(body=request.app[METRICS].exposition(), headers={"Content-Type": CONTENT_TYPE})


async def status_page(request: web.Request) -> web.Response:
    """GET /: the status page (status.html, self-contained); it reads the JSON routes with the token."""
    return web.Response(body=request.app[STATUS_PAGE], content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-store"})


async def config(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODE].cfg.redacted())


def _json_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _body(request: web.Request) -> Any:
    try:
        return parse_json(await request.read())
    except ValueError as e:
        raise web.HTTPBadRequest(text=json.dumps({"error": f"the body is not JSON: {e}"}),
                                 content_type="application/json") from None


async def list_engines(request: web.Request) -> web.Response:
    control = request.app[NODE].control
    index = control.index
    return web.json_response({"engines": [dataclasses.asdict(e) | {"in_flight": control.engines.in_flight[e.id],
                                                                   "feed": control.feed_view(e.id),
                                                                   "blocks": _blocks_of(index, e.id)}
                                          for e in control.engines.engines.values()]})


def _blocks_of(index: ResidencyIndex, holder: str) -> dict[str, int]:
    """The blocks the residency index places with `holder`, per tier (tiers it has none in left out)."""
    return {t.value: n for t in CacheTier if (n := index.count(holder, t))}


async def add_engine(request: web.Request) -> web.Response:
    node = request.app[NODE]
    try:
        engine = engine_from(await _body(request), "engine")
    except QuillError as e:
        return _json_error(400, e.message)
    new = await node.control.add_engine(engine)
    return web.json_response(dataclasses.asdict(engine), status=201 if new else 200)


async def delete_engine(request: web.Request) -> web.Response:
    control = request.app[NODE].control
    engine_id = request.match_info["engine_id"]
    try:
        dropped = await control.remove_engine(engine_id)
    except QuillError as e:
        return _json_error(404, e.message)
    return web.json_response({"removed": engine_id, "residencies_dropped": dropped})


def decision_json(d: Decision) -> dict[str, Any]:
    """A decision (with an engine) as POST /v1/route's JSON body."""
    return {"engine": d.engine, "url": d.url, "cost": d.cost, "lease": d.lease,
            "candidates": [c._asdict() for c in d.candidates],
            "plan": [{"action": s.action, "holder": s.holder, "tier": s.tier.value if s.tier else None}
                     for s in d.plan]}


def _route_scope(body: dict[str, Any]) -> IdentityScope:
    """The identity a route request speaks for, taken out of its body; the model is required."""
    ident = {k: body.pop(k) for k in ("tenant", "model", "tokenizer", "adapter") if k in body}
    if not isinstance(ident.get("model"), str):
        raise CommandError("model is required")
    return IdentityScope(str(ident.get("tenant", "default")), ident["model"], str(ident.get("tokenizer", "")),
                         str(ident.get("adapter", "")))


async def route(request: web.Request) -> web.Response:
    """POST /v1/route: {tenant?, model, tokenizer?, adapter?, blocks | tokens + block_size, ...}.

    The tenant is that of the admin caller's choosing: the admin API is an operator surface.
    """
    node = request.app[NODE]
    body = await _body(request)
    if not isinstance(body, dict):
        return _json_error(400, "the body must be a JSON object")
    try:
        scope = _route_scope(body)
        d = route_in_scope(node.control, scope, node.scopes.tag(scope), RouteRequest.parse(body))
    except QuillError as e:
        return _json_error(400, e.message)
    if d.engine is None:
        return _json_error(503, f"no engine serves model {scope.model!r}")
    return web.json_response(decision_json(d))


async def kv_events(request: web.Request) -> web.Response:
    node = request.app[NODE]
    raw = await request.read()
    try:
        batch = decode_json(raw)
        engine_id = batch.engine_id or request.query.get("engine_id", "")
        node.control.engines.event_sender(engine_id, OPERATOR)  # the admin API is the operator's
    except QuillError as e:
        node.control.stats["kv_malformed"] += 1
        return _json_error(400, e.message)
    return web.json_response({"engine_id": engine_id, "applied": node.control.apply(engine_id, batch)})


async def hot(request: web.Request) -> web.Response:
    control = request.app[NODE].control
    sketch, index = control.hot, control.index
    return web.json_response({"total": sketch.total, "top": [
        {"block": key.hex(), "count": n, "holders": _holders_of(index, key)} for key, n in sketch.top(20)]})


def _holders_of(index: ResidencyIndex, key: bytes) -> list[dict[str, str]]:
    """Who holds a hot prefix's first block, in any scope that has residencies: [{holder, tier}]."""
    held = {pair for tag in list(index.tag_entries) for pair in index.locate(tag, [key])[0]}
    return [{"holder": h, "tier": t.value} for h, t in sorted(held)]


async def nodes(request: web.Request) -> web.Response:
    """The cluster's members as this node sees them; outside a cluster, the node itself."""
    node = request.app[NODE]
    if node.cluster is None:
        ks = node.keyspace
        meta = standalone_meta(node.cfg.server.bind, node.port, node.admin_port, ks.used, ks.capacity)
        return web.json_response({"node_id": node.node_id, "nodes": [
            {"id": node.node_id, "state": "alive", "incarnation": 0, "gossip": None, "self": True,
             "following": False, **meta}]})
    out = []
    for m in node.cluster.members():
        out.append({"id": m.node_id, "state": m.state.name.lower(), "incarnation": m.incarnation,
                    "gossip": f"{m.addr[0]}:{m.addr[1]}", "self": m.node_id == node.node_id,
                    "following": m.node_id in node.cluster.followers, **(m.meta or {})})
    return web.json_response({"node_id": node.node_id, "nodes": out})


ROUTES = [
    ("GET", "/", status_page),
    ("GET", "/healthz", healthz),
    ("GET", "/v1/stats", stats),
    ("GET", "/v1/clients", clients),
    ("GET", "/metrics", metrics),
    ("GET", "/v1/config", config),
    ("GET", "/v1/engines", list_engines),
    ("POST", "/v1/engines", add_engine),
    ("DELETE", "/v1/engines/{engine_id}", delete_engine),
    ("POST", "/v1/route", route),
    ("POST", "/v1/kv-events", kv_events),
    ("GET", "/v1/hot", hot),
    ("GET", "/v1/nodes", nodes),
]


def _bearer_middleware(token: str):
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.method == "GET" and request.path == "/":
            return await handler(request)  # the status page holds no data: it asks for the token to fetch any
        got = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(got, expected):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401,
                                     headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check


def build_app(node: NodeContext, metrics: NodeMetrics | None = None) -> web.Application:
    """The admin app over `node`; `metrics`: the node's (node.py), or a registry of the app's own."""
    middlewares = [loopback_only(node.cfg.server, lambda: node.users.required, lambda m: _json_error(403, m))]
    if node.cfg.admin.token:
        middlewares.append(_bearer_middleware(node.cfg.admin.token))
    app = web.Application(middlewares=middlewares)
    app[NODE] = node
    app[METRICS] = metrics if metrics is not None else NodeMetrics(node)
    app[STATUS_PAGE] = resources.files(__package__).joinpath("status.html").read_bytes()
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
    return app


class AdminServer:
    def __init__(self, node: NodeContext, metrics: NodeMetrics | None = None) -> None:
        self._runner = web.AppRunner(build_app(node, metrics), access_log=None)

    async def start(self, host: str, port: int) -> int:
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        return site._server.sockets[0].getsockname()[1]  # noqa: SLF001

    async def stop(self) -> None:
        await self._runner.cleanup()
