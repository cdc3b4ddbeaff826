"""Admin HTTP API (aiohttp): health, stats, Prometheus metrics, effective config.

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
from typing import Any

from aiohttp import web

from quilld import __version__
from quilld.cluster.cluster import standalone_meta
from quilld.config import engine_from
from quilld.errors import CommandError, QuillError
from quilld.http.perimeter import loopback_only, parse_json
from quilld.index.events import decode_json
from quilld.index.route_request import RouteRequest
from quilld.index.route_request import route as route_in_scope
from quilld.index.router import Decision
from quilld.model import IdentityScope
from quilld.protocol.context import NodeContext
from quilld.protocol.info import counters, tier_stats

NODE: web.AppKey[NodeContext] = web.AppKey("node", NodeContext)


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
        "tiers": {"dram": node.keyspace.arena.stats() | tier_stats(node)},
        "counters": counters(node),
        "clients": {"connected": len(node.clients.connections), "max": node.cfg.server.max_clients},
        "persistence": dict(node.tiering.info()) if node.tiering else None,
        "cluster": dict(node.cluster.info()) if node.cluster else None,
        "gateway": dict(node.gateway.info()) if node.gateway else None,
        "tenants": tenant_stats(node),
        "engines": {e: node.control.feed_view(e) for e in node.control.engines.engines},
    })


def tenant_stats(node: NodeContext) -> dict[str, dict[str, int]]:
    """Per tenant, what RESP clients see of their own tenant only (INFO) — the operator's view."""
    tenants = {s.user for s in node.clients.sessions.values()} | {t for t, _ in node.scopes.refusals}
    out = {}
    for tenant in sorted(tenants):
        hits, misses = node.keyspace.lookups_of(tenant)
        out[tenant] = {"connected_clients": sum(1 for s in node.clients.sessions.values() if s.user == tenant),
                       "scopes": node.scopes.scopes_of(tenant), "keyspace_hits": hits, "keyspace_misses": misses,
                       **{f"guard_refusals_{k}": v for k, v in node.scopes.refusals_of(tenant).items()}}
    return out


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


def _metric_lines(node: NodeContext) -> list[str]:
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, value: float) -> None:
        lines.append(f"# HELP quilld_{name} {help_text}")
        lines.append(f"# TYPE quilld_{name} {kind}")
        lines.append(f"quilld_{name} {value}")

    c = counters(node)
    for name, help_text in (
        ("total_commands_processed", "Commands executed."),
        ("total_connections_received", "Connections accepted."),
        ("total_net_input_bytes", "Bytes read from clients."),
        ("total_net_output_bytes", "Bytes written to clients."),
        ("keyspace_hits", "Lookups that found their key."),
        ("keyspace_misses", "Lookups that did not."),
        ("evicted_keys", "Values evicted for space."),
        ("expired_keys", "Keys removed by their TTL."),
        ("guard_refusals", "Lookups refused because the key exists only in another identity scope."),
        ("auth_failures", "Failed AUTH attempts."),
        ("put2phase_committed", "Two-phase puts committed."),
        ("put2phase_aborted", "Two-phase puts aborted."),
        ("put2phase_expired", "Two-phase puts reclaimed after their lease."),
    ):
        metric(name.removeprefix("total_") + ("_total" if not name.endswith("_total") else ""), "counter",
               help_text, c[name])
    lines.append("# HELP quilld_guard_refusals_by_reason_total Refused cross-scope lookups by reason.")
    lines.append("# TYPE quilld_guard_refusals_by_reason_total counter")
    for reason in ("cross_tenant", "cross_model", "cross_tokenizer", "cross_adapter"):
        lines.append(f'quilld_guard_refusals_by_reason_total{{reason="{reason}"}} {c["guard_refusals_" + reason]}')
    t = tier_stats(node)
    metric("connected_clients", "gauge", "Open client connections.", len(node.clients.connections))
    metric("put2phase_open", "gauge", "Two-phase puts in progress.", c["put2phase_open"])
    for name, help_text in (
        ("dram_capacity", "DRAM tier capacity in bytes."),
        ("dram_used", "DRAM tier bytes in use (arena pages and inline values)."),
        ("dram_keys", "Keys resident in DRAM."),
        ("dram_blocks", "Arena blocks resident in DRAM."),
        ("dram_fragmentation", "1 - largest free extent / free bytes."),
    ):
        metric(name, "gauge", help_text, t[name])
    # the optional parts (SSD tier, cluster, gateway): every numeric field of their INFO section
    for part, label in ((node.tiering, "SSD tier"), (node.cluster, "Cluster"), (node.gateway, "Gateway")):
        if part is None:
            continue
        for name, value in part.info():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                metric(name, "gauge", f"{label}: {name.replace('_', ' ')} (see INFO).", value)
    lines.extend(_engine_metric_lines(node))
    return lines


