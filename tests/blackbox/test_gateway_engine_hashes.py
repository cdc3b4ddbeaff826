"""Issue 30, item 1: the gateway routes on the engine's own block hashes.

Two fake engines of one model (tests/fake_engine.py) behind a real quilld, both naming a Hugging
Face tokenizer directory (tests/fixtures/chat_render/llama31) and vLLM's prefix-cache hashing. One
of them has published, through a real ZMQ socket in vLLM 0.33's wire format (test_kv_events's
Publisher, tests/vllm_schema.py), BlockStored events with the hashes vLLM computes for a prompt:
computed here with quilld.index.engine_hashes (golden-tested against vLLM) from the token ids
chat_render gives (golden-tested against vLLM's renderer). Driven with the official openai client.
"""

from __future__ import annotations

import json
import time

import pytest
import redis
import vllm_schema as vllm
from conftest import ROOT
from test_gateway import gateway, http_json  # noqa: F401 (a fixture: quilld's gateway before fake engines)
from test_kv_events import Publisher

from quillclient import QuillClient
from quilld.index import chat_render
from quilld.index.engine_hashes import EngineHashing, Lora

pytestmark = pytest.mark.timeout(90)

TOKENIZER = ROOT / "tests" / "fixtures" / "chat_render" / "llama31"
BLOCK = 16
SYSTEM = "You are QuillCache's test assistant: answer briefly and name the tier a block is in. " * 6
SEEDS = {"sha256": None, "sha256_cbor": "7", "xxhash": "12345", "xxhash_cbor": "987654321"}


