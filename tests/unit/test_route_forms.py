"""ROUTE's hash forms (HASHES, PACKED), its COMPACT reply and its reply encoder, through the real
command table on a real control plane: the same request in any form gets the same decision, and
malformed requests get clear errors."""

from __future__ import annotations

import asyncio
import json
import math
import random
import struct

import hiredis
import pytest

from handler_context import make_context, session
from quilld.config import EngineConfig
from quilld.errors import CommandError
from quilld.index.events import Batch, Stored
from quilld.index.route_request import LARGE_REQUEST, MAX_BLOCKS, MAX_REQUEST_BYTES, RouteRequest
from quilld.index.router import Candidate, Decision, Step
from quilld.model import CacheTier, Pending
from quilld.protocol.commands.route import MAX_EVENTS_BYTES, decision_reply, encode_compact, encode_decision
from quilld.protocol.resp import Raw, encode

ENGINES = ("e0", "e1", "e2", "e3")
U64 = (1 << 64) - 1
MEDIA = ("GPU", "CPU", "STORAGE")


@pytest.fixture
def routed():
    """A context with four engines of model m holding random prefixes of 40 chains, and a
    session scoped to m."""
    ctx = make_context()
    control = ctx.control
    for e in ENGINES:
        control.engines.add(EngineConfig(id=e, url=f"http://127.0.0.1:90{e[1:]}", model="m"))
    s = session(ctx)
    assert ctx.table.dispatch(s, [b"SCOPE", b"m", b""]) == b"OK"
    rng = random.Random(11)
    chains = []
    for _ in range(40):
        chain = [rng.getrandbits(64) for _ in range(rng.randint(1, 12))]
        chains.append(chain)
        for e in rng.sample(ENGINES, rng.randint(0, 3)):
            keep = rng.randint(1, len(chain))
            control.apply(e, Batch(0.0, (Stored(tuple(chain[:keep]), None, (), 16, None, rng.choice(MEDIA)),),
                                   None, None))
    for chain in chains[:10]:  # a pool copy of some blocks on this node
        for h in chain[:3]:
            control.index.put(s.tag, h, "n1", "dram")
    control.pool = ["n1"]
    return ctx, s, chains


def call(ctx, s, *args):
    """The reply to one command; a deferred one (a large ROUTE, decoded off the loop) is waited for."""
    reply = ctx.table.dispatch(s, [a if isinstance(a, bytes) else str(a).encode() for a in args])
    if type(reply) is Pending:
        reply = asyncio.run(reply.awaitable)
    if isinstance(reply, CommandError):
        raise reply
    return reply


def parse(raw: bytes):
    reader = hiredis.Reader()
    reader.feed(raw)
    return reader.gets()


def packed(hashes) -> bytes:
    return struct.pack(f"<{len(hashes)}Q", *(h & U64 for h in hashes))


@pytest.mark.parametrize("resp3", [False, True])
def test_every_form_gets_the_json_forms_decision(routed, resp3):
    ctx, s, chains = routed
    s.resp3 = resp3
    rng = random.Random(5)
    for i in range(60):
        chain = list(rng.choice(chains))
        if rng.random() < 0.3:
            chain.append(rng.getrandbits(64))  # a block nobody holds
        if rng.random() < 0.3:
            chain = [h - (1 << 64) if h >= 1 << 63 else h for h in chain]  # the same hashes, signed
        decode, block_size = rng.choice([0, 5, 64]), rng.choice([16, 8])
        session_id = f"s{i % 7}" if rng.random() < 0.5 else None
        options = ["BLOCK_SIZE", block_size, "DECODE_TOKENS", decode]
        body = {"blocks": chain, "block_size": block_size, "decode_tokens": decode}
        replies = []
        for form in ("json", "hashes", "hex", "packed"):  # each form under its own sessions
            sid = [] if session_id is None else ["SESSION", f"{form}-{session_id}"]
            if form == "json":
                replies.append(call(ctx, s, "ROUTE", json.dumps(
                    body | ({"session": f"{form}-{session_id}"} if session_id else {}))))
            elif form == "hashes":
                replies.append(call(ctx, s, "ROUTE", "HASHES", len(chain), *chain, *options, *sid))
            elif form == "hex":
                replies.append(call(ctx, s, "ROUTE", "hashes", len(chain), *(f"{h & U64:016x}" for h in chain),
                                    *options, *sid))
            else:
                replies.append(call(ctx, s, "ROUTE", "PACKED", packed(chain), *options, *sid))
        assert all(type(r) is Raw for r in replies)
        assert replies[1:] == replies[:1] * 3, i  # byte for byte: one decision, one rendering