ENGINE_FEED_METRICS = (
    ("batches", "KV-event batches applied."), ("events", "KV events applied."),
    ("malformed", "KV events or batches skipped because they could not be decoded."),
    ("gaps", "Holes seen in the KV-event sequence."), ("replays", "Replays that delivered missed batches."),
    ("restarts", "KV-event publisher restarts detected."), ("missed", "KV-event batches lost for good."),
    ("drops", "Times the engine's residencies were dropped (events lost or publisher restarted)."),
)


def _engine_metric_lines(node: NodeContext) -> list[str]:
    """Per engine (label `engine`): its KV-event feed's counters, last sequence number and idle time."""
    control = node.control
    views = {e: control.feed_view(e) for e in control.engines.engines}
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, values: dict[str, float]) -> None:
        lines.append(f"# HELP quilld_{name} {help_text}")
        lines.append(f"# TYPE quilld_{name} {kind}")
        for engine_id, value in values.items():
            label = engine_id.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
            lines.append(f'quilld_{name}{{engine="{label}"}} {value}')

    for key, help_text in ENGINE_FEED_METRICS:
        family(f"kv_engine_{key}_total", "counter", help_text, {e: v[key] for e, v in views.items()})
    family("kv_engine_last_sequence", "gauge", "Sequence number of the last KV-event batch applied (-1: none).",
           {e: -1 if v["last_seq"] is None else v["last_seq"] for e, v in views.items()})
    family("kv_engine_idle_seconds", "gauge", "Seconds since the engine's KV-event feed last received anything.",
           {e: v["idle_s"] for e, v in views.items()})
    return lines


async def metrics(request: web.Request) -> web.Response:
    body = "\n".join(_metric_lines(request.app[NODE])) + "\n"
    return web.Response(text=body, content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


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
    return web.json_response({"engines": [dataclasses.asdict(e) | {"in_flight": control.engines.in_flight[e.id],
                                                                   "feed": control.feed_view(e.id)}
                                          for e in control.engines.engines.values()]})


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
        node.control.engines.get(engine_id)
    except QuillError as e:
        node.control.stats["kv_malformed"] += 1
        return _json_error(400, e.message)
    return web.json_response({"engine_id": engine_id, "applied": node.control.apply(engine_id, batch)})


async def hot(request: web.Request) -> web.Response:
    sketch = request.app[NODE].control.hot
    return web.json_response({"total": sketch.total,
                              "top": [{"block": key.hex(), "count": n} for key, n in sketch.top(20)]})


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
        got = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(got, expected):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401,
                                     headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check


def build_app(node: NodeContext) -> web.Application:
    middlewares = [loopback_only(node.cfg.server, lambda: node.users.required, lambda m: _json_error(403, m))]
    if node.cfg.admin.token:
        middlewares.append(_bearer_middleware(node.cfg.admin.token))
    app = web.Application(middlewares=middlewares)
    app[NODE] = node
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
    return app


class AdminServer:
    def __init__(self, node: NodeContext) -> None:
        self._runner = web.AppRunner(build_app(node), access_log=None)

    async def start(self, host: str, port: int) -> int:
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        return site._server.sockets[0].getsockname()[1]  # noqa: SLF001

    async def stop(self) -> None:
        await self._runner.cleanup()
