"""ROUTE's hash forms over the wire: redis-py in RESP2 and RESP3 and quillclient against a real
quilld with configured engines get the JSON form's decision."""

from __future__ import annotations

import json
import struct

import pytest
from quillclient import QuillClient

ENGINES = """
[[engines]]
id = "e1"
url = "http://127.0.0.1:9001"
model = "m"

[[engines]]
id = "e2"
url = "http://127.0.0.1:9002"
model = "m"
"""
CHAIN = [11, 12, 13, (1 << 64) - 5, 15]


@pytest.fixture
def node(quilld_factory, tmp_path):
    conf = tmp_path / "engines.toml"
    conf.write_text(ENGINES)
    q = quilld_factory("--config", str(conf))
    r = q.client(protocol=2)
    r.execute_command("SCOPE", "m", "")
    for engine, hashes, medium in (("e1", CHAIN[:2], "GPU"), ("e2", CHAIN[:4], "CPU")):
        batch = {"events": [{"type": "block_stored", "block_hashes": hashes, "block_size": 16, "medium": medium}]}
        assert r.execute_command("KVEVENTS", engine, json.dumps(batch)) == 1
    return q


@pytest.mark.parametrize("protocol", [2, 3])
def test_redis_py_gets_one_decision_in_every_form(node, protocol):
    r = node.client(protocol=protocol)
    r.execute_command("SCOPE", "m", "")
    want = r.execute_command("ROUTE", json.dumps({"blocks": CHAIN, "decode_tokens": 32}))
    packed = struct.pack("<5Q", *CHAIN)
    assert r.execute_command("ROUTE", "HASHES", 5, *CHAIN, "DECODE_TOKENS", 32) == want
    assert r.execute_command("ROUTE", "PACKED", packed, "DECODE_TOKENS", 32) == want
    engine, url, cost, lease, runs = r.execute_command("ROUTE", "PACKED", packed, "DECODE_TOKENS", 32, "COMPACT")
    full = want if protocol == 3 else dict(zip(want[::2], want[1::2]))
    assert (engine, url, float(cost), lease) == (b"e2", b"http://127.0.0.1:9002", float(full[b"cost"]), None)
    assert runs == [b"hit:e2:cpu", 4, b"recompute", 1]
    with pytest.raises(Exception, match="ROUTE HASHES: 5 hashes announced, 4 given"):
        r.execute_command("ROUTE", "HASHES", 5, *CHAIN[:4])


def test_quillclient_routes_with_the_packed_form(node):
    with QuillClient("127.0.0.1", node.port, scope=("m", "")) as c:
        full = c.route(blocks=CHAIN, decode_tokens=32)
        assert full["engine"] == "e2" and full["plan"] == ["hit:e2:cpu"] * 4 + ["recompute"]
        assert [x["engine"] for x in full["candidates"]] == ["e1", "e2"]
        signed = [h - (1 << 64) if h >= 1 << 63 else h for h in CHAIN]
        assert c.route(blocks=signed, decode_tokens=32) == full
        assert c.route(blocks=[format(h, "016x") for h in CHAIN], decode_tokens=32) == full  # hex: HASHES
        compact = c.route(blocks=CHAIN, decode_tokens=32, candidates=False, acquire=True)
        assert {k: compact[k] for k in ("engine", "url", "cost", "plan")} == \
            {k: full[k] for k in ("engine", "url", "cost", "plan")}
        assert compact["lease"] and c.release(compact["lease"])
        assert c.route(tokens=list(range(40)))["plan"] == ["recompute"] * 2  # tokens still go as JSON
