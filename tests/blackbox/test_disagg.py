"""Disaggregated prefill and decode through a real quilld (issue 21): roles, ROUTE's pair, the gateway
running vLLM's proxy protocol, the KV handed over through quilld, and the prefetch between nodes.

The engines are tests/fake_kv_engine.py processes doing the real data work: a prefill
engine writes deterministic KV bytes for every block of the prompt into quilld through
quillclient (index/handoff.py's key scheme, PUT2PHASE ... HASH) and answers with
kv_transfer_params; a decode engine reads every block back, checks every byte, and counts
what it loaded, recomputed (missing) or found corrupt. The client is the official `openai`
package, streaming and not, on /v1/chat/completions and /v1/completions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import crc32c
import openai
import pytest
import redis
from conftest import ROOT, free_gossip_port, free_port, http, start_quilld, stop_process, wait_port, wait_until
from quillclient import QuillClient

from quilld.http.prompt_blocks import chunk_hashes, render_chat
from quilld.index.handoff import kv_key

pytestmark = pytest.mark.timeout(90)

ENGINE = ROOT / "tests" / "fake_kv_engine.py"
SYSTEM = "You are QuillCache's disaggregation test assistant. " * 50  # ~2600 characters: 10 blocks of 256
BLOCK_BYTES = 32 * 1024
HTTP_TIMEOUT = 20.0


@dataclass
class Engine:
    name: str
    port: int
    proc: subprocess.Popen

    def stats(self) -> dict:
        status, _, body = http(self.port, "GET", "/stats")
        assert status == 200
        return json.loads(body)

    def control(self, **settings) -> None:
        status, _, body = http(self.port, "POST", "/control", json.dumps(settings).encode(),
                               {"Content-Type": "application/json"})
        assert status == 200, body


class Setup:
    """Nodes (each a quilld; the first runs the gateway), KV fake engines registered on the first."""

    def __init__(self, tmp_path) -> None:
        self.tmp_path = tmp_path
        self.nodes: dict[str, object] = {}
        self.engines: dict[str, Engine] = {}
        self.gw_port = 0
        self.procs: list[subprocess.Popen] = []

    def node(self, name: str, *flags: str, env: dict | None = None, gateway: bool = False):
        for attempt in range(3):
            gw = free_port() if gateway else 0
            extra = ["--node-id", name, "--dram", "64MiB", *flags] + (["--gateway-port", str(gw)] if gateway else [])
            q = start_quilld(self.tmp_path, *extra, env=env)
            self.procs.append(q.proc)
            if not gateway:
                break
            try:
                wait_port(gw, q.proc)
                self.gw_port = gw
                break
            except (RuntimeError, TimeoutError):
                stop_process(q.proc)
                if attempt == 2 or "in use" not in q.log():
                    raise
        self.nodes[name] = q
        return q

    def engine(self, name: str, role: str, node: str = "a", *args: str, register: bool = True,
               locality: str = "", keys: dict | None = None) -> Engine:
        port = free_port()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(ROOT / p) for p in ("", "wire", "clients/python")))
        with open(self.tmp_path / f"engine-{name}.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, str(ENGINE), "--port", str(port), "--model", "m", "--name", name,
                                     "--role", role, "--quilld", f"127.0.0.1:{self.nodes[node].port}",
                                     "--tokenizer", "t", "--block-bytes", str(BLOCK_BYTES), *args],
                                    stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append(proc)
        try:
            wait_port(port, proc)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"{name}: {e}\n" + (self.tmp_path / f"engine-{name}.log").read_text()) from None
        self.engines[name] = Engine(name, port, proc)
        if register:
            status, body = self.admin("POST", "/v1/engines", {"id": name, "url": f"http://127.0.0.1:{port}",
                                                              "model": "m", "tokenizer": "t", "role": role,
                                                              "locality": locality} | (keys or {}))
            assert status == 201, body
        return self.engines[name]

    def admin(self, method: str, path: str, body=None) -> tuple[int, dict]:
        status, _, raw = http(self.nodes["a"].admin_port, method, path,
                              None if body is None else json.dumps(body).encode(), {"Content-Type": "application/json"})
        return status, json.loads(raw)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.gw_port}/v1", api_key="unused", max_retries=0,
                             timeout=HTTP_TIMEOUT)

    def gw_stats(self) -> dict:
        status, _, raw = http(self.gw_port, "GET", "/v1/quillcache/stats")
        assert status == 200
        return json.loads(raw)

    def close(self) -> None:
        for proc in self.procs:
            stop_process(proc)


@pytest.fixture
def setup(tmp_path):
    s = Setup(tmp_path)
    try:
        yield s
    finally:
        s.close()


ALWAYS = {"QUILLD_ROUTER_DISAGGREGATION": "always"}


def messages(user: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def prompt_blocks(msgs: list[dict]) -> int:
    return len(chunk_hashes(render_chat(msgs), 256))


def kv(engine: Engine) -> dict:
    return engine.stats()["kv"]


# -- the protocol, end to end -------------------------------------------------------------
def test_chat_and_completions_streamed_or_not_go_prefill_then_decode_with_the_kv_byte_for_byte(setup):
    setup.node("a", gateway=True, env=ALWAYS)
    p, d = setup.engine("p1", "prefill"), setup.engine("d1", "decode")
    client = setup.client()
    expected_blocks = 0
    for i, (kind, stream) in enumerate([("chat", False), ("chat", True), ("completions", False),
                                        ("completions", True)]):
        msgs = messages(f"question {i}")
        if kind == "chat":
            call = client.chat.completions.with_streaming_response.create(model="m", messages=msgs, stream=stream,
                                                                          max_tokens=16)
            blocks = prompt_blocks(msgs)
        else:
            text = SYSTEM + f" question {i}"
            call = client.completions.with_streaming_response.create(model="m", prompt=text, stream=stream,
                                                                     max_tokens=16)
            blocks = len(chunk_hashes(text, 256))
        with call as response:
            h = response.headers  # before any byte of the body is read
            assert (h["x-quillcache-prefill-engine"], h["x-quillcache-decode-engine"], h["x-quillcache-engine"],
                    h["x-quillcache-disaggregated"]) == ("p1", "d1", "d1", "true"), dict(h)
            assert h["x-quillcache-pair"].startswith("always: local ")
            assert f"blocks={blocks} resident={blocks} late=0" in h["x-quillcache-handoff"]
            # the prefill engine's plan: the first prompt of each kind is new to it, the second is in its HBM
            assert h["x-quillcache-plan"] == (f"hits=0 fetches=0 recomputes={blocks}" if i % 2 == 0
                                              else f"hits={blocks} fetches=0 recomputes=0")
            body = response.parse()
            if stream:
                pieces = [(c.choices[0].delta.content or "") if kind == "chat" else c.choices[0].text
                          for c in body if c.choices]
                text_out = "".join(pieces)
            else:
                text_out = body.choices[0].message.content if kind == "chat" else body.choices[0].text
                assert body.model_extra["quillcache_kv"] == {"loaded": blocks, "recomputed": 0, "corrupt": 0}
        assert text_out.startswith("served by d1")
        expected_blocks += blocks
        got = kv(d)
        assert got["loaded"] == expected_blocks and got["recomputed"] == 0 and got["corrupt"] == 0, got
    pstats, dstats = p.stats(), d.stats()
    assert pstats["kv"]["prefills"] == 4 and pstats["kv"]["misrouted"] == 0
    last_prefill = pstats["last"]  # vLLM's proxy: one token, not streamed, do_remote_decode
    assert last_prefill["max_tokens"] == 1 and last_prefill["stream"] is False
    assert last_prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert dstats["kv"]["decodes"] == 4 and dstats["kv"]["aggregated"] == 0
    params = dstats["last_kv_params"]  # what the prefill answered, and do_remote_prefill
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "p1"
    assert params["remote_port"] == p.port and dstats["last"].get("max_tokens") == 16, dstats["last"]
    stats = setup.gw_stats()
    assert stats["gateway_disaggregated"] == 4 and stats["gateway_handoff_on_time"] == 4
    assert stats["gateway_handoff_missing"] == 0 and stats["gateway_handoff_blocks"] == expected_blocks


def test_auto_keeps_a_short_prompt_on_the_decode_engine_and_says_why(setup):
    setup.node("a", gateway=True)
    p, d = setup.engine("p1", "prefill"), setup.engine("d1", "decode")
    raw = setup.client().chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi " * 100}])  # one block: 64 tokens, under 512
    h = raw.headers
    assert (h["x-quillcache-prefill-engine"], h["x-quillcache-decode-engine"], h["x-quillcache-disaggregated"]) == \
        ("d1", "d1", "false")
    assert h["x-quillcache-pair"].startswith("short: ") and "uncached 64 tokens" in h["x-quillcache-pair"]
    assert "x-quillcache-handoff" not in h
    assert p.stats()["requests"] == 0 and kv(d)["aggregated"] == 1


# -- failures -----------------------------------------------------------------------------
def test_a_failed_prefill_moves_to_the_next_prefill_engine_then_to_the_decode_engine_alone(setup):
    setup.node("a", gateway=True, env=ALWAYS)
    p1, p2 = setup.engine("p1", "prefill"), setup.engine("p2", "prefill")
    d = setup.engine("d1", "decode")
    client = setup.client()
    p1.control(status=500)
    raw = client.chat.completions.with_raw_response.create(model="m", messages=messages("one"))
    assert raw.headers["x-quillcache-prefill-engine"] == "p2" and raw.headers["x-quillcache-disaggregated"] == "true"
    assert kv(d)["loaded"] == prompt_blocks(messages("one")) and kv(d)["recomputed"] == 0
    assert p1.stats()["requests"] == 1 and kv(p2)["prefills"] == 1
    p2.control(status=503)
    raw = client.chat.completions.with_raw_response.create(model="m", messages=messages("two"))
    h = raw.headers
    assert (h["x-quillcache-prefill-engine"], h["x-quillcache-disaggregated"]) == ("d1", "false")
    assert h["x-quillcache-pair"].startswith("prefill_failed: ") and "HTTP 503" in h["x-quillcache-pair"]
    assert raw.parse().choices[0].message.content.startswith("served by d1")
    assert kv(d)["aggregated"] == 1  # no kv_transfer_params: it prefilled the prompt itself
    stats = setup.gw_stats()
    assert stats["gateway_prefill_failures"] >= 3 and stats["gateway_prefill_fallbacks"] == 1


def test_a_decode_engine_failing_before_its_first_byte_is_replaced_and_nothing_is_prefilled_again(setup):
    setup.node("a", gateway=True, env=ALWAYS)
    p = setup.engine("p1", "prefill")
    d1, d2 = setup.engine("d1", "decode"), setup.engine("d2", "decode")
    d1.control(status=500)
    client = setup.client()
    msgs = messages("retry the decode")
    with client.chat.completions.with_streaming_response.create(model="m", messages=msgs, stream=True) as response:
        assert response.headers["x-quillcache-decode-engine"] == "d2"
        text = "".join((c.choices[0].delta.content or "") for c in response.parse() if c.choices)
    assert text.startswith("served by d2")
    assert d1.stats()["requests"] == 1 and kv(p)["prefills"] == 1  # one prefill for both decode attempts
    assert kv(d2)["loaded"] == prompt_blocks(msgs) and kv(d2)["recomputed"] == 0
    assert setup.gw_stats()["gateway_decode_retries"] == 1


def test_the_handoff_waits_for_blocks_written_late_and_counts_those_that_never_come(setup):
    setup.node("a", gateway=True, env=ALWAYS | {"QUILLD_GATEWAY_HANDOFF_WAIT_MS": "5000"})
    p, d = setup.engine("p1", "prefill"), setup.engine("d1", "decode")
    client = setup.client()
    p.control(write_delay_ms=300)  # the prefill answers, then its connector stores the KV
    msgs = messages("late blocks")
    n = prompt_blocks(msgs)
    raw = client.chat.completions.with_raw_response.create(model="m", messages=msgs)
    assert f"blocks={n} resident={n} late={n}" in raw.headers["x-quillcache-handoff"]
    assert kv(d)["loaded"] == n and kv(d)["recomputed"] == 0  # the gateway held the decode back until they came
    stats = setup.gw_stats()
    assert stats["gateway_handoff_late"] == 1 and stats["gateway_handoff_blocks_late"] == n


def test_blocks_that_never_land_are_counted_missing_and_recomputed(setup):
    setup.node("a", gateway=True, env=ALWAYS | {"QUILLD_GATEWAY_HANDOFF_WAIT_MS": "200"})
    p, d = setup.engine("p1", "prefill"), setup.engine("d1", "decode")
    p.control(write_kv=0)
    msgs = messages("lost blocks")
    n = prompt_blocks(msgs)
    raw = setup.client().chat.completions.with_raw_response.create(model="m", messages=msgs)
    assert f"blocks={n} resident=0 late=0" in raw.headers["x-quillcache-handoff"]
    assert kv(d)["recomputed"] == n and kv(d)["loaded"] == 0
    stats = setup.gw_stats()
    assert stats["gateway_handoff_missing"] == 1 and stats["gateway_handoff_blocks_missing"] == n
    assert stats["gateway_handoff_wait_p99_ms"] >= 100  # it waited (bucket bounds: 0.1 s to 0.25 s)


def engine_to_engine_pair(setup, keys: dict, *prefill_args: str) -> tuple[Engine, Engine]:
    """A gateway whose pool handoff would wait 2 s, a prefill engine that writes nothing to the pool
    (its KV stays with it, for the decode engine to read) registered with `keys`, a decode engine."""
    setup.node("a", gateway=True, env=ALWAYS | {"QUILLD_GATEWAY_HANDOFF_WAIT_MS": "2000"})
    p = setup.engine("p1", "prefill", "a", *prefill_args, keys=keys)
    d = setup.engine("d1", "decode")
    p.control(write_kv=0)
    return p, d


def timed_chat(setup, words: str):
    """One disaggregated chat through the gateway: (its raw answer, the prompt's blocks, seconds)."""
    msgs = messages(words)
    t0 = time.monotonic()
    raw = setup.client().chat.completions.with_raw_response.create(model="m", messages=msgs)
    took = time.monotonic() - t0
    assert raw.headers["x-quillcache-disaggregated"] == "true", dict(raw.headers)
    return raw, prompt_blocks(msgs), took


def prefill_leases_back(setup, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(e["load"]["prefills"] for e in setup.admin("GET", "/v1/engines")[1]["engines"]):
        assert time.monotonic() < deadline, "a prefill leg's lease was not given back"
        time.sleep(0.05)


def test_an_engine_to_engine_pair_relays_kv_transfer_params_and_sends_the_decode_at_once(setup):
    """A prefill engine registered with kv_transfer = "nixl" (vLLM's NixlConnector, P2P) writes
    nothing to the pool: the decode leg goes at once with the prefill's kv_transfer_params, as
    vLLM's toy proxy sends it, with no handoff wait, counted engine to engine; a kind not supported
    (yet) or a mooncake engine with no kv_engine_id is refused, saying why."""
    p, d = engine_to_engine_pair(setup, {"kv_transfer": "nixl"})
    raw, n, took = timed_chat(setup, "engine to engine")
    assert f"kv_transfer=nixl engine-to-engine blocks={n} waited_ms=0 from=p1" in raw.headers["x-quillcache-handoff"]
    assert took < 1.5, took  # no 2 s handoff wait
    got = d.stats()["last_kv_params"]
    sent = p.stats()["last_kv_params"]
    assert sent["do_remote_decode"] is True, sent
    assert got["do_remote_prefill"] is True and got["remote_engine_id"] == "p1", got  # the prefill's own answer
    stats = setup.gw_stats()
    assert stats["gateway_handoff_direct"] == 1 and stats["gateway_disaggregated"] == 1, stats
    assert stats["gateway_handoff_missing"] == 0 and stats["gateway_handoff_blocks"] == 0, stats
    status, body = setup.admin("GET", "/v1/engines")
    assert {e["id"]: e["kv_transfer"] for e in body["engines"]} == {"p1": "nixl", "d1": "pool"}, body
    for kind, says in (("mooncake", "needs kv_engine_id"), ("lmcache", "LMCache"), ("carrier-pigeon", "pool, nixl")):
        status, body = setup.admin("POST", "/v1/engines", {"id": "x", "url": "http://127.0.0.1:9", "model": "m",
                                                           "kv_transfer": kind})
        assert status == 400 and says in body["error"], body


def test_a_mooncake_pair_gets_both_legs_at_once_tied_by_one_transfer_id(setup):
    """kv_transfer = "mooncake" (vLLM's MooncakeConnector): the decode leg does not wait for the prefill
    (slow here: 1.5 s); it carries the prefill engine's engine id, bootstrap address and the transfer_id
    the prefill leg got, as that connector reads them."""
    p, d = engine_to_engine_pair(setup, {"kv_transfer": "mooncake", "kv_engine_id": "p1-vllm"}, "--delay-ms", "1500")
    raw, n, took = timed_chat(setup, "both legs at once")
    assert (f"kv_transfer=mooncake engine-to-engine both-legs-at-once blocks={n} waited_ms=0 from=p1"
            in raw.headers["x-quillcache-handoff"])
    assert took < 1.2, took  # the decode leg did not wait for the 1.5 s prefill
    got = d.stats()["last_kv_params"]
    assert got["do_remote_prefill"] is True and got["remote_engine_id"] == "p1-vllm", got
    assert got["remote_bootstrap_addr"] == "127.0.0.1:8998" and got["transfer_id"], got  # the url's host, vLLM's port
    prefill_leases_back(setup)
    sent = p.stats()["last_kv_params"]
    assert sent["do_remote_decode"] is True and sent["transfer_id"] == got["transfer_id"], sent
    stats = setup.gw_stats()
    assert stats["gateway_handoff_direct"] == 1 and stats["gateway_prefill_failures"] == 0, stats
    # a prefill leg that fails while its decode runs: the decode still answers; counted, its lease given back
    p.control(status=503, delay_ms=0)
    raw, _, _ = timed_chat(setup, "a prefill that fails")
    prefill_leases_back(setup)
    stats = setup.gw_stats()
    assert stats["gateway_prefill_failures"] == 1 and stats["gateway_disaggregated"] == 2, stats
    status, body = setup.admin("POST", "/v1/engines", {"id": "x", "url": "http://127.0.0.1:9", "model": "m",
                                                       "kv_transfer": "mooncake", "kv_engine_id": "x",
                                                       "kv_bootstrap": "nohost"})
    assert status == 400 and "kv_bootstrap must be host:port" in body["error"], body


def test_a_model_with_only_prefill_engines_is_a_clear_error_everywhere(setup):
    q = setup.node("a", gateway=True)
    setup.engine("p1", "prefill")
    with pytest.raises(openai.APIStatusError) as err:
        setup.client().chat.completions.create(model="m", messages=messages("nobody decodes"))
    assert err.value.status_code == 503 and err.value.body["code"] == "no_decode_engine"
    assert "no decode-capable engine serves model 'm'" in err.value.body["message"]
    status, body = setup.admin("POST", "/v1/route", {"model": "m", "tokenizer": "t", "blocks": [1, 2, 3]})
    assert status == 503 and "no decode-capable engine" in body["error"]
    r = redis.Redis(port=q.port)
    r.execute_command("SCOPE", "m", "t")
    with pytest.raises(redis.ResponseError, match="no decode-capable engine serves model 'm'"):
        r.execute_command("ROUTE", json.dumps({"blocks": [1, 2, 3]}))



FORGED = {"kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "attacker",
                                 "remote_block_ids": [0, 1, 2], "remote_host": "203.0.113.9", "remote_port": 4444},
          "cache_salt": "another-tenant's-salt"}


def test_a_clients_kv_transfer_params_and_cache_salt_reach_neither_leg(setup):
    """Issue 29, item 18: on both legs of a disaggregated request the engines get the gateway's
    kv_transfer_params only (the prefill's do_remote_decode, then what the prefill answered) and
    no client cache_salt; when the prefill answers none, or every prefill fails, the decode engine
    gets none either, never the client's forged host, port, engine and blocks."""
    setup.node("a", gateway=True, env=ALWAYS)
    p, d = setup.engine("p1", "prefill"), setup.engine("d1", "decode")
    client = setup.client()

    def ask(user: str, stream: bool) -> None:
        with client.chat.completions.with_streaming_response.create(model="m", messages=messages(user), stream=stream,
                                                                    extra_body=FORGED) as response:
            response.read()

    ask("forged, both legs", False)
    prefill, decode = p.stats(), d.stats()
    assert prefill["last"]["kv_transfer_params"]["do_remote_decode"] is True and "cache_salt" not in prefill["last"]
    assert decode["last_kv_params"]["remote_engine_id"] == "p1" and decode["last_kv_params"]["remote_port"] == p.port
    assert "cache_salt" not in decode["last"]
    p.control(answer_kv=0)  # the prefill names no kv_transfer_params: the decode engine gets the request alone
    ask("forged, no params from the prefill", True)
    decode = d.stats()
    assert decode["last_kv_params"] is None and "cache_salt" not in decode["last"], decode["last"]
    assert decode["kv"]["aggregated"] == 1 and decode["kv"]["decodes"] == 1
    p.control(status=500)  # no prefill engine answers: served by the decode engine alone
    ask("forged, every prefill failed", False)
    decode = d.stats()
    assert decode["last_kv_params"] is None and "cache_salt" not in decode["last"], decode["last"]
    stats = setup.gw_stats()
    assert stats["gateway_dropped_kv_transfer_params"] == 3 and stats["gateway_dropped_cache_salt"] == 3
    assert stats["gateway_prefill_fallbacks"] == 1

# -- ROUTE's renderings and the engines' views --------------------------------------------
def test_route_answers_the_pair_in_every_form_and_engines_show_roles_and_loads(setup):
    q = setup.node("a", env=ALWAYS)
    setup.engine("p1", "prefill")
    setup.engine("d1", "decode", locality="b")
    blocks = list(range(1001, 1041))
    want = {"prefill": "p1", "decode": "d1", "disaggregated": True, "reason": "always", "prefill_node": "a",
            "decode_node": "b", "uncached_tokens": 40 * 16, "transfer_bytes": 40 * 16 * 131_072}
    for protocol in (2, 3):
        r = redis.Redis(port=q.port, protocol=protocol, decode_responses=True)
        r.execute_command("SCOPE", "m", "t")
        reply = r.execute_command("ROUTE", json.dumps({"blocks": blocks, "acquire": True}))
        d = reply if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2]))
        pair = d["pair"] if isinstance(d["pair"], dict) else dict(zip(d["pair"][::2], d["pair"][1::2]))
        assert d["engine"] == "d1" and pair["prefill_url"].startswith("http://127.0.0.1:")
        assert {k: pair[k] for k in want} == {k: (int(v) if protocol == 2 and isinstance(v, bool) else v)
                                              for k, v in want.items()}
        assert r.execute_command("RELEASE", d["lease"]) and r.execute_command("RELEASE", pair["prefill_lease"])
    compact = QuillClient("127.0.0.1", q.port).scope(model="m", tokenizer="t").route(blocks=blocks, candidates=False)
    assert compact["engine"] == "d1" and compact["pair"]["prefill"] == "p1"
    status, body = setup.admin("POST", "/v1/route", {"model": "m", "tokenizer": "t", "blocks": blocks,
                                                     "acquire": True})
    assert status == 200 and {k: body["pair"][k] for k in want} == want
    engines = {e["id"]: e for e in setup.admin("GET", "/v1/engines")[1]["engines"]}
    assert (engines["p1"]["role"], engines["d1"]["role"], engines["d1"]["kv_node"], engines["p1"]["kv_node"]) == \
        ("prefill", "decode", "b", "a")
    assert engines["p1"]["load"] == {"prefills": 1, "prefill_tokens": 640, "decodes": 0}
    assert engines["d1"]["load"] == {"prefills": 0, "prefill_tokens": 0, "decodes": 1}
    status, _, raw = http(q.admin_port, "GET", "/metrics")
    text = raw.decode()
    assert 'quilld_engine_info{engine="d1",kv_node="b",role="decode"} 1.0' in text
    assert 'quilld_engine_prefill_tokens{engine="p1"} 640.0' in text
    assert 'quilld_route_pairs_total{reason="always"} 4.0' in text