def chat(user: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def shared_blocks(a: list[int], b: list[int]) -> int:
    """Full blocks two prompts share: their common token prefix, in whole blocks."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n // BLOCK


def stored(hashing: EngineHashing, ids: list[int], salt: str | None = None) -> vllm.BlockStored:
    """The BlockStored event vLLM sends once it cached the prompt `ids` (its full blocks, on GPU)."""
    hashes = hashing.block_hashes(ids, cache_salt=salt)
    return vllm.BlockStored(block_hashes=[h.event_form() for h in hashes], parent_block_hash=None,
                            token_ids=ids[:len(hashes) * BLOCK], block_size=BLOCK, lora_id=None,
                            medium=vllm.MEDIUM_GPU, lora_name=None,
                            extra_keys=hashing.event_extra_keys(len(hashes), cache_salt=salt),
                            group_idx=0, kv_cache_spec_kind="full_attention")


def publish_until_applied(pub: Publisher, r: redis.Redis, engine: str, event, timeout: float = 20.0) -> None:
    """Publish `event` until quilld's subscriber applied a batch more than before (a SUB socket misses
    what is sent before it connects; storing the same blocks twice changes nothing)."""
    def batches() -> int:
        line = r.info("router").get(f"kv_engine_{engine}")
        return line["batches"] if isinstance(line, dict) else 0

    before, deadline = batches(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        pub.publish(event)
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            if batches() > before:
                return
            time.sleep(0.05)
    raise AssertionError(f"engine {engine}'s KV events were not applied in {timeout} s")


@pytest.fixture
def publishers():
    pubs = [Publisher(), Publisher()]
    try:
        yield pubs
    finally:
        for p in pubs:
            p.close()


@pytest.mark.parametrize("algo", list(SEEDS))
def test_the_gateway_routes_on_the_engines_own_block_hashes(gateway, publishers, tmp_path, algo):  # noqa: F811
    users = tmp_path / "users"
    users.write_text("alice alice-key\nbob bob-key\n")
    seed = SEEDS[algo]
    keys = {name: {"tokenizer": str(TOKENIZER), "prefix_caching_hash_algo": algo, "block_size": BLOCK,
                   "tenant": "alice", "kv_events": f"tcp://127.0.0.1:{pub.pub_port}",
                   "replay": f"tcp://127.0.0.1:{pub.replay_port}", **({"hash_seed": seed} if seed else {})}
            for name, pub in zip(("e1", "e2"), publishers)}
    gw = gateway([("e1", "m", []), ("e2", "m", [])], "--users-file", str(users), engine_keys=keys)
    gw._auth = {"Authorization": "Bearer alice-key"}
    r = redis.Redis(port=gw.resp_port, username="alice", password="alice-key", protocol=2)
    tok, hashing = chat_render.load(TOKENIZER), EngineHashing(algo, seed, BLOCK)
    alice, bob = gw.client("alice-key"), gw.client("bob-key")

    # chat: e1 cached the prompt of `first` (as vLLM announces it); the gateway finds it there
    first = chat("Which tier holds a block that was just prefilled?")
    ids = tok.chat_token_ids(first)
    full = len(ids) // BLOCK
    assert full >= 8
    publish_until_applied(publishers[0], r, "e1", stored(hashing, ids))
    raw = alice.chat.completions.with_raw_response.create(model="m", messages=first)
    assert raw.headers["x-quillcache-engine"] == "e1"
    assert int(raw.headers["x-quillcache-overlap-blocks"]) == full
    assert "cache_salt" not in gw.engines["e1"].stats()["last"]  # the engine's own tenant: as it came

    # a chat sharing only the system prompt: exactly the full blocks of the shared token prefix
    other = chat("What does ROUTE answer for a prompt nobody has sent?")
    shared = shared_blocks(ids, tok.chat_token_ids(other))
    assert 0 < shared < full
    raw = alice.chat.completions.with_raw_response.create(model="m", messages=other)
    assert raw.headers["x-quillcache-engine"] == "e1"
    assert int(raw.headers["x-quillcache-overlap-blocks"]) == shared

    # another tenant, the very same prompt: none of alice's blocks, and a cache_salt of its own
    raw = bob.chat.completions.with_raw_response.create(model="m", messages=first)
    assert raw.headers["x-quillcache-overlap-blocks"] == "0"
    served = gw.engines[raw.headers["x-quillcache-engine"]].stats()["last"]
    salt = served["cache_salt"]
    assert len(salt) == 64 and SYSTEM not in salt
    # ... and once its engine announces the blocks it cached under that salt, bob is credited for them
    where = 0 if raw.headers["x-quillcache-engine"] == "e1" else 1
    publish_until_applied(publishers[where], r, f"e{where + 1}", stored(hashing, ids, salt))
    raw = bob.chat.completions.with_raw_response.create(model="m", messages=first)
    assert raw.headers["x-quillcache-engine"] == f"e{where + 1}"
    assert int(raw.headers["x-quillcache-overlap-blocks"]) == full
    assert gw.engines[f"e{where + 1}"].stats()["last"]["cache_salt"] == salt  # stable: one scope, one salt
    # alice is not credited for bob's salted blocks on that engine
    if where == 1:
        raw = alice.chat.completions.with_raw_response.create(model="m", messages=first)
        assert raw.headers["x-quillcache-engine"] == "e1"

    # completions: the prompt tokenized as vLLM does (special tokens added)
    prompt = SYSTEM + "Complete this: a block in the pool is"
    pids = tok.prompt_token_ids(prompt)
    assert pids != tok.prompt_token_ids(prompt, add_special_tokens=False)  # the fixture adds a BOS
    pfull = len(pids) // BLOCK
    publish_until_applied(publishers[1], r, "e2", stored(hashing, pids))
    raw = alice.completions.with_raw_response.create(model="m", prompt=prompt)
    assert raw.headers["x-quillcache-engine"] == "e2"
    assert int(raw.headers["x-quillcache-overlap-blocks"]) == pfull
    prefix = SYSTEM + "Something else entirely, about eviction."
    pshared = shared_blocks(pids, tok.prompt_token_ids(prefix))
    assert 0 < pshared < pfull
    raw = alice.completions.with_raw_response.create(model="m", prompt=prefix)
    assert raw.headers["x-quillcache-engine"] == "e2"
    assert int(raw.headers["x-quillcache-overlap-blocks"]) == pshared
    raw = alice.completions.with_raw_response.create(model="m", prompt=pids)  # the same prompt as token ids
    assert int(raw.headers["x-quillcache-overlap-blocks"]) == pfull
    raw = bob.completions.with_raw_response.create(model="m", prompt=prompt)
    assert raw.headers["x-quillcache-overlap-blocks"] == "0"
    s = gw.stats()
    assert s["gateway_engine_hashed"] == s["gateway_requests"] and s["gateway_engine_hash_fallbacks"] == 0, s


def test_requests_not_covered_fall_back_to_the_gateways_own_hashes(gateway, tmp_path):  # noqa: F811
    """A chat with tools is not rendered by quilld: routed on quilld's own hashes, said once."""
    keys = {"e1": {"tokenizer": str(TOKENIZER), "prefix_caching_hash_algo": "sha256", "block_size": BLOCK}}
    gw = gateway([("e1", "m", [])], engine_keys=keys)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    client = gw.client()
    client.chat.completions.create(model="m", messages=chat("x"), tools=tools)
    s = gw.stats()
    assert s["gateway_engine_hash_fallbacks"] == 1 and s["gateway_engine_hashed"] == 0, s
    client.chat.completions.create(model="m", messages=chat("x"))
    assert gw.stats()["gateway_engine_hashed"] == 1