def test_acquire_and_compact(routed):
    ctx, s, chains = routed
    chain = chains[0]
    full = parse(call(ctx, s, "ROUTE", "PACKED", packed(chain)))
    engine, url, cost, lease, runs = parse(call(ctx, s, "ROUTE", "PACKED", packed(chain), "COMPACT", "ACQUIRE"))
    assert [engine, url, float(cost)] == [full[1], full[3], float(full[5])]
    plan = [step for step, n in zip(runs[::2], runs[1::2]) for _ in range(n)]
    assert plan == full[9] and len(runs) < 2 * len(plan) + 1
    assert ctx.control.engines.in_flight[engine.decode()] == 1
    assert call(ctx, s, "RELEASE", lease) == 1
    s.resp3 = True
    compact = parse(call(ctx, s, "ROUTE", "HASHES", len(chain), *chain, "compact"))
    assert compact[:3] == [engine, url, float(cost)] and compact[3] is None


def test_no_engine_for_the_model(routed):
    ctx, s, _ = routed
    call(ctx, s, "SCOPE", "another-model", "")
    assert parse(call(ctx, s, "ROUTE", "HASHES", 2, 1, 2, "COMPACT")) == [None, None, None, None, []]
    assert parse(call(ctx, s, "ROUTE", "PACKED", b""))[:2] == [b"engine", None]


@pytest.mark.parametrize("args, message", [
    (["HASHES"], "ROUTE HASHES needs a count: ROUTE HASHES n h1 ... hn [options]"),
    (["HASHES", "two", 1, 2], f"ROUTE HASHES: the count must be an integer from 0 to {MAX_BLOCKS}"),
    (["HASHES", "-1"], f"ROUTE HASHES: the count must be an integer from 0 to {MAX_BLOCKS}"),
    (["HASHES", MAX_BLOCKS + 1, 1], f"ROUTE: at most {MAX_BLOCKS} blocks"),
    (["HASHES", 3, 1, 2], "ROUTE HASHES: 3 hashes announced, 2 given"),
    (["HASHES", 1, 1, 2], "ROUTE: unknown option '2' after the 1 hashes (options: BLOCK_SIZE, DECODE_TOKENS, "
                          "SESSION, ACQUIRE, COMPACT)"),
    (["HASHES", 2, 1, "zz"], "ROUTE: hash 2: bad block hash 'zz': an integer or a hex string"),
    (["HASHES", 1, str(1 << 64)], "ROUTE: hash 1: block hashes that are integers must fit in 64 bits"),
    (["HASHES", 1, "\N{SUPERSCRIPT TWO}"], "ROUTE: hash 1 is not an integer or a hex string"),
    (["HASHES", 2, 1, ""], "ROUTE: hash 2 is not an integer or a hex string"),
    (["PACKED"], "ROUTE PACKED needs the packed hashes: ROUTE PACKED <bytes> [options]"),
    (["PACKED", b"\x00" * 12], "ROUTE PACKED: 12 bytes is not a whole number of 8-byte hashes"),
    (["PACKED", b"\x00" * 8 * (MAX_BLOCKS + 1)], f"ROUTE: at most {MAX_BLOCKS} blocks"),
    (["PACKED", b"\x00" * 8, "WITHSCORES"], "ROUTE: unknown option 'WITHSCORES' after the packed hashes"),
    (["PACKED", b"\x00" * 8, "DECODE_TOKENS"], "ROUTE: DECODE_TOKENS needs a value"),
    (["PACKED", b"\x00" * 8, "DECODE_TOKENS", "1.5"], "ROUTE: tokens, block_size and decode_tokens must be "
                                                      "integers"),
    (["HASHES", 0, "BLOCK_SIZE", "x"], "ROUTE: tokens, block_size and decode_tokens must be integers"),
])
def test_malformed_requests_get_clear_errors(routed, args, message):
    ctx, s, _ = routed
    with pytest.raises(CommandError) as e:
        call(ctx, s, "ROUTE", *args)
    assert e.value.message.startswith(message)
    assert ctx.control.stats["routes"] == 0  # nothing was routed