# -- across nodes: the prefetch -------------------------------------------------------------
FAST_GOSSIP = {"QUILLD_CLUSTER_PROBE_INTERVAL_MS": "200", "QUILLD_CLUSTER_PROBE_TIMEOUT_MS": "80",
               "QUILLD_CLUSTER_PUSH_PULL_INTERVAL_MS": "1000"}


def test_a_decode_engine_on_another_node_reads_the_prefills_kv_locally_pulled_there_before_it_asks(setup):
    from test_cluster import members

    ga, gb = free_gossip_port(), free_gossip_port()
    setup.node("a", "--gossip-port", str(ga), gateway=True, env=ALWAYS | FAST_GOSSIP)
    setup.node("b", "--gossip-port", str(gb), "--seeds", f"127.0.0.1:{ga}", env=FAST_GOSSIP)
    for n in "ab":
        assert wait_until(lambda n=n: members(redis.Redis(port=setup.nodes[n].port)) == {"a": "alive", "b": "alive"},
                          timeout=20), f"node {n} did not see both members"
    p = setup.engine("p1", "prefill", "a", locality="a")
    d = setup.engine("d1", "decode", "b", "--local-reads", locality="b")  # GETBLK ... LOCAL: node b's copies only
    msgs = messages("across nodes")
    n = prompt_blocks(msgs)
    raw = setup.client().chat.completions.with_raw_response.create(model="m", messages=msgs)
    h = raw.headers
    assert h["x-quillcache-decode-engine"] == "d1" and h["x-quillcache-disaggregated"] == "true"
    assert f"from=a to=b prefetched={n}" in h["x-quillcache-handoff"], h["x-quillcache-handoff"]
    assert "transfer " in h["x-quillcache-pair"] and f"{n * 64 * 131_072} bytes" in h["x-quillcache-pair"]
    got = kv(d)
    assert got == got | {"loaded": n, "recomputed": 0, "corrupt": 0}, got  # every block read on b, byte for byte
    assert kv(p)["blocks_written"] == n
    info = redis.Redis(port=setup.nodes["b"].port).info("cluster")
    assert info["cluster_prefetch_keys_pulled"] == n and info["cluster_peer_fetch_bytes"] >= n * BLOCK_BYTES
    stats = setup.gw_stats()
    assert stats["gateway_prefetches"] == 1 and stats["gateway_prefetch_blocks"] == n