def route_reply(r: redis.Redis, request: dict) -> dict:
    """ROUTE {json}'s map (RESP3), with its keys and texts decoded."""
    def text(v):
        if isinstance(v, bytes):
            return v.decode()
        if isinstance(v, dict):
            return {text(k): text(x) for k, x in v.items()}
        if isinstance(v, list):
            return [text(x) for x in v]
        return v
    return text(r.execute_command("ROUTE", json.dumps(request)))


def overlap(reply: dict, engine: str) -> int:
    return next(c["overlap_blocks"] for c in reply["candidates"] if c["engine"] == engine)


def test_route_hashes_tokens_and_chats_as_the_models_engines_do(gateway, publishers, tmp_path):  # noqa: F811
    """ROUTE and POST /v1/route over token ids, a chat or a prompt, for a model whose engines name
    their hashing: credited for exactly the blocks the engine's events recorded; another tenant is
    told the cache_salt the gateway would send for it, and credited for none of the engine's."""
    users = tmp_path / "users"
    users.write_text("alice alice-key\nbob bob-key\n")
    keys = {name: {"tokenizer": str(TOKENIZER), "prefix_caching_hash_algo": "sha256", "block_size": BLOCK,
                   "tenant": "alice", "kv_events": f"tcp://127.0.0.1:{pub.pub_port}",
                   "replay": f"tcp://127.0.0.1:{pub.replay_port}"}
            for name, pub in zip(("e1", "e2"), publishers)}
    gw = gateway([("e1", "m", []), ("e2", "m", [])], "--users-file", str(users), engine_keys=keys)
    alice, bob = (redis.Redis(port=gw.resp_port, username=u, password=f"{u}-key", protocol=3,
                              single_connection_client=True) for u in ("alice", "bob"))
    for r in (alice, bob):
        assert r.execute_command("SCOPE", "m", "") in (b"OK", "OK")  # the model the connection speaks for
    tok, hashing = chat_render.load(TOKENIZER), EngineHashing("sha256", None, BLOCK)
    first = chat("Which tier holds a block that was just prefilled?")
    ids = tok.chat_token_ids(first)
    full = len(ids) // BLOCK
    publish_until_applied(publishers[0], alice, "e1", stored(hashing, ids))

    for request in ({"messages": first}, {"tokens": ids}, {"tokens": ids, "hashing": "engine"},
                    {"messages": first, "hashing": "engine", "add_generation_prompt": True}):
        d = route_reply(alice, request)
        assert d["engine"] == "e1" and overlap(d, "e1") == full and overlap(d, "e2") == 0, (request, d)
        assert len(d["plan"]) == full and "cache_salt" not in d
    other = chat("What does ROUTE answer for a prompt nobody has sent?")
    d = route_reply(alice, {"messages": other})
    assert overlap(d, "e1") == shared_blocks(ids, tok.chat_token_ids(other)) > 0
    prompt = SYSTEM + "Complete this: a block in the pool is"
    d = route_reply(alice, {"prompt": prompt})
    assert len(d["plan"]) == len(tok.prompt_token_ids(prompt)) // BLOCK
    with QuillClient("127.0.0.1", gw.resp_port, username="alice", password="alice-key").scope("m", "") as client:
        d = client.route(messages=first)  # the Python client: the same request, the same answer
        assert d["engine"] == "e1" and overlap(d, "e1") == full
    # quilld's own chain of the same ids names other blocks: nothing of the engine's
    d = route_reply(alice, {"tokens": ids, "hashing": "quilld"})
    assert overlap(d, "e1") == 0 and len(d["plan"]) == full

    # another tenant: the gateway's salt for it, and none of alice's blocks
    d = route_reply(bob, {"messages": first})
    assert overlap(d, "e1") == 0 and len(d["cache_salt"]) == 64
    raw = gw.client("bob-key").chat.completions.with_raw_response.create(model="m", messages=first)
    served = gw.engines[raw.headers["x-quillcache-engine"]].stats()["last"]
    assert served["cache_salt"] == d["cache_salt"]  # one salt for one scope, whoever computes it
    where = raw.headers["x-quillcache-engine"]
    publish_until_applied(publishers[int(where[1]) - 1], alice, where, stored(hashing, ids, d["cache_salt"]))
    d = route_reply(bob, {"messages": first})
    assert d["engine"] == where and overlap(d, where) == full

    # POST /v1/route: the same, the identity in the body
    status, body = http_json(gw.admin_port, "POST", "/v1/route", {"model": "m", "tenant": "alice", "tokens": ids},
                             headers=gw.admin_headers)
    assert status == 200 and body["engine"] == "e1" and "cache_salt" not in body, body
    status, body = http_json(gw.admin_port, "POST", "/v1/route", {"model": "m", "tenant": "bob", "messages": first},
                             headers=gw.admin_headers)
    assert status == 200 and body["engine"] == where and body["cache_salt"] == d["cache_salt"], body

    # what cannot be hashed as the engines do is refused, saying why
    for request, error in (({"messages": first, "hashing": "quilld"}, "hashed only as the engines hash them"),
                           ({"tokens": ids, "block_size": 32}, "hash blocks of 16 tokens"),
                           ({"messages": first, "tokens": ids}, "one of tokens, messages or prompt"),
                           ({"messages": "hi"}, "messages must be a non-empty list"),
                           ({"tokens": ids, "hashing": "sha1"}, "hashing must be one of auto, quilld, engine")):
        with pytest.raises(redis.ResponseError, match=error):
            alice.execute_command("ROUTE", json.dumps(request))
    status, body = http_json(gw.admin_port, "POST", "/v1/route", {"model": "none", "messages": first},
                             headers=gw.admin_headers)
    assert status == 400 and "no engine of model 'none' names its own hashing" in body["error"], body


