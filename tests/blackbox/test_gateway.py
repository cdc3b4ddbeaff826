"""The OpenAI-compatible gateway on a real quilld, in front of real fake engines (tests/fake_engine.py),
driven with the official `openai` client (sync and async) and raw HTTP.

Each fake engine is its own process on a free port; its answers name it, so a
test can see who served a request, and its /stats tell what it saw (requests,
open, cancelled, the last body).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass

import openai
import redis
import pytest

from conftest import ROOT, free_port, stop_process, wait_port, wait_until

pytestmark = pytest.mark.timeout(60)

ENGINE_SCRIPT = ROOT / "tests" / "fake_engine.py"
SYSTEM = "You are QuillCache's test assistant. " * 60  # ~2200 characters: 8 blocks of 256 characters
HTTP_TIMEOUT = 15.0


# -- processes -------------------------------------------------------------------------
@dataclass
class Engine:
    name: str
    port: int
    model: str
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict:
        return http_json(self.port, "GET", "/stats")[1]

    def control(self, **settings) -> None:
        assert http_json(self.port, "POST", "/control", settings)[0] == 200

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(5)


@dataclass
class Gw:
    port: int
    admin_port: int
    resp_port: int
    engines: dict[str, Engine]
    admin_headers: dict[str, str]  # its bearer token, when quilld has passwords (it then requires one)

    def client(self, key: str = "unused", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key, max_retries=0,
                             timeout=HTTP_TIMEOUT, **kw)

    def aclient(self, key: str = "unused") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key, max_retries=0,
                                  timeout=HTTP_TIMEOUT)

    def stats(self) -> dict:
        status, body = http_json(self.port, "GET", "/v1/quillcache/stats", headers=self._auth)
        assert status == 200, body
        return body

    def in_flight(self) -> dict[str, int]:
        engines = http_json(self.admin_port, "GET", "/v1/engines", headers=self.admin_headers)[1]["engines"]
        return {e["id"]: e["in_flight"] for e in engines}

    _auth: dict | None = None


def http_json(port: int, method: str, path: str, body=None, headers: dict | None = None,
              raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())


@pytest.fixture
def gateway(quilld_factory, tmp_path):
    """make(engines, *quilld_flags, env=...) -> Gw; engines: (name, model, fake_engine flags) or
    (name, model, None) for an engine whose URL has nobody listening."""
    procs: list[subprocess.Popen] = []

    def make(engines, *flags: str, env: dict | None = None, engine_keys: dict | None = None) -> Gw:
        started: dict[str, Engine] = {}
        tables = []
        for name, model, args in engines:
            port = free_port()
            if args is not None:
                with open(tmp_path / f"engine-{name}.log", "wb") as log:
                    proc = subprocess.Popen([sys.executable, str(ENGINE_SCRIPT), "--port", str(port), "--model",
                                             model, "--name", name, *args], stdout=log, stderr=subprocess.STDOUT)
                procs.append(proc)
                started[name] = Engine(name, port, model, proc)
            keys = {"id": name, "url": f"http://127.0.0.1:{port}", "model": model, **(engine_keys or {}).get(name, {})}
            tables.append("[[engines]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items()))
        for e in started.values():
            try:
                wait_port(e.port, e.proc)
            except (RuntimeError, TimeoutError) as err:
                raise RuntimeError(f"fake engine {e.name}: {err}\n"
                                   + (tmp_path / f"engine-{e.name}.log").read_text(errors="replace")) from None
        conf = tmp_path / "gateway.toml"
        conf.write_text("\n".join(tables))
        for attempt in range(3):  # a free port may be taken again before quilld binds it: try another
            gw_port = free_port()
            try:
                q = quilld_factory("--config", str(conf), "--gateway-port", str(gw_port), *flags, env=env)
            except RuntimeError as err:  # its message holds quilld's log
                if attempt < 2 and "in use" in str(err):
                    continue
                raise
            try:
                wait_port(gw_port, q.proc)
            except (RuntimeError, TimeoutError):
                if attempt < 2 and "in use" in q.log():
                    continue
                raise RuntimeError(f"quilld's gateway did not start:\n{q.log()}") from None
            return Gw(gw_port, q.admin_port, q.port, started, q.admin_headers())
        raise AssertionError("unreachable")

    yield make
    for proc in procs:
        stop_process(proc)


def chat(user: str, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def text_of(completion) -> str:
    return completion.choices[0].message.content


def check_decision_headers(headers) -> str:
    engine = headers["x-quillcache-engine"]
    assert re.fullmatch(r"[0-9a-f]{16}", headers["x-quillcache-request-id"])
    assert int(headers["x-quillcache-overlap-blocks"]) >= 0
    float(headers["x-quillcache-cost"])
    assert re.fullmatch(r"hits=\d+ fetches=\d+ recomputes=\d+", headers["x-quillcache-plan"])
    return engine


# -- the decision headers --------------------------------------------------------------
def test_sync_client_sees_models_decision_headers_and_the_engine_that_served(gateway):
    gw = gateway([("e1", "m", []), ("e2", "m", []), ("e3", "other", [])])
    client = gw.client()
    assert [m.id for m in client.models.list()] == ["m", "other"]
    assert client.models.retrieve("other").id == "other"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")

    raw = client.chat.completions.with_raw_response.create(model="m", messages=chat("hello"))
    engine = check_decision_headers(raw.headers)
    assert engine in ("e1", "e2")
    assert text_of(raw.parse()).startswith(f"served by {engine}")
    assert raw.headers["x-quillcache-plan"] == "hits=0 fetches=0 recomputes=8"

    with client.chat.completions.with_streaming_response.create(model="m", messages=chat("again"),
                                                                stream=True) as response:
        engine = check_decision_headers(response.headers)  # before any chunk is read
        pieces = [c.choices[0].delta.content or "" for c in response.parse() if c.choices]
    assert "".join(pieces).startswith(f"served by {engine}")

    stream = client.completions.create(model="other", prompt="Once upon a time", stream=True)
    assert "".join(c.choices[0].text for c in stream).startswith("served by e3")
    assert gw.engines["e3"].stats()["last"]["prompt"] == "Once upon a time"


def test_headers_arrive_before_the_first_body_byte(gateway):
    gw = gateway([("slow", "m", ["--delay-ms", "3000"])])
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=HTTP_TIMEOUT)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": "m", "messages": chat("hi"), "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    t_headers = time.perf_counter() - t0
    assert resp.status == 200 and resp.getheader("x-quillcache-engine") == "slow"
    assert resp.getheader("Content-Type").startswith("text/event-stream")
    first = resp.read1(65536)
    t_body = time.perf_counter() - t0
    assert first.startswith(b"data: ") and b"served by slow" in first
    # the engine waits 3 s before its first byte: held headers would come with it, not 1.5 s sooner
    assert t_body >= 3.0 and t_headers < t_body - 1.5, (t_headers, t_body)
    assert (first + resp.read()).endswith(b"data: [DONE]\n\n")
    conn.close()


# -- routing -----------------------------------------------------------------------------
def test_requests_sharing_a_long_prefix_land_on_the_same_engine(gateway):
    gw = gateway([("e1", "m", []), ("e2", "m", [])])
    client = gw.client()
    other_system = "A different, equally long system prompt for another application. " * 35
    # Prefix A goes to e1 (both idle and cold: the tie goes to the first id)...
    first = client.chat.completions.with_raw_response.create(model="m", messages=chat("q0"))
    assert first.headers["x-quillcache-engine"] == "e1"
    # ...and prefix B to e2, because e1 is busy with an unrelated slow request when B first comes.
    gw.engines["e1"].control(delay_ms=1500)
    busy = threading.Thread(target=lambda: client.chat.completions.create(model="m", messages=chat("x", "busy")))
    busy.start()
    assert wait_until(lambda: gw.engines["e1"].stats()["open"] == 1)
    b = client.chat.completions.with_raw_response.create(model="m", messages=chat("q0", other_system))
    assert b.headers["x-quillcache-engine"] == "e2"
    busy.join()
    gw.engines["e1"].control(delay_ms=0)
    # With the load even again, each prefix sticks to the engine that holds it, whatever the question.
    for i in range(1, 4):
        for system, home in ((SYSTEM, "e1"), (other_system, "e2")):
            assert gw.in_flight() == {"e1": 0, "e2": 0}
            raw = client.chat.completions.with_raw_response.create(model="m", messages=chat(f"question {i}", system))
            assert raw.headers["x-quillcache-engine"] == home
            assert text_of(raw.parse()).startswith(f"served by {home}")
            overlap = int(raw.headers["x-quillcache-overlap-blocks"])
            assert overlap >= len(system) // 256 - 1
            assert raw.headers["x-quillcache-plan"].startswith(f"hits={overlap} fetches=0 ")


def test_a_session_stays_on_its_engine_until_that_engine_fails(gateway):
    gw = gateway([("e1", "m", []), ("e2", "m", [])])
    client = gw.client()
    first = client.chat.completions.with_raw_response.create(
        model="m", messages=chat("hello", "session system prompt " * 40),
        extra_headers={"x-quillcache-session": "conv-7"})
    home = first.headers["x-quillcache-engine"]
    away = "e2" if home == "e1" else "e1"
    # unrelated prompts would go anywhere; the session keeps them on its engine, even when loaded
    gw.engines[home].control(delay_ms=600)
    busy = threading.Thread(target=lambda: client.chat.completions.create(
        model="m", messages=chat("x", "busy"), extra_headers={"x-quillcache-session": "conv-7"}))
    busy.start()
    assert wait_until(lambda: gw.engines[home].stats()["open"] == 1)
    without = client.chat.completions.with_raw_response.create(model="m", messages=chat("y", "elsewhere " * 30))
    assert without.headers["x-quillcache-engine"] == away  # no session: the idle engine wins
    for i in range(3):
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=chat(f"unrelated {i}", f"other system {i} " * 30),
            extra_headers={"x-quillcache-session": "conv-7"})
        assert raw.headers["x-quillcache-engine"] == home
    busy.join()
    gw.engines[home].control(delay_ms=0)
    # the session's engine dies: the request fails over instead of failing
    gw.engines[home].kill()
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=chat("after the crash"), extra_headers={"x-quillcache-session": "conv-7"})
    assert raw.headers["x-quillcache-engine"] == away


def test_a_session_id_over_256_bytes_is_refused_before_any_engine_is_asked(gateway):
    gw = gateway([("e1", "m", [])])
    status, body = http_json(gw.port, "POST", "/v1/chat/completions", {"model": "m", "messages": chat("hi")},
                             headers={"x-quillcache-session": "s" * 257})
    assert status == 400 and body["error"]["code"] == "session_id_too_long"
    assert body["error"]["param"] == "x-quillcache-session" and "at most 256" in body["error"]["message"]
    assert gw.engines["e1"].stats()["requests"] == 0
    status, _ = http_json(gw.port, "POST", "/v1/chat/completions", {"model": "m", "messages": chat("hi")},
                          headers={"x-quillcache-session": "s" * 256})
    assert status == 200 and gw.engines["e1"].stats()["requests"] == 1


def test_a_stream_longer_than_the_lease_timeout_keeps_counting_in_flight(gateway):
    gw = gateway([("e1", "m", ["--chunks", "8", "--chunk-delay-ms", "500"])],
                 env={"QUILLD_ROUTER_LEASE_TIMEOUT_MS": "1500"})
    client = gw.client()
    done = threading.Event()

    def stream():
        for _ in client.chat.completions.create(model="m", messages=chat("long"), stream=True):
            pass
        done.set()

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(2.6)  # past the 1.5 s lease: the gateway renews it while the stream runs
    assert not done.is_set() and gw.in_flight() == {"e1": 1}
    t.join(15)
    assert done.is_set() and gw.in_flight() == {"e1": 0}


def test_recorded_residencies_are_bounded_per_engine(gateway):
    gw = gateway([("e1", "m", [])], env={"QUILLD_GATEWAY_RECORDED_BLOCKS": "6"})
    client = gw.client()
    for i in range(4):  # four different long prompts: each records several blocks on e1
        client.chat.completions.create(model="m", messages=chat("q", f"prompt {i} " * 200))
    s = gw.stats()
    assert s["gateway_residencies_recorded"] > 6
    assert s["gateway_residencies_recorded"] - s["gateway_residencies_forgotten"] == 6
    # the newest prompt is still credited, the oldest no longer
    newest = client.chat.completions.with_raw_response.create(model="m", messages=chat("q", "prompt 3 " * 200))
    oldest = client.chat.completions.with_raw_response.create(model="m", messages=chat("q", "prompt 0 " * 200))
    assert int(newest.headers["x-quillcache-overlap-blocks"]) > 0
    assert int(oldest.headers["x-quillcache-overlap-blocks"]) == 0


def test_a_burst_with_one_prefix_spreads_over_the_engines_by_load(gateway):
    gw = gateway([("e1", "m", ["--delay-ms", "800"]), ("e2", "m", ["--delay-ms", "800"])])

    async def burst():
        client = gw.aclient()

        async def one(i: int) -> tuple[str, str]:
            async with client.chat.completions.with_streaming_response.create(
                    model="m", messages=chat("same question"), stream=True) as response:
                engine = check_decision_headers(response.headers)
                text = "".join([c.choices[0].delta.content or "" async for c in await response.parse()
                                if c.choices])
                return engine, text

        tasks = [asyncio.create_task(one(i)) for i in range(6)]

        def all_routed() -> dict | None:
            loads = gw.in_flight()
            return loads if sum(loads.values()) == 6 else None

        loads = await asyncio.to_thread(wait_until, all_routed)
        results = await asyncio.gather(*tasks)
        raw = await client.chat.completions.with_raw_response.create(model="m", messages=chat("after"))
        await client.close()
        return loads, results, raw

    loads, results, raw = asyncio.run(burst())
    assert loads == {"e1": 3, "e2": 3}
    assert Counter(engine for engine, _ in results) == {"e1": 3, "e2": 3}
    assert all(text.startswith(f"served by {engine}") for engine, text in results)
    assert check_decision_headers(raw.headers) in ("e1", "e2")
    assert gw.in_flight() == {"e1": 0, "e2": 0}
    assert gw.stats()["gateway_in_flight"] == 0


def test_identity_api_keys_tenants_and_adapters(gateway, tmp_path):
    users = tmp_path / "users"
    users.write_text("alice alice-key\nbob bob-key\n")
    gw = gateway([("e1", "m", ["--lora", "sql"])], "--users-file", str(users))
    gw._auth = {"Authorization": "Bearer alice-key"}
    status, body = http_json(gw.port, "POST", "/v1/chat/completions", {"model": "m", "messages": chat("hi")})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"  # no key at all
    with pytest.raises(openai.AuthenticationError) as exc:
        gw.client("wrong-key").chat.completions.create(model="m", messages=chat("hi"))
    assert exc.value.status_code == 401 and exc.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        gw.client("wrong-key").models.list()

    alice, bob = gw.client("alice-key"), gw.client("bob-key")
    assert [m.id for m in alice.models.list()] == ["m"]
    alice.chat.completions.create(model="m", messages=chat("first"))
    again = alice.chat.completions.with_raw_response.create(model="m", messages=chat("second"))
    assert int(again.headers["x-quillcache-overlap-blocks"]) >= 7
    # Bob sends the very same prompt: alice's cached prefix earns him no credit (and tells him nothing).
    raw = bob.chat.completions.with_raw_response.create(model="m", messages=chat("second"))
    assert raw.headers["x-quillcache-overlap-blocks"] == "0"

    # `m:sql` is LoRA `sql` on the engines of `m`: sent as model "sql", in a scope of its own.
    raw = alice.chat.completions.with_raw_response.create(model="m:sql", messages=chat("second"))
    assert raw.headers["x-quillcache-engine"] == "e1" and raw.headers["x-quillcache-overlap-blocks"] == "0"
    assert gw.engines["e1"].stats()["last"]["model"] == "sql"
    raw = alice.chat.completions.with_raw_response.create(model="m:sql", messages=chat("third"))
    assert int(raw.headers["x-quillcache-overlap-blocks"]) >= 7
    # An adapter the engine does not serve: the engine's 404 is relayed, with the decision headers.
    with pytest.raises(openai.NotFoundError) as exc:
        alice.chat.completions.create(model="m:nosuch", messages=chat("x"))
    assert exc.value.response.headers["x-quillcache-engine"] == "e1"
    assert gw.stats()["gateway_upstream_client_errors"] == 1


def test_engine_tokenizer_json_hashes_tokens_alike_for_text_and_token_prompts(gateway, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(50)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    gw = gateway([("e1", "m", []), ("e2", "m", [])],
                 engine_keys={e: {"tokenizer": str(path), "block_size": 4} for e in ("e1", "e2")})
    client = gw.client()
    prompt = " ".join(words[:42])
    ids = tok.encode(prompt, add_special_tokens=False).ids
    assert len(ids) == 42
    first = client.completions.with_raw_response.create(model="m", prompt=prompt)
    assert first.headers["x-quillcache-plan"] == "hits=0 fetches=0 recomputes=10"
    engine = first.headers["x-quillcache-engine"]
    # The same tokens given as token ids are the same 10 blocks: a full hit on the same engine.
    again = client.completions.with_raw_response.create(model="m", prompt=ids)
    assert again.headers["x-quillcache-engine"] == engine
    assert again.headers["x-quillcache-plan"] == "hits=10 fetches=0 recomputes=0"
    assert again.parse().choices[0].text.startswith(f"served by {engine}")


# -- failures ------------------------------------------------------------------------------
def test_refusing_and_failing_engines_are_skipped_and_the_request_retried(gateway):
    gw = gateway([("a-dead", "m", None), ("b-500", "m", ["--status", "500"]), ("c-live", "m", [])])
    client = gw.client()
    raw = client.chat.completions.with_raw_response.create(model="m", messages=chat("hi"))
    assert raw.headers["x-quillcache-engine"] == "c-live"
    assert raw.headers["x-quillcache-plan"] == "hits=0 fetches=0 recomputes=8"  # c-live's own plan
    assert text_of(raw.parse()).startswith("served by c-live")
    # The same prefix again: a-dead and b-500 cool down, the router's pick is c-live, which holds it now.
    raw = client.chat.completions.with_raw_response.create(model="m", messages=chat("hi again"))
    assert raw.headers["x-quillcache-engine"] == "c-live"
    assert raw.headers["x-quillcache-plan"] == "hits=8 fetches=0 recomputes=0"
    s = gw.stats()
    assert s["gateway_retries"] == 2 and s["gateway_upstream_errors"] == 2 and s["gateway_engines_cooling"] == 2
    # While they cool down, the failed engines are passed over.
    raw = client.chat.completions.with_raw_response.create(model="m", messages=chat("hi", "short"))
    assert raw.headers["x-quillcache-engine"] == "c-live"
    assert raw.headers["x-quillcache-plan"] == "hits=0 fetches=0 recomputes=0"
    assert gw.stats()["gateway_retries"] == 2
    assert gw.engines["b-500"].stats()["requests"] == 1
    assert gw.in_flight() == {"a-dead": 0, "b-500": 0, "c-live": 0}


def test_an_engine_killed_before_its_first_byte_is_replaced_by_the_next_best(gateway):
    gw = gateway([("k1", "m", ["--delay-ms", "5000"]), ("k2", "m", [])])
    client = gw.client()
    out: dict = {}

    def ask():
        with client.chat.completions.with_streaming_response.create(model="m", messages=chat("hi"),
                                                                    stream=True) as response:
            out["engine"] = response.headers["x-quillcache-engine"]
            out["text"] = "".join(c.choices[0].delta.content or "" for c in response.parse() if c.choices)

    t = threading.Thread(target=ask)
    t.start()
    assert wait_until(lambda: gw.engines["k1"].stats()["open"] == 1)
    t0 = time.monotonic()
    gw.engines["k1"].kill()
    t.join(10)
    assert not t.is_alive()
    # k1 had answered its headers (sent on with the decision naming it); the body came from k2.
    assert out["engine"] == "k1"
    # at once, not after the 30 s first-byte timeout
    assert out["text"].startswith("served by k2") and time.monotonic() - t0 < 15
    s = gw.stats()
    assert s["gateway_retries"] == 1 and s["gateway_completed"] == 1 and s["gateway_stream_errors"] == 0
    assert gw.in_flight() == {"k1": 0, "k2": 0}


def test_an_engine_failing_mid_stream_ends_it_with_an_error_event(gateway):
    gw = gateway([("e1", "m", ["--chunk-delay-ms", "3000"])])
    stream = gw.client().chat.completions.create(model="m", messages=chat("hi"), stream=True)
    chunks = iter(stream)
    assert next(chunks).choices[0].delta.content == "served by e1"
    gw.engines["e1"].kill()
    with pytest.raises(openai.APIError, match="failed mid-answer"):
        next(chunks)
    s = gw.stats()
    assert s["gateway_stream_errors"] == 1 and s["gateway_in_flight"] == 0
    assert gw.in_flight() == {"e1": 0}


def test_engines_silent_before_or_after_their_first_byte_time_out(gateway):
    gw = gateway([("a-mute", "m", ["--delay-ms", "30000"]), ("b-ok", "m", []),
                  ("stall", "s", ["--chunk-delay-ms", "30000"])],
                 env={"QUILLD_GATEWAY_FIRST_BYTE_TIMEOUT_MS": "800"})
    client = gw.client()
    t0 = time.monotonic()
    raw = client.chat.completions.with_raw_response.create(model="m", messages=chat("hi"))
    assert text_of(raw.parse()).startswith("served by b-ok")  # a-mute's headers went out, then b-ok answered
    assert 0.8 <= time.monotonic() - t0 < 15  # a-mute given up after 800 ms, not after its 30 s
    assert wait_until(lambda: gw.engines["a-mute"].stats()["cancelled"] == 1)
    chunks = iter(client.chat.completions.create(model="s", messages=chat("hi"), stream=True))
    assert next(chunks).choices[0].delta.content == "served by stall"
    t0 = time.monotonic()
    with pytest.raises(openai.APIError, match="no byte for 800 ms"):
        next(chunks)
    assert 0.8 <= time.monotonic() - t0 < 15  # not the stall's 30 s
    s = gw.stats()
    assert s["gateway_retries"] == 1 and s["gateway_stream_errors"] == 1 and s["gateway_in_flight"] == 0
    assert wait_until(lambda: gw.engines["stall"].stats()["cancelled"] == 1)
    assert gw.in_flight() == {"a-mute": 0, "b-ok": 0, "stall": 0}


def test_a_client_disconnect_releases_the_engine_and_closes_the_upstream_request(gateway):
    # a TTFT budget of 60 s: however slow the machine, the client leaves before it runs out
    gw = gateway([("e1", "m", ["--delay-ms", "10000"])], env={"QUILLD_GATEWAY_TTFT_SLO_MS": "60000"})
    body = json.dumps({"model": "m", "messages": chat("hi"), "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=HTTP_TIMEOUT)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # the headers, long before any chunk
    assert gw.in_flight() == {"e1": 1} and gw.engines["e1"].stats()["open"] == 1
    import redis

    r = redis.Redis(port=gw.resp_port, socket_timeout=10, protocol=2)
    r.execute_command("SCOPE", "m", "")

    def candidates() -> dict[bytes, int]:
        reply = r.execute_command("ROUTE", json.dumps({"blocks": [1]}))
        decision = dict(zip(reply[::2], reply[1::2]))
        return {c[1]: dict(zip(c[::2], c[1::2]))[b"in_flight"] for c in decision[b"candidates"]}

    assert candidates() == {b"e1": 1}
    sock.close()
    assert wait_until(lambda: gw.in_flight() == {"e1": 0})
    assert candidates() == {b"e1": 0}
    assert wait_until(lambda: gw.engines["e1"].stats()["cancelled"] == 1)
    assert gw.engines["e1"].stats()["open"] == 0
    s = gw.stats()
    assert s["gateway_client_disconnects"] == 1 and s["gateway_in_flight"] == 0
    assert s["gateway_slo_counted"] == 0  # it left before its budget ran out: not counted


def test_goodput_is_the_share_of_first_bytes_within_the_slo(gateway):
    # "slow" waits 1.3 s before its first byte, so it can never make the 1 s SLO; "fast" answers at
    # once and makes it with room for a loaded machine; the budgeted one has 10 s
    gw = gateway([("fast", "fast", []), ("slow", "slow", ["--delay-ms", "1300"])],
                 env={"QUILLD_GATEWAY_TTFT_SLO_MS": "1000"})
    client = gw.client()
    plan = ["fast", "slow", "fast", "slow", "fast"] + ["slow-with-budget"]
    measured_within = 0
    for model in plan:
        budget = 10_000 if model == "slow-with-budget" else 1000
        headers = {"x-quillcache-ttft-slo-ms": str(budget)} if budget != 1000 else None
        t0 = time.perf_counter()
        stream = client.chat.completions.create(model=model.split("-")[0], messages=chat("hi"), stream=True,
                                                extra_headers=headers)
        first = next(iter(stream))
        ttft_ms = (time.perf_counter() - t0) * 1000
        assert first.choices[0].delta.content.startswith("served by")
        measured_within += ttft_ms <= budget
        list(stream)
    with pytest.raises(openai.BadRequestError):  # refused requests are not counted
        client.chat.completions.create(model="fast", messages=[])
    s = gw.stats()
    assert s["gateway_slo_counted"] == len(plan) and s["gateway_within_slo"] == 4, (s, measured_within)
    assert s["gateway_goodput"] == pytest.approx(4 / len(plan))
    assert s["gateway_ttft_slo_ms"] == 1000
    assert 0 < s["gateway_ttft_p50_ms"] < 1000 < 1300 <= s["gateway_ttft_p99_ms"]
    # the same figures in INFO, /v1/stats and /metrics
    info = redis.Redis(port=gw.resp_port).info("gateway")
    assert info["gateway_goodput"] == pytest.approx(4 / len(plan))
    assert http_json(gw.admin_port, "GET", "/v1/stats")[1]["gateway"]["gateway_within_slo"] == 4
    with urllib.request.urlopen(f"http://127.0.0.1:{gw.admin_port}/metrics", timeout=HTTP_TIMEOUT) as resp:
        metrics = resp.read().decode()
    assert "quilld_gateway_within_slo_total 4" in metrics  # a counter (prometheus-client)


def test_errors_are_openai_shaped_400_404_503(gateway):
    gw = gateway([("e1", "m", []), ("gone", "dead-model", None), ("bad-tok", "bt", [])],
                 engine_keys={"bad-tok": {"tokenizer": "/nonexistent/tokenizer.json"}})
    client = gw.client()
    cases = [
        (lambda: client.chat.completions.create(model="m", messages=[]), openai.BadRequestError, "missing_messages"),
        (lambda: client.chat.completions.create(model="", messages=chat("x")), openai.BadRequestError,
         "missing_model"),
        (lambda: client.completions.create(model="m", prompt=[]), openai.BadRequestError, "missing_prompt"),
        (lambda: client.chat.completions.create(model="nope", messages=chat("x")), openai.NotFoundError,
         "model_not_found"),
        (lambda: client.chat.completions.create(model="dead-model", messages=chat("x")), openai.InternalServerError,
         "no_healthy_engine"),
    ]
    for call, error, code in cases:
        with pytest.raises(error) as exc:
            call()
        assert exc.value.code == code, exc.value.body
        assert isinstance(exc.value.body["message"], str) and exc.value.body["type"]
    assert exc.value.status_code == 503 and "gone" in exc.value.body["message"]
    with pytest.raises(openai.InternalServerError) as exc:  # a configuration error, said as such
        client.completions.create(model="bt", prompt="x")
    assert exc.value.status_code == 500 and exc.value.code == "tokenizer_unavailable"
    assert "/nonexistent/tokenizer.json" in exc.value.body["message"]
    status, body = http_json(gw.port, "POST", "/v1/chat/completions", raw=b"{not json")
    assert status == 400 and body["error"]["code"] == "invalid_json" and body["error"]["type"]
    status, body = http_json(gw.port, "POST", "/v1/completions", {"model": "m", "prompt": "x"},
                             headers={"x-quillcache-ttft-slo-ms": "soon"})
    assert status == 400 and "x-quillcache-ttft-slo-ms" in body["error"]["message"]
    status, body = http_json(gw.port, "POST", "/v1/embeddings", {"model": "m", "input": "x"})
    assert status == 404 and body["error"]["code"] == "unknown_url"
    s = gw.stats()
    assert s["gateway_bad_requests"] == 5 and s["gateway_unknown_model"] == 1 and s["gateway_unavailable"] == 1
    assert s["gateway_slo_counted"] == 2 and s["gateway_goodput"] == 0.0  # the 503 and the 500: both missed


def test_malformed_json_bodies_answer_400_never_500(gateway):
    """Issue 11, finding 12: a body nested too deeply, or not JSON at all, is an OpenAI-shaped 400
    on both completion routes, and the engine never sees it."""
    gw = gateway([("e1", "m", [])])
    deep_content = json.dumps({"model": "m", "messages": [{"role": "user", "content": None}]}).encode() \
        .replace(b"null", b"[" * 200 + b"]" * 200)
    bodies = [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 5_000 + b"1" + b"}" * 5_000, deep_content,
              b"\xff\xfe\xfd", b"", b'{"model": "m", "prompt": "x", "max_tokens": ' + b"9" * 5_000 + b"}"]
    for path in ("/v1/chat/completions", "/v1/completions"):
        for raw in bodies:
            status, body = http_json(gw.port, "POST", path, raw=raw)
            assert status == 400, (path, raw[:40], status, body)
            assert body["error"]["code"] == "invalid_json" and body["error"]["type"] == "invalid_request_error"
    assert gw.engines["e1"].stats()["requests"] == 0
    assert gw.stats()["gateway_bad_requests"] == 2 * len(bodies)
    assert gw.client().completions.create(model="m", prompt="still serving").choices[0].text


FORGED_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "attacker",
             "remote_block_ids": [0, 1, 2], "remote_host": "203.0.113.9", "remote_port": 4444}


def test_a_clients_kv_transfer_params_and_cache_salt_never_reach_the_engine(gateway):
    """Issue 29, item 18: the gateway owns `kv_transfer_params` (a KV connector reads KV from the host,
    port, engine and blocks they name) and `cache_salt` (it partitions an engine's prefix cache by
    tenant): a client's are dropped on chat and completions, streamed or not, for a LoRA adapter
    too, and counted; the rest of the request reaches the engine as sent."""
    gw = gateway([("e1", "m", ["--lora", "ad"])])
    client, engine = gw.client(), gw.engines["e1"]
    forged = {"kv_transfer_params": FORGED_KV, "cache_salt": "another-tenant's-salt"}
    calls = [
        lambda s: client.chat.completions.create(model="m", messages=chat("hi"), stream=s, extra_body=forged,
                                                 max_tokens=7),
        lambda s: client.completions.create(model="m", prompt="Once upon a time", stream=s, extra_body=forged,
                                            max_tokens=7),
        lambda s: client.completions.create(model="m:ad", prompt="Once upon a time", stream=s,
                                            extra_body={"kv_transfer_params": FORGED_KV}, max_tokens=7),
    ]
    for i, call in enumerate(calls):
        for stream in (False, True):
            answer = call(stream)
            if stream:
                list(answer)
            last = engine.stats()["last"]
            assert "kv_transfer_params" not in last and "cache_salt" not in last, last
            assert last["max_tokens"] == 7 and last["stream"] is stream and last["model"] == ("ad" if i == 2 else "m")
    s = gw.stats()
    assert s["gateway_dropped_kv_transfer_params"] == 6 and s["gateway_dropped_cache_salt"] == 4, s
    client.completions.create(model="m", prompt="nothing forged")
    assert gw.stats()["gateway_dropped_kv_transfer_params"] == 6