def test_blocks_stored_with_hash_and_no_parent_are_all_counted_in_a_cluster(setup):
    """A connector that stores each block with HASH alone (index/handoff.py's scheme, no PARENT), on
    another node than the gateway's: the handoff check and ROUTE's pool credit count every block."""
    from test_cluster import members

    ga, gb = free_gossip_port(), free_gossip_port()
    setup.node("a", "--gossip-port", str(ga), gateway=True, env=ALWAYS | FAST_GOSSIP)
    setup.node("b", "--gossip-port", str(gb), "--seeds", f"127.0.0.1:{ga}", env=FAST_GOSSIP)
    for n in "ab":
        assert wait_until(lambda n=n: members(redis.Redis(port=setup.nodes[n].port)) == {"a": "alive", "b": "alive"},
                          timeout=20), f"node {n} did not see both members"
    setup.engine("p1", "prefill", "b", "--hash-only", locality="b")
    setup.engine("d1", "decode", "a", locality="a")
    client = setup.client()

    def prompt(n: int, what: str) -> str:
        text = "".join(f"{what}-{n:02d}-{i:03d} ".ljust(256, "x") for i in range(n))  # exactly n blocks of 256
        assert len(chunk_hashes(text, 256)) == n
        return text

    for n in (10, 33, 70):  # the handoff check, on a, of what p1 stored through b
        raw = client.completions.with_raw_response.create(model="m", prompt=prompt(n, "gw"), max_tokens=4)
        handoff = raw.headers["x-quillcache-handoff"]
        assert f"blocks={n} resident={n} late=0" in handoff, (n, handoff)
        assert raw.parse().model_extra["quillcache_kv"] == {"loaded": n, "recomputed": 0, "corrupt": 0}
    stats = setup.gw_stats()
    assert stats["gateway_handoff_on_time"] == 3 and stats["gateway_handoff_missing"] == 0, stats

    # ROUTE's pool credit, for blocks only the pool holds (no engine's record of them): stored on b alone;
    # b learns of d1 (registered on a) through the engine table's gossip
    assert wait_until(lambda: len(json.loads(http(setup.nodes["b"].admin_port, "GET", "/v1/engines", None, {})[2])
                                  ["engines"]) == 2, timeout=10), "b did not learn of both engines"
    pool = QuillClient("127.0.0.1", setup.nodes["b"].port).scope(model="m", tokenizer="t")
    for n in (10, 33, 70):
        hashes = chunk_hashes(prompt(n, "route"), 256)
        for h in hashes:
            handle = pool.execute("PUT2PHASE", "BEGIN", kv_key(h), 64, "HASH", h)
            pool.execute("PUT2PHASE", "DATA", handle, 0, b"k" * 64, "CRC32C", crc32c.crc32c(b"k" * 64))
        for node in "ab":
            status, _, body = http(setup.nodes[node].admin_port, "POST", "/v1/route",
                                   json.dumps({"model": "m", "tokenizer": "t", "blocks": hashes,
                                               "decode_tokens": 4}).encode(), {"Content-Type": "application/json"})
            assert status == 200, (node, body)
            plan = [s["action"] for s in json.loads(body)["plan"]]
            assert plan == ["fetch"] * n, (n, node, plan)