def test_a_lora_request_is_hashed_with_the_adapters_path_the_engine_names(gateway, publishers, tmp_path):  # noqa: F811
    """vLLM's hash of a LoRA block includes the path the adapter was loaded from: with the engine's
    lora_modules, `m:sql` at the gateway and ROUTE in the adapter's scope are credited for exactly the
    blocks the engine's events recorded for it; an adapter it does not name falls back, said once."""
    keys = {"e1": {"tokenizer": str(TOKENIZER), "prefix_caching_hash_algo": "sha256", "block_size": BLOCK,
                   "kv_events": f"tcp://127.0.0.1:{publishers[0].pub_port}",
                   "replay": f"tcp://127.0.0.1:{publishers[0].replay_port}",
                   "lora_modules": ["sql=/models/sql-lora"]}}  # vLLM's --lora-modules form
    gw = gateway([("e1", "m", ["--lora", "sql", "--lora", "other"])], engine_keys=keys)
    r = redis.Redis(port=gw.resp_port, protocol=3, single_connection_client=True)
    tok, hashing = chat_render.load(TOKENIZER), EngineHashing("sha256", None, BLOCK)
    lora = Lora("sql", "/models/sql-lora")
    first = chat("Write the SQL that lists every block in the pool.")
    ids = tok.chat_token_ids(first)
    full = len(ids) // BLOCK
    hashes = hashing.block_hashes(ids, lora=lora)
    assert hashes != hashing.block_hashes(ids)  # the adapter's blocks are its own
    event = vllm.BlockStored(block_hashes=[h.event_form() for h in hashes], parent_block_hash=None,
                             token_ids=ids[:full * BLOCK], block_size=BLOCK, lora_id=1, medium=vllm.MEDIUM_GPU,
                             lora_name="sql", extra_keys=hashing.event_extra_keys(full, lora=lora), group_idx=0,
                             kv_cache_spec_kind="full_attention")
    publish_until_applied(publishers[0], r, "e1", event)

    client = gw.client()
    raw = client.chat.completions.with_raw_response.create(model="m:sql", messages=first)
    assert int(raw.headers["x-quillcache-overlap-blocks"]) == full
    assert gw.engines["e1"].stats()["last"]["model"] == "sql"  # sent to the engine as vLLM names the adapter
    raw = client.chat.completions.with_raw_response.create(model="m", messages=first)
    assert raw.headers["x-quillcache-overlap-blocks"] == "0"  # the base model's blocks are others
    assert r.execute_command("SCOPE", "m", "", "sql") in (b"OK", "OK")
    d = route_reply(r, {"messages": first})
    assert overlap(d, "e1") == full
    s = gw.stats()
    assert s["gateway_engine_hashed"] == 2 and s["gateway_engine_hash_fallbacks"] == 0, s
    client.chat.completions.create(model="m:other", messages=first)  # no path for it: quilld's own hashes
    assert gw.stats()["gateway_engine_hash_fallbacks"] == 1
    assert r.execute_command("SCOPE", "m", "", "other") in (b"OK", "OK")
    with pytest.raises(redis.ResponseError, match="LoRA adapter 'other': .*name it in the engine's lora_modules"):
        r.execute_command("ROUTE", json.dumps({"messages": first}))
    status, body = http_json(gw.admin_port, "GET", "/v1/engines", headers=gw.admin_headers)
    assert body["engines"][0]["lora_modules"] == {"sql": "/models/sql-lora"}


