"""put_blocks(..., hashes=...): blocks stored with their engine hash and parent, over shared
memory (SHM RESERVE CHAINED) and over TCP (PUT2PHASE BEGIN ... HASH h PARENT p), so ROUTE plans
to fetch them from the pool; SHM RESERVE CHAINED's keys are found for ACL rules."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
import redis
from quillclient import QuillClient

ENGINES = """
[[engines]]
id = "e1"
url = "http://127.0.0.1:9001"
model = "m"
"""


@pytest.fixture
def pool(quilld_factory, tmp_path):
    conf = tmp_path / "engines.toml"
    conf.write_text(ENGINES)
    sock_dir = tempfile.mkdtemp(prefix="qc", dir="/tmp")  # unix socket paths stay under 108 bytes
    try:
        yield quilld_factory("--config", str(conf), "--unixsocket", os.path.join(sock_dir, "q.sock"),
                             "--map-users", "default")
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def _plan(q, hashes: list[int]) -> list[bytes]:
    r = q.client(protocol=2, decode_responses=False)
    assert r.execute_command("SCOPE", "m", "t") == b"OK"
    reply = r.execute_command("ROUTE", json.dumps({"blocks": hashes}))
    r.close()
    return dict(zip(reply[::2], reply[1::2]))[b"plan"]


@pytest.mark.parametrize("transport", ["auto", "off"])
def test_blocks_put_with_their_chain_are_planned_as_pool_fetches(pool, transport):
    c = QuillClient("127.0.0.1", pool.port, scope=("m", "t"), shared_memory="require" if transport == "auto" else "off")
    try:
        hashes = [101, 102, 103, 104]
        chain = [(h, hashes[i - 1] if i else None) for i, h in enumerate(hashes)]
        data = [bytes([i]) * 40_000 for i in range(4)]
        stored = c.put_blocks([(f"{h:x}", d) for h, d in zip(hashes, data)], hashes=chain)
        assert stored == [True] * 4
        assert c.transport == ("shm" if transport == "auto" else "tcp")
        assert c.get(f"{hashes[2]:x}") == data[2]
        plan = _plan(pool, hashes + [105])
        assert [p.split(b":")[0] for p in plan] == [b"fetch"] * 4 + [b"recompute"], plan
        # stored again: complete already (kept), still credited
        assert c.put_blocks([(f"{hashes[0]:x}", data[0])], hashes=chain[:1]) == [False]
        with pytest.raises(ValueError, match="2 blocks but 1 hashes"):
            c.put_blocks([("a", b"1"), ("b", b"2")], hashes=[(1, None)])
    finally:
        c.close()


def test_shm_reserve_chained_names_its_keys_for_acl_rules(pool):
    r = pool.client(protocol=2, decode_responses=False)
    assert r.command_getkeys("SHM", "RESERVE", "0", "CHAINED", "k1", "5", "1", "", "k2", "5", "2", "1") == ["k1", "k2"]
    assert r.command_getkeys("SHM", "RESERVE", "0", "k1", "5", "k2", "5") == ["k1", "k2"]
    r.execute_command("ACL", "SETUSER", "narrow", "on", ">pw", "~ok:*", "+@all")
    n = pool.client(protocol=2, decode_responses=False, username="narrow", password="pw")
    with pytest.raises(redis.exceptions.NoPermissionError):
        n.execute_command("SHM", "RESERVE", "0", "CHAINED", "secret", "5", "1", "")
    n.close()
    r.close()