def random_decision(rng: random.Random) -> Decision:
    engines = [f"engine-{i}" for i in range(rng.randint(0, 5))]
    steps = [Step("hit", "engine-1", CacheTier.HBM), Step("hit", "engine-1", CacheTier.STORAGE),
             Step("fetch", "node-a", CacheTier.DRAM), Step("fetch", "node-b", CacheTier.SSD), Step("recompute")]
    if not engines:
        return Decision(None, math.inf, [], [Step("recompute")] * rng.randint(0, 3))
    floats = [0.0, 0.25, 1.5, 1e-7, 123456789.125, 1 / 3, math.inf]
    candidates = [Candidate(e, rng.randint(0, 9), rng.choice(floats), rng.choice(floats), rng.randint(0, 3))
                  for e in engines]
    plan = [rng.choice(steps) for _ in range(rng.randint(0, 20))]
    plan.sort(key=lambda st: st.action == "recompute")
    return Decision(rng.choice(engines), rng.choice(floats), candidates, plan, "http://h:1",
                    rng.choice([None, "0123456789abcdef"]))


@pytest.mark.parametrize("resp3", [False, True])
def test_the_reply_encoder_writes_what_the_generic_encoder_writes(resp3):
    rng = random.Random(3)
    for _ in range(300):
        d = random_decision(rng)
        out: list = []
        encode(decision_reply(d), resp3, out)
        assert encode_decision(d, resp3) == b"".join(out)
        compact = parse(encode_compact(d, resp3))
        full = decision_reply(d)
        assert compact[:4] == [full[b"engine"], full[b"url"], parse(b"".join(
            (encode(full[b"cost"], resp3, o := []), o)[1])), full[b"lease"]]
        runs = compact[4]
        assert [st for st, n in zip(runs[::2], runs[1::2]) for _ in range(n)] == full[b"plan"]


def test_command_docs_describe_the_hash_forms(routed):
    ctx, s, _ = routed
    docs = parse(bytes(call(ctx, s, "COMMAND", "DOCS", "route")))
    text = repr(docs)
    for word in ("HASHES", "PACKED", "BLOCK_SIZE", "DECODE_TOKENS", "SESSION", "ACQUIRE", "COMPACT"):
        assert f"b'{word}'" in text, word


def test_a_large_request_is_decoded_off_the_loop_and_gets_the_same_decision(routed):
    """Issue 19.7: a request of more than LARGE_REQUEST bytes is decoded and checked in a worker
    thread (a deferred reply); its decision is the one the small forms get."""
    ctx, s, chains = routed
    chain = chains[3]
    padded = json.dumps({"blocks": chain, "session": "x"}) + " " * LARGE_REQUEST  # JSON allows the blanks
    small = call(ctx, s, "ROUTE", json.dumps({"blocks": chain, "session": "y"}))
    deferred = ctx.table.dispatch(s, [b"ROUTE", padded.encode()])
    assert type(small) is Raw and type(deferred) is Pending
    assert asyncio.run(deferred.awaitable) == small
    with pytest.raises(CommandError, match=f"at most {MAX_BLOCKS} blocks"):
        call(ctx, s, "ROUTE", json.dumps({"blocks": list(range(MAX_BLOCKS + 1))}))


@pytest.mark.parametrize("field, items", [("blocks", [{"not": "a hash"}]), ("tokens", ["not a token"])])
def test_the_count_is_checked_before_any_item_is_walked(field, items):
    """The 32 MiB request of issue 19.7 was walked whole (every hash parsed) before its count was
    refused; the count comes first, so its items are never looked at."""
    with pytest.raises(CommandError, match=f"^ROUTE: at most {MAX_BLOCKS} blocks"):
        RouteRequest.parse({field: items * (MAX_BLOCKS * 16 + 16)})


def test_route_declares_the_size_of_its_arguments():
    """The table says how large a ROUTE argument may be; the server shell refuses a longer one
    before reading it (tests/blackbox/test_route.py sends one)."""
    table = make_context().table
    assert table.lookup(b"route").arg_limit == MAX_REQUEST_BYTES
    assert table.lookup(b"kvevents").arg_limit == MAX_EVENTS_BYTES  # as POST /v1/kv-events's body
    assert len(json.dumps({"blocks": [U64] * MAX_BLOCKS})) < MAX_REQUEST_BYTES  # every block-hash request fits