def test_engines_with_api_keys_get_a_bearer_token_on_both_legs_and_kv_node_is_one_name_both_ways(setup):
    """Engines that require a bearer key (vLLM's --api-key), registered with `api_key` and `kv_node`:
    the gateway sends each its own key on the prefill and the decode leg; the key is never shown or
    logged; `kv_node` is taken by POST /v1/engines as /v1/engines shows it (`locality` its old name)."""
    q = setup.node("a", gateway=True, env=ALWAYS)
    keys = {"p1": "sk-prefill-7d1e", "d1": "sk-decode-93aa"}
    for name, role in (("p1", "prefill"), ("d1", "decode")):
        setup.engine(name, role, "a", "--api-key", keys[name], register=False)
        status, body = setup.admin("POST", "/v1/engines", {
            "id": name, "url": f"http://127.0.0.1:{setup.engines[name].port}", "model": "m", "tokenizer": "t",
            "role": role, "kv_node": "a", "api_key": keys[name]})
        assert status == 201, body
        assert body["kv_node"] == "a" and "api_key" not in body and "locality" not in body, body
    status, body = setup.admin("POST", "/v1/engines", {"id": "x", "url": "http://127.0.0.1:9", "model": "other",
                                                       "kv_node": "a", "locality": "b"})
    assert status == 400 and "kv_node" in body["error"], body
    status, body = setup.admin("POST", "/v1/engines", {"id": "old", "url": "http://127.0.0.1:9", "model": "other",
                                                       "locality": "a"})  # the older name, still taken
    assert status == 201 and body["kv_node"] == "a", body
    msgs = messages("with keys")
    n = prompt_blocks(msgs)
    for stream in (False, True):
        with setup.client().chat.completions.with_streaming_response.create(model="m", messages=msgs,
                                                                            stream=stream) as response:
            assert response.headers["x-quillcache-disaggregated"] == "true", dict(response.headers)
            assert f"blocks={n} resident={n}" in response.headers["x-quillcache-handoff"]
            response.read()
    p, d = (setup.engines[e].stats() for e in ("p1", "d1"))
    assert (p["unauthorized"], d["unauthorized"]) == (0, 0), (p, d)
    assert p["kv"]["prefills"] == 2 and d["kv"]["decodes"] == 2 and d["kv"]["loaded"] == 2 * n, (p, d)
    # what the operator sees: kv_node, never a key
    status, body = setup.admin("GET", "/v1/engines")
    listed = {e["id"]: e for e in body["engines"]}
    assert listed["p1"]["kv_node"] == "a" and "api_key" not in listed["p1"], listed["p1"]
    shown = [json.dumps(body), str(redis.Redis(port=q.port).info("everything")),
             http(q.admin_port, "GET", "/metrics")[2].decode(), http(q.admin_port, "GET", "/v1/config")[2].decode(),
             q.log()]
    for text in shown:
        assert not any(k in text for k in keys.values())
