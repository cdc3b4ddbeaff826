"""Control-plane commands: ROUTE, RELEASE, KVEVENTS.

ROUTE's request comes in four forms: a JSON object, key value pairs, or the hashes
alone with no JSON to decode, `ROUTE HASHES n h1 ... hn [options]` (decimal or hex
arguments) and `ROUTE PACKED <n x 8 bytes, little-endian u64> [options]`; the options
are BLOCK_SIZE s, DECODE_TOKENS t, SESSION id, ACQUIRE and COMPACT. The reply is the
decision's map (a flat array on RESP2), written straight to RESP bytes; with COMPACT,
a five-item array: engine, url, cost, lease and the plan as runs (step, count, ...).

No argument may pass MAX_REQUEST_BYTES (the table's `arg_limit`: refused before it is
read), and a request of more than LARGE_REQUEST bytes is decoded and checked in a worker
thread while the event loop serves other clients; only the decision runs on the loop.

When the model's engines have roles, the map has one more entry, `pair` (`pair_reply`:
which engine prefills and which decodes, whether they differ, why, and the costs
compared), and COMPACT a sixth item, the same map.
"""

from __future__ import annotations

import asyncio
import json
from itertools import groupby
from typing import Any

from quilld.errors import CommandError
from quilld.index.events import decode_json
from quilld.index.pairing import Pair
from quilld.index.route_request import (LARGE_REQUEST, MAX_BLOCKS, MAX_REQUEST_BYTES, RouteRequest, engine_route,
                                        hashes_from_args, hashes_from_packed, needs_engine_hashing, route)
from quilld.index.router import Candidate, Decision, Step
from quilld.model import Pending
from quilld.protocol.commands.common import text
from quilld.protocol.resp import (NULL, BulkCache, EncodedById, Raw, array_header, bulk, double, encode,
                                  integer, map_header)
from quilld.protocol.table import CommandTable

MAX_EVENTS_BYTES = 1024 * 1024  # a KVEVENTS batch, as POST /v1/kv-events's body (aiohttp's client_max_size)
OPTIONS = ("BLOCK_SIZE", "DECODE_TOKENS", "SESSION", "ACQUIRE", "COMPACT")
_INTEGERS = "ROUTE: tokens, block_size and decode_tokens must be integers"


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


def _text_or_nil(s: str | None) -> bytes | None:
    return None if s is None else s.encode()


def pair_reply(p: Pair) -> dict:
    """A decision's prefill-decode pair as a map: the engines, whether they differ, why, the costs compared."""
    return {b"prefill": _text_or_nil(p.prefill), b"prefill_url": _text_or_nil(p.prefill_url),
            b"prefill_lease": _text_or_nil(p.prefill_lease), b"decode": p.decode.encode(),
            b"disaggregated": p.disaggregated, b"reason": p.reason.encode(),
            b"local_us": float(p.local_us), b"remote_us": None if p.remote_us is None else float(p.remote_us),
            b"transfer_us": float(p.transfer_us), b"transfer_bytes": p.transfer_bytes,
            b"uncached_tokens": p.uncached_tokens, b"prefill_node": p.prefill_node.encode(),
            b"decode_node": p.decode_node.encode()}


def decision_reply(d: Decision) -> dict:
    """A decision as ROUTE's map reply (a flat array on RESP2)."""
    chosen = d.engine is not None
    reply = {b"engine": d.engine.encode() if chosen else None,
             b"url": d.url.encode() if chosen else None,
             b"cost": float(d.cost) if chosen else None,
             b"lease": d.lease.encode() if d.lease is not None else None,
             b"plan": [_plan_text(s) for s in d.plan],
             b"candidates": [{b"engine": c.engine.encode(), b"overlap_blocks": c.overlap_blocks,
                              b"credit": float(c.credit), b"cost": float(c.cost), b"in_flight": c.in_flight}
                             for c in d.candidates]}
    if d.pair is not None:
        reply[b"pair"] = pair_reply(d.pair)
    return reply


