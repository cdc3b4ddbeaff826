"""Admin HTTP API (aiohttp): health, stats, Prometheus metrics, effective config, the status page.

Routes live in one table; the node is kept in a typed AppKey. With
`admin.token` set, every request needs `Authorization: Bearer <token>`; the
config refuses to start a node whose clients need passwords without one. With
no password at all, protected mode admits loopback peers only (perimeter.py).
A body that is not JSON, or nests too deeply, is answered 400.

Health. `/livez` and `/readyz` are an orchestrator's probes: no token, not
protected mode's, and they say nothing but a status (and, for readiness, why
not: starting, stopping, degraded). The admin API listens before the SSD tier
recovers (node.py), so they answer then: alive, not ready. `/healthz` is the
operator's (token): the node id, version, phase and SSD error; 503 unless ok.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import time
from importlib import resources
from typing import Any

from aiohttp import web

from quilld import __version__
from quilld.cluster.cluster import standalone_meta
from quilld.config import EngineConfig, engine_from
from quilld.errors import CommandError, QuillError
from quilld.context.listeners import ListenerFigures, http_budget, soft_nofile
from quilld.http.history import History
from quilld.http.listener import Listener
from quilld.http.metrics import CONTENT_TYPE, NodeMetrics, tenant_stats
from quilld.http.perimeter import from_this_origin, loopback_only, parse_json
from quilld.index.engines import OPERATOR
from quilld.index.events import decode_json
from quilld.index.pairing import NoDecodeEngine, Pair
from quilld.index.residency import ResidencyIndex
from quilld.index.route_request import RouteRequest, engine_route, needs_engine_hashing
from quilld.index.route_request import route as route_in_scope
from quilld.index.router import Decision
from quilld.model import CacheTier, IdentityScope
from quilld.context.node_context import NodeContext
from quilld.context.figures import counters, tier_stats

log = logging.getLogger("quilld.http")

NODE: web.AppKey[NodeContext] = web.AppKey("node", NodeContext)
METRICS: web.AppKey[NodeMetrics] = web.AppKey("metrics", NodeMetrics)
STATUS_PAGE: web.AppKey[bytes] = web.AppKey("status_page", bytes)
HISTORY: web.AppKey[History] = web.AppKey("history", History)


SERVING = "serving"


def not_ready(node: NodeContext) -> list[str]:
    """Why the node should not be sent traffic now (empty: it is ready): it is starting (which
    step), stopping, or degraded (its SSD tier failed: it serves from DRAM only, and loses what
    it evicts)."""
    reasons = []
    if node.phase != SERVING:
        reasons.append(node.phase if node.phase == "stopping" else f"starting: {node.phase}")
    tiering = node.tiering
    if tiering is not None and tiering.ssd.failed:
        reasons.append("degraded: the SSD tier failed")
    return reasons


def registry_notes(node: NodeContext) -> list[str]:
    """What a serving node says of its membership registry when it cannot reach it (etcd): it
    serves on with the last view it had."""
    membership = getattr(node.cluster, "membership", None)
    if getattr(membership, "state", "") != "unreachable":
        return []
    since = membership.unreachable_since
    age = f" for {time.monotonic() - since:.0f} s" if since is not None else ""
    return [f"etcd unreachable{age}: serving with the last view of the members"]


def keeps_less(node: NodeContext) -> list[str]:
    """What a serving node cannot keep as it should (the operator's /healthz, not /readyz: it
    still serves everything): a persistent residency index that cannot write (a commit failed:
    a restart loads the last one that did), values its SSD tier refused, held in DRAM only."""
    reasons = []
    index_error = node.control.index.describe().get("failed")
    if index_error:
        reasons.append(f"degraded: the residency index cannot write ({index_error}); a restart loads its last "
                       "commit")
    tiering = node.tiering
    held = tiering.unstorable_held() if tiering is not None and not tiering.ssd.failed else 0
    if held:
        reasons.append(f"degraded: {held} value{'s' if held != 1 else ''} the SSD tier cannot hold "
                       "(ssd_unstorable) held in DRAM only")
    return reasons


async def livez(request: web.Request) -> web.Response:
    """GET /livez: the process answers (an orchestrator's liveness probe). No token, nothing else said."""
    return web.json_response({"status": "ok"}, headers={"Cache-Control": "no-store"})


async def readyz(request: web.Request) -> web.Response:
    """GET /readyz: 200 when the node serves and nothing is degraded, 503 with the reasons otherwise
    (an orchestrator's readiness probe). No token: the reasons name states, never a node's data."""
    node = request.app[NODE]
    reasons = not_ready(node)
    body: dict[str, Any] = {"status": "not ready", "reasons": reasons} if reasons else {"status": "ready"}
    notes = registry_notes(node)
    if notes:
        body["notes"] = notes  # still ready: the data path never waits on the registry
    return web.json_response(body, status=503 if reasons else 200, headers={"Cache-Control": "no-store"})


async def healthz(request: web.Request) -> web.Response:
    """GET /healthz: the operator's view (token): ok, starting, stopping or degraded with the error (the SSD
    tier failed, or it keeps less than it should: `keeps_less`); 503 unless ok."""
    node = request.app[NODE]
    less = keeps_less(node) + registry_notes(node)
    body: dict[str, Any] = {"status": "ok", "node_id": node.node_id, "version": __version__, "phase": node.phase,
                            "reasons": not_ready(node) + less}
    tiering = node.tiering
    if node.phase != SERVING:
        body["status"] = "stopping" if node.phase == "stopping" else "starting"
    elif tiering is not None and tiering.ssd.failed or less:
        body["status"] = "degraded"  # still serving: say what broke
    if tiering is not None and tiering.ssd.failed:
        body["ssd_error"] = tiering.ssd.failed
    return web.json_response(body, status=200 if body["status"] == "ok" else 503)


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
        "http": {name: {"connections": f.open, "max_connections": f.max_connections, "refused": f.refused,
                        "header_timeouts": f.header_timeouts, "body_timeouts": f.body_timeouts,
                        "malformed": dict(f.malformed), "requests_refused": dict(f.refusals)}
                 for name, f in node.listeners.items()},
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
    """GET /v1/engines: every engine this node knows (in a cluster, every engine of the cluster)
    with its load (every node's leases), `origin` (the node it was registered on through this
    API; null for the config file's), `home` (the node that consumes its KV events; its `feed`
    and `blocks` are that node's figures: read here on the home, as the home last gossiped them
    elsewhere, null when it could not), `kv_node` (where it stores its KV) and `kv_node_state`
    (that node's state as this node sees it: alive, suspect, dead, left, unknown)."""
    node = request.app[NODE]
    control, cluster = node.control, node.cluster
    index = control.index
    out = []
    for e in control.engines.engines.values():
        origin = home = None
        blocks: dict[str, int] | None = None
        kv_node = e.locality or node.node_id
        if cluster is not None:
            origin = cluster.engines.origin(e.id) or None
            home = cluster.engines.home(e.id)
            if home not in (None, node.node_id):
                blocks = cluster.engine_blocks(e.id, home)
            kv_state = cluster.member_state(kv_node)
        else:
            kv_state = "alive" if kv_node == node.node_id else "unknown"
        if home in (None, node.node_id):
            blocks = _blocks_of(index, e.id)
        out.append(engine_view(e, node.node_id) | {
            "in_flight": control.engines.in_flight[e.id], "load": _load(control, e.id),
            "feed": control.feed_view(e.id), "blocks": blocks,
            "node": origin or node.node_id, "origin": origin, "home": home or node.node_id,
            "kv_node_state": kv_state})
    return web.json_response({"node": node.node_id, "cluster": cluster is not None, "engines": out})


def engine_view(e: EngineConfig, node_id: str) -> dict:
    """An engine's config as the API shows it: its keys as POST /v1/engines takes them (`kv_node`,
    where it stores its KV: this node when it names none), its api_key and hash_seed left out (secrets)."""
    out = dataclasses.asdict(e)
    del out["api_key"], out["hash_seed"]
    out["kv_node"] = out.pop("locality") or node_id
    out["lora_modules"] = dict(e.lora_modules)
    return out


def _load(control, engine_id: str) -> dict[str, int]:
    """An engine's leases by what they do: prefills (and their uncached tokens) and decodes."""
    load = control.engines.load(engine_id)
    return {"prefills": load.prefills, "prefill_tokens": load.prefill_tokens, "decodes": load.decodes}


def _blocks_of(index: ResidencyIndex, holder: str) -> dict[str, int]:
    """The blocks the residency index places with `holder`, per tier (tiers it has none in left out)."""
    return {t.value: n for t in CacheTier if (n := index.count(holder, t))}


async def add_engine(request: web.Request) -> web.Response:
    node = request.app[NODE]
    try:
        engine = engine_from(await _body(request), "engine")
    except QuillError as e:
        return _json_error(400, e.message)
    if node.cluster is None:
        new = await node.control.add_engine(engine)
    else:  # the cluster's: known on every node, homed here while this node lives
        new = await node.cluster.engines.register(engine)
        engine = node.control.engines.get(engine.id)
    return web.json_response(engine_view(engine, node.node_id), status=201 if new else 200)


async def delete_engine(request: web.Request) -> web.Response:
    node = request.app[NODE]
    engine_id = request.match_info["engine_id"]
    try:
        if node.cluster is None:
            dropped = await node.control.remove_engine(engine_id)
        else:  # removed on every node
            dropped = await node.cluster.engines.remove(engine_id)
    except QuillError as e:
        return _json_error(404, e.message)
    return web.json_response({"removed": engine_id, "residencies_dropped": dropped})


def decision_json(d: Decision) -> dict[str, Any]:
    """A decision (with an engine) as POST /v1/route's JSON body; `pair` when the engines have roles."""
    out = {"engine": d.engine, "url": d.url, "cost": d.cost, "lease": d.lease,
           "candidates": [c._asdict() for c in d.candidates],
           "plan": [{"action": s.action, "holder": s.holder, "tier": s.tier.value if s.tier else None}
                    for s in d.plan]}
    if d.pair is not None:
        out["pair"] = pair_json(d.pair)
    return out


def pair_json(p: Pair) -> dict[str, Any]:
    """Which engine prefills and which decodes, whether they differ, why and the costs compared."""
    return {"prefill": p.prefill, "prefill_url": p.prefill_url, "prefill_lease": p.prefill_lease,
            "decode": p.decode, "disaggregated": p.disaggregated, "reason": p.reason, "local_us": p.local_us,
            "remote_us": p.remote_us, "transfer_us": p.transfer_us, "transfer_bytes": p.transfer_bytes,
            "uncached_tokens": p.uncached_tokens, "prefill_node": p.prefill_node, "decode_node": p.decode_node}


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
        req, tag = RouteRequest.parse(body), node.scopes.tag(scope)
        salt = None
        if needs_engine_hashing(req):  # the model's engines' own hashing, where their events record blocks
            er = await engine_route(node.control, scope, tag, req, node.salt_key)
            req, tag, salt = er.req, er.tag, er.salt
        if node.cluster is None:
            d = route_in_scope(node.control, scope, tag, req)
        else:  # the same decision on every node: the blocks' residencies from the directory's owners
            d = await node.cluster.route(scope, tag, req)
    except NoDecodeEngine as e:
        return _json_error(503, e.message)
    except QuillError as e:
        return _json_error(400, e.message)
    if d.engine is None:
        return _json_error(503, f"no engine serves model {scope.model!r}")
    out = decision_json(d)
    if salt is not None:
        out["cache_salt"] = salt
    return web.json_response(out)


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
    cluster = node.cluster
    home = None if cluster is None else cluster.engines.home(engine_id)
    if home is not None and home != cluster.node_id:  # the engine's home applies its events
        try:
            applied = await cluster.engines.forward(home, engine_id, raw)
        except QuillError as e:
            return _json_error(503, f"engine {engine_id}'s home node {home}: {e.message}")
        return web.json_response({"engine_id": engine_id, "applied": applied, "home": home})
    return web.json_response({"engine_id": engine_id, "applied": node.control.apply(engine_id, batch)})


async def hot(request: web.Request) -> web.Response:
    """GET /v1/hot: the hottest routed prefixes and who holds each one's first block, from what
    ROUTE on this node scores against: this node's index, or in a cluster the directory's owners."""
    node = request.app[NODE]
    control = node.control
    sketch, index = control.hot, control.index
    top = sketch.top(20)
    if node.cluster is not None:
        held = await node.cluster.hot_holders([control.hot_routes.routed(key) for key, _ in top])
    else:
        held = [{pair for tag in list(index.tag_entries) for pair in index.locate(tag, [key])[0]} for key, _ in top]
    return web.json_response({"total": sketch.total, "top": [
        {"block": key.hex(), "count": n, "holders": [{"holder": h, "tier": t.value} for h, t in sorted(pairs)]}
        for (key, n), pairs in zip(top, held)]})


def _own_figures(node: NodeContext) -> dict[str, Any]:
    """What this node advertises of itself, read now (gossip's copy of it may be a second old)."""
    ks, ssd = node.keyspace, node.tiering
    return {"dram_used": ks.used, "dram_capacity": ks.capacity, "ssd_used": ssd.used if ssd else 0,
            "ssd_capacity": ssd.capacity if ssd else 0, "clients": len(node.clients.connections),
            "version": __version__, "started": int(node.started)}


async def nodes(request: web.Request) -> web.Response:
    """The cluster's members as this node sees them; outside a cluster, the node itself.

    Each member's figures are what it last gossiped: `current` says whether they are (it is
    alive), `state_s` how long it has been in its state (for a dead one: how old its figures
    are), `uptime_s` how long it has run (from the start time it gossips)."""
    node = request.app[NODE]
    now = time.time()
    if node.cluster is None:
        ks = node.keyspace
        meta = standalone_meta(node.cfg.server.bind, node.port, node.admin_port, ks.used, ks.capacity)
        members = [{"id": node.node_id, "state": "alive", "incarnation": 0, "gossip": None, "self": True,
                    "state_s": round(now - node.started, 1), **meta, **_own_figures(node)}]
    else:
        cluster, members = node.cluster, []
        for m in cluster.members_list():
            me = m.node_id == node.node_id
            members.append({"id": m.node_id, "state": m.state.name.lower(), "incarnation": m.incarnation,
                            "gossip": f"{m.addr[0]}:{m.addr[1]}" if cluster.cfg.registry == "gossip" else None,
                            "self": me,
                            "state_s": round(cluster.state_age(m), 1),
                            **(m.meta or {}), **(_own_figures(node) if me else {})})
    for m in members:
        m["current"] = m["state"] == "alive"
        d = m.pop("dir", None)
        if isinstance(d, list) and len(d) == 6:  # the directory's figures the node gossips (cluster.meta)
            m["directory"] = dict(zip(("entries_owned", "handoffs_in_flight", "lookups", "route_owner_round_trips",
                                       "routes", "anti_entropy_repairs"), d))
        if "started" in m:
            m["uptime_s"] = max(0, round(now - m["started"]))
    return web.json_response({"node_id": node.node_id, "nodes": members})


async def history(request: web.Request) -> web.Response:
    """GET /v1/history: the last minutes, a point per interval (history.py), for the status page."""
    return web.json_response(request.app[HISTORY].series())


ROUTES = [
    ("GET", "/", status_page),
    ("GET", "/livez", livez),
    ("GET", "/readyz", readyz),
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
    ("GET", "/v1/history", history),
]


# routes anyone who reaches the port may ask, whatever protected mode and the token say: an
# orchestrator's probes (they say nothing of the node's data)
PROBES = frozenset({"/livez", "/readyz"})
# what answers while the node starts (the other routes answer 503 until it serves)
WHILE_STARTING = PROBES | {"/", "/healthz"}


@web.middleware
async def _started(request: web.Request, handler):
    """Until the node serves (the SSD tier may still be recovering), only WHILE_STARTING answers."""
    node = request.app[NODE]
    if node.phase != SERVING and node.phase != "stopping" and request.path not in WHILE_STARTING:
        return web.json_response({"error": f"the node is starting ({node.phase}): try again"}, status=503,
                                 headers={"Retry-After": "1"})
    return await handler(request)


def _bearer_middleware(token: str, figures: ListenerFigures):
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if (request.method == "GET" and request.path == "/") or request.path in PROBES:
            return await handler(request)  # the status page holds no data: it asks for the token to fetch any
        got = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(got, expected):
            figures.refusals["token"] += 1
            return web.json_response({"error": "missing or wrong bearer token"}, status=401,
                                     headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check


def build_app(node: NodeContext, metrics: NodeMetrics | None = None) -> web.Application:
    """The admin app over `node`; `metrics`: the node's (node.py), or a registry of the app's own.

    Its perimeter, in order: protected mode, the bearer token, what a web page may send
    (perimeter.py), and nothing but WHILE_STARTING until the node serves; listener.py puts
    its own first (the cap, the deadlines). The probes (PROBES) pass them all."""
    figures = node.listeners["admin"]
    middlewares = [loopback_only(node.cfg.server, lambda: node.users.required, lambda m: _json_error(403, m),
                                 figures, PROBES)]
    if node.cfg.admin.token:
        middlewares.append(_bearer_middleware(node.cfg.admin.token, figures))
    middlewares.append(from_this_origin(node.cfg.server, figures, _answer,
                                        credential=lambda: bool(node.cfg.admin.token), json_writes=True,
                                        open_paths=PROBES))
    middlewares.append(_started)
    app = web.Application(middlewares=middlewares)
    app[NODE] = node
    app[METRICS] = metrics = metrics if metrics is not None else NodeMetrics(node)
    app[HISTORY] = History(node, metrics.commands, metrics.peer_fetch, metrics.route)
    app[STATUS_PAGE] = resources.files(__package__).joinpath("status.html").read_bytes()
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
    return app


class AdminServer:
    """The admin app on its port, behind listener.py's cap and deadlines (`admin.*`)."""

    def __init__(self, node: NodeContext, metrics: NodeMetrics | None = None) -> None:
        self.node = node
        self._app = build_app(node, metrics)
        self._listener: Listener | None = None

    async def start(self, host: str, port: int) -> int:
        cfg = self.node.cfg.admin
        budget = http_budget(self.node.cfg, soft_nofile())
        if budget.admin < cfg.max_connections:
            log.warning("admin API: at most %d connections (admin.max_connections is %d): the HTTP listeners "
                        "hold at most a quarter of the descriptor limit (%d)", budget.admin, cfg.max_connections,
                        budget.nofile)
        self._listener = Listener("admin", "admin API", self._app, self.node.listeners["admin"], budget.admin,
                                  cfg.header_timeout_ms / 1000, cfg.body_timeout_ms / 1000, _answer)
        port = await self._listener.start(host, port)
        self._app[HISTORY].start()
        return port

    async def stop(self) -> None:
        await self._app[HISTORY].stop()
        if self._listener is not None:
            await self._listener.stop()


def _answer(status: int, message: str, code: str) -> web.Response:
    """The admin API's own error response (listener.py's refusals)."""
    return _json_error(status, message)
