"""Control-plane commands: ROUTE, RELEASE, KVEVENTS."""

from __future__ import annotations

import json
from typing import Any

from quilld.errors import CommandError
from quilld.index.events import decode_json
from quilld.index.route_request import RouteRequest, route
from quilld.index.router import Decision, Step
from quilld.protocol.commands.common import text
from quilld.protocol.table import CommandTable


def route_fields(args: list[bytes]) -> dict[str, Any]:
    """The fields of ROUTE {json} or ROUTE key value [key value ...]; lists are comma-separated."""
    if len(args) == 2 and args[1].lstrip()[:1] == b"{":
        try:
            return json.loads(args[1])  # valid JSON that starts with `{` is an object
        except (ValueError, RecursionError) as e:
            raise CommandError(f"ROUTE: invalid JSON: {e}") from None
    if len(args) % 2 == 0:
        raise CommandError("ROUTE takes a JSON object or key value pairs")
    req: dict[str, Any] = {}
    for k, v in zip(args[1::2], args[2::2]):
        key, value = text(k).lower(), text(v)
        req[key] = value.split(",") if key in ("blocks", "tokens") and value else value
    return req


def _plan_text(step: Step) -> bytes:
    if step.action == "recompute":
        return b"recompute"
    return f"{step.action}:{step.holder}:{step.tier.value}".encode()


def decision_reply(d: Decision) -> dict:
    """A decision as ROUTE's map reply (a flat array on RESP2)."""
    chosen = d.engine is not None
    return {b"engine": d.engine.encode() if chosen else None,
            b"url": d.url.encode() if chosen else None,
            b"cost": float(d.cost) if chosen else None,
            b"lease": d.lease.encode() if d.lease is not None else None,
            b"plan": [_plan_text(s) for s in d.plan],
            b"candidates": [{b"engine": c.engine.encode(), b"overlap_blocks": c.overlap_blocks,
                             b"credit": float(c.credit), b"cost": float(c.cost), b"in_flight": c.in_flight}
                            for c in d.candidates]}


def cmd_route(c, args):
    return decision_reply(route(c.control, c.scope, c.tag, RouteRequest.parse(route_fields(args))))


def cmd_release(c, args):
    return 1 if c.control.engines.release(text(args[1])) else 0


def cmd_kvevents(c, args):
    control = c.control
    engine_id = text(args[1])
    control.engines.get(engine_id)
    try:
        batch = decode_json(bytes(args[2]))
    except CommandError:
        control.stats["kv_malformed"] += 1
        raise
    return control.apply(engine_id, batch)


def register(t: CommandTable) -> None:
    t.add("route", -2, "", cmd_route, "Chooses the engine that recomputes the least: ROUTE {json} | key value...",
          "quillcache", "0.1.0")
    t.add("release", 2, "", cmd_release, "Ends an in-flight request taken with ROUTE ... ACQUIRE.",
          "quillcache", "0.1.0")
    t.add("kvevents", 3, "", cmd_kvevents, "Applies an engine's KV events: KVEVENTS engine-id <json batch>.",
          "quillcache", "0.1.0")