def test_an_engine_whose_events_carry_digest_bytes_is_credited_the_same(gateway, publishers, tmp_path):  # noqa: F811
    """VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 on the engine, kv_event_hashes = "bytes" in its table: the
    gateway's and ROUTE's hashes are the digests the events carry."""
    keys = {"e1": {"tokenizer": str(TOKENIZER), "prefix_caching_hash_algo": "sha256_cbor", "hash_seed": "7",
                   "block_size": BLOCK, "kv_event_hashes": "bytes",
                   "kv_events": f"tcp://127.0.0.1:{publishers[0].pub_port}",
                   "replay": f"tcp://127.0.0.1:{publishers[0].replay_port}"}}
    gw = gateway([("e1", "m", [])], engine_keys=keys)
    r = redis.Redis(port=gw.resp_port, protocol=3, single_connection_client=True)
    tok, hashing = chat_render.load(TOKENIZER), EngineHashing("sha256_cbor", "7", BLOCK)
    first = chat("Which tier holds a block that was just prefilled?")
    ids = tok.chat_token_ids(first)
    full = len(ids) // BLOCK
    hashes = hashing.block_hashes(ids)
    event = vllm.BlockStored(block_hashes=[bytes(h) for h in hashes], parent_block_hash=None,
                             token_ids=ids[:full * BLOCK], block_size=BLOCK, lora_id=None, medium=vllm.MEDIUM_GPU,
                             lora_name=None, extra_keys=None, group_idx=0, kv_cache_spec_kind="full_attention")
    publish_until_applied(publishers[0], r, "e1", event)
    raw = gw.client().chat.completions.with_raw_response.create(model="m", messages=first)
    assert int(raw.headers["x-quillcache-overlap-blocks"]) == full
    assert r.execute_command("SCOPE", "m", "") in (b"OK", "OK")
    assert overlap(route_reply(r, {"messages": first}), "e1") == full
    status, body = http_json(gw.admin_port, "GET", "/v1/engines", headers=gw.admin_headers)
    check = body["engines"][0]["feed"]["hash_check"]
    assert check["agreed"] == full and check["cause"] is None, check
