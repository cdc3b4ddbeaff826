"""Control-plane commands: ROUTE, RELEASE, KVEVENTS."""

from __future__ import annotations

import json
from typing import Any

from quilld.protocol.commands.common import block_hash, text
from quilld.errors import CommandError
from quilld.index.events import decode_json
from quilld.protocol.table import CommandTable

_MAX_BLOCKS = 1 << 16


def parse_route_request(args: list[bytes]) -> dict[str, Any]:
    """ROUTE {json} or ROUTE key value [key value ...]; lists are comma-separated."""
    if len(args) == 2 and args[1].lstrip()[:1] == b"{":
        try:
            req = json.loads(args[1])
        except ValueError as e:
            raise CommandError(f"ROUTE: invalid JSON: {e}") from None
        if not isinstance(req, dict):
            raise CommandError("ROUTE: the JSON request must be an object")
        return req
    if len(args) % 2 == 0:
        raise CommandError("ROUTE takes a JSON object or key value pairs")
    req: dict[str, Any] = {}
    for k, v in zip(args[1::2], args[2::2]):
        key, value = text(k).lower(), text(v)
        req[key] = value.split(",") if key in ("blocks", "tokens") and value else value
    return req


def route_request(control, session, req: dict[str, Any]) -> dict[str, Any]:
    """Validate a ROUTE request (from RESP or HTTP) and route it in the caller's scope."""
    known = {"blocks", "tokens", "block_size", "decode_tokens", "session", "acquire"}
    unknown = set(req) - known
    if unknown:
        raise CommandError(f"ROUTE: unknown field(s) {', '.join(sorted(unknown))}")
    try:
        if "tokens" in req:
            from quilld.index.control import chain_hashes

            block_size = int(req.get("block_size", 16))
            tokens = [int(t) for t in req["tokens"]]
            if block_size <= 0:
                raise ValueError("block_size")
            blocks = chain_hashes(tokens, block_size)
        else:
            block_size = int(req.get("block_size", 16))
            blocks = [block_hash(h) for h in req.get("blocks", [])]
        decode = int(req.get("decode_tokens", 0))
    except (TypeError, ValueError):
        raise CommandError("ROUTE: tokens, block_size and decode_tokens must be integers") from None
    if len(blocks) > _MAX_BLOCKS:
        raise CommandError(f"ROUTE: at most {_MAX_BLOCKS} blocks")
    acquire = str(req.get("acquire", "")).lower() in ("1", "true", "yes")
    sess = req.get("session") or None
    return control.route(session.scope, session.tag, blocks, decode / max(block_size, 1),
                         str(sess) if sess else None, acquire)


def _plan_text(step) -> bytes:
    if step.action == "recompute":
        return b"recompute"
    return f"{step.action}:{step.holder}:{step.tier.value}".encode()


def decision_reply(d: dict[str, Any]) -> dict:
    out = {b"engine": d["engine"].encode() if d["engine"] else None,
           b"url": d.get("url", "").encode() if d["engine"] else None,
           b"cost": float(d["cost"]) if d["engine"] else None,
           b"lease": d["lease"].encode() if "lease" in d else None,
           b"plan": [_plan_text(s) for s in d["plan"]],
           b"candidates": [{b"engine": c.engine.encode(), b"overlap_blocks": c.overlap_blocks,
                            b"credit": float(c.credit), b"cost": float(c.cost), b"in_flight": c.in_flight}
                           for c in d["candidates"]]}
    return out


def cmd_route(c, args):
    return decision_reply(route_request(c.node.control, c, parse_route_request(args)))


def cmd_release(c, args):
    return 1 if c.node.control.engines.release(text(args[1])) else 0


def cmd_kvevents(c, args):
    control = c.node.control
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