def _options(args: list, after: str) -> tuple[int, int, str | None, bool, bool]:
    """HASHES' and PACKED's options: (block_size, decode_tokens, session, acquire, compact)."""
    block_size, decode, session, acquire, compact = 16, 0, None, False, False
    i, n = 0, len(args)
    while i < n:
        word = bytes(args[i]).upper()
        if word == b"ACQUIRE":
            acquire = True
        elif word == b"COMPACT":
            compact = True
        elif word in (b"BLOCK_SIZE", b"DECODE_TOKENS", b"SESSION"):
            if i + 1 >= n:
                raise CommandError(f"ROUTE: {word.decode()} needs a value")
            value = bytes(args[i + 1])
            i += 1
            if word == b"SESSION":
                session = text(value) or None
            else:
                try:
                    number = int(value)
                except ValueError:
                    raise CommandError(_INTEGERS) from None
                if word == b"BLOCK_SIZE":
                    block_size = number
                else:
                    decode = number
        else:
            shown = text(bytes(args[i]))[:40]
            raise CommandError(f"ROUTE: unknown option '{shown}' after {after} (options: {', '.join(OPTIONS)})")
        i += 1
    return block_size, decode, session, acquire, compact


def hashes_request(args: list) -> tuple[RouteRequest, bool] | None:
    """ROUTE HASHES n h1 ... hn [options] or ROUTE PACKED bytes [options]: the request and whether
    COMPACT was asked; None for the JSON and key value forms."""
    if len(args) < 2:
        return None
    form = bytes(args[1]).lower()
    if form == b"hashes":
        if len(args) < 3:
            raise CommandError("ROUTE HASHES needs a count: ROUTE HASHES n h1 ... hn [options]")
        raw = bytes(args[2])
        if not raw.isdigit() or len(raw) > 10:
            raise CommandError(f"ROUTE HASHES: the count must be an integer from 0 to {MAX_BLOCKS}")
        n = int(raw)
        if n > MAX_BLOCKS:
            raise CommandError(f"ROUTE: at most {MAX_BLOCKS} blocks")
        if len(args) < 3 + n:
            raise CommandError(f"ROUTE HASHES: {n} hashes announced, {len(args) - 3} given")
        blocks = hashes_from_args(args[3:3 + n])
        rest, after = args[3 + n:], f"the {n} hashes"
    elif form == b"packed":
        if len(args) < 3:
            raise CommandError("ROUTE PACKED needs the packed hashes: ROUTE PACKED <bytes> [options]")
        blocks = hashes_from_packed(args[2])
        rest, after = args[3:], "the packed hashes"
    else:
        return None
    block_size, decode, session, acquire, compact = _options(rest, after)
    return RouteRequest(blocks, block_size, decode, session, acquire), compact


def parse_request(args: list) -> tuple[RouteRequest, bool]:
    """ROUTE's arguments, in any of its forms: the request and whether COMPACT was asked."""
    parsed = hashes_request(args)
    if parsed is None:
        return RouteRequest.parse(route_fields(args)), False
    return parsed


def cmd_route(c, args):
    if sum(map(len, args)) > LARGE_REQUEST:  # decoded and walked off the event loop
        return Pending(_route_large(c, args))
    req, compact = parse_request(args)
    if needs_engine_hashing(req):
        return Pending(_route_engine_hashed(c, req))
    return _answer(c, req, compact, c.tag)


async def _route_large(c, args: list):
    req, compact = await asyncio.to_thread(parse_request, args)
    if needs_engine_hashing(req):
        return await _route_engine_hashed(c, req)
    answer = _answer(c, req, compact, c.tag)
    return await answer.awaitable if answer.__class__ is Pending else answer


async def _route_engine_hashed(c, req: RouteRequest):
    """A prompt the model's engines' own hashing turns into blocks, looked up where their events
    record them; the reply says the cache_salt to send the engine when there is one."""
    er = await engine_route(c.control, c.scope, c.tag, req, c.ctx.salt_key)
    answer = _answer(c, er.req, False, er.tag, er.salt)
    return await answer.awaitable if answer.__class__ is Pending else answer


def _answer(c, req: RouteRequest, compact: bool, tag: bytes, salt: str | None = None) -> Raw | Pending:
    cluster = c.ctx.cluster
    if cluster is None:
        d = route(c.control, c.scope, tag, req)
        return Raw(encode_compact(d, c.resp3) if compact else encode_decision(d, c.resp3, salt))
    scope, resp3 = c.scope, c.resp3

    async def from_directory():  # the blocks' residencies from their owners
        d = await cluster.route(scope, tag, req)
        return Raw(encode_compact(d, resp3) if compact else encode_decision(d, resp3, salt))

    return Pending(from_directory())


# -- the reply, straight to RESP bytes, from the codec's pieces ---------------------------------

_KEYS = {k: bulk(k) for k in (b"engine", b"url", b"cost", b"lease", b"plan", b"candidates", b"overlap_blocks",
                              b"credit", b"in_flight", b"pair", b"cache_salt")}
_DECISION_FIELDS, _CANDIDATE_FIELDS = 6, 5


def _encode_candidate(c: Candidate, resp3: bool) -> bytes:
    engine, overlap, credit, cost, in_flight = c
    return b"".join((map_header(_CANDIDATE_FIELDS, resp3), _KEYS[b"engine"], _texts(engine), _KEYS[b"overlap_blocks"],
                     integer(overlap), _KEYS[b"credit"], double(float(credit), resp3), _KEYS[b"cost"],
                     double(float(cost), resp3), _KEYS[b"in_flight"], integer(in_flight)))


# the router shares the candidates of engines that reuse nothing and the hit steps of each
# engine between requests, so most of a reply is found here
_candidates = EncodedById(_encode_candidate)
_steps = EncodedById(lambda step, resp3: bulk(_plan_text(step)))
_texts = BulkCache()  # engine ids and URLs


def _runs(plan: list[Step]) -> list[tuple[Step, int]]:
    """The plan as (step, how many in a row)."""
    return [(step, len(list(run))) for step, run in groupby(plan)]


def _head(d: Decision, resp3: bool) -> list[bytes]:
    nil = NULL[resp3]
    chosen = d.engine is not None
    return [_texts(d.engine) if chosen else nil, _texts(d.url) if chosen else nil,
            double(float(d.cost), resp3) if chosen else nil,
            bulk(d.lease.encode()) if d.lease is not None else nil]


def encode_decision(d: Decision, resp3: bool, salt: str | None = None) -> bytes:
    """`decision_reply(d)` as resp.encode would write it, built from cached pieces (and
    `cache_salt` last, when the request was hashed with one)."""
    engine, url, cost, lease = _head(d, resp3)
    fields = _DECISION_FIELDS + (d.pair is not None) + (salt is not None)
    out = [map_header(fields, resp3), _KEYS[b"engine"], engine, _KEYS[b"url"], url,
           _KEYS[b"cost"], cost, _KEYS[b"lease"], lease, _KEYS[b"plan"], array_header(len(d.plan))]
    for step, count in _runs(d.plan):  # a step's bulk string is the same in both protocols
        out.append(_steps.one(step, False) * count)
    out += [_KEYS[b"candidates"], array_header(len(d.candidates))]
    out += _candidates.many(d.candidates, resp3)
    if d.pair is not None:
        out.append(_KEYS[b"pair"])
        encode(pair_reply(d.pair), resp3, out)
    if salt is not None:
        out += (_KEYS[b"cache_salt"], bulk(salt.encode()))
    return b"".join(out)


def encode_compact(d: Decision, resp3: bool) -> bytes:
    """ROUTE ... COMPACT: [engine, url, cost, lease, [step, count, step, count, ...]], and the pair's
    map sixth when there is one."""
    runs = _runs(d.plan)
    out = [array_header(5 if d.pair is None else 6), *_head(d, resp3), array_header(2 * len(runs))]
    for step, count in runs:
        out += (_steps.one(step, False), integer(count))
    if d.pair is not None:
        encode(pair_reply(d.pair), resp3, out)
    return b"".join(out)


def cmd_release(c, args):
    return 1 if c.control.engines.release(text(args[1])) else 0


def cmd_kvevents(c, args):
    """KVEVENTS engine-id <json batch>: applied here, or in a cluster on the engine's home node
    (the one that consumes its events: cluster/engines_sync.py), where this node forwards it."""
    control = c.control
    engine_id = text(args[1])
    control.engines.event_sender(engine_id, c.user)
    raw = bytes(args[2])
    try:
        batch = decode_json(raw)
    except CommandError:
        control.stats["kv_malformed"] += 1
        raise
    cluster = c.ctx.cluster
    if cluster is not None:
        home = cluster.engines.home(engine_id)
        if home is not None and home != cluster.node_id:
            return Pending(cluster.engines.forward(home, engine_id, raw))
    return control.apply(engine_id, batch)


def register(t: CommandTable) -> None:
    t.add("route", -2, "", cmd_route, "Chooses the engine that recomputes the least: ROUTE {json} | key value... | "
          "HASHES n h1 ... hn [options] | PACKED <u64le bytes> [options]",
          "quillcache", "0.1.0", arg_limit=MAX_REQUEST_BYTES)
    t.add("release", 2, "", cmd_release, "Ends an in-flight request taken with ROUTE ... ACQUIRE.",
          "quillcache", "0.1.0")
    t.add("kvevents", 3, "", cmd_kvevents, "Applies an engine's KV events: KVEVENTS engine-id <json batch>.",
          "quillcache", "0.1.0", arg_limit=MAX_EVENTS_BYTES)
