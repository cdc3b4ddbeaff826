"""A quilld with a persistent residency index, restarted cleanly or by kill -9 (issue 23.3).

A publisher does on the wire what vLLM 0.33's does (test_kv_events.Publisher). quilld is stopped
while the engine goes on; it comes back while the engine's sockets are away, so its first ROUTE
can only come from what it persisted; then the engine comes back, quilld catches up from the
replay buffer, and what the replay proves stale (removals while quilld was down, or a publisher
that restarted meanwhile) is gone. With LMDB and RocksDB; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import pytest
import redis
import vllm_schema as vllm
import zmq
from conftest import http, wait_until
from test_kv_events import HIT, MODEL, RECOMPUTE, Publisher, admin, plan
from test_ssd_tier import tiny_fs  # noqa: F401 (a fixture: a 24 MiB tmpfs)

from quilld.index.backend import BACKENDS
from quilld.index.stores import open_store

PERSISTENT = [b for b in BACKENDS if b != "memory"]


class PausingPublisher(Publisher):
    """A publisher whose sockets can go away and come back in the same process (same sequence, same
    buffer), or that can be replaced by a new process (`restart`)."""

    def pause(self) -> None:
        self.close_sockets()

    def resume(self) -> None:
        with self.lock:  # the replay thread _open starts answers nothing before the buffer is back
            seq, buffer = self.seq, self.buffer
            self._open()
            self.seq, self.buffer = seq, buffer

    def publish_while_away(self, *events) -> int:
        """A batch published while no one can hear it: kept in the replay buffer only."""
        payload = vllm.encode(list(events), ts=time.time())
        with self.lock:
            seq, self.seq = self.seq, self.seq + 1
            self.buffer.append((seq, payload))
        return seq


@pytest.fixture
def publisher():
    p = PausingPublisher()
    try:
        yield p
    finally:
        p.close()


def config(tmp_path, pub: Publisher, backend: str) -> str:
    path = tmp_path / "persistent.toml"
    path.write_text(f"""[index]
backend = "{backend}"
path = "{tmp_path / 'index'}"
commit_ms = 20

[[engines]]
id = "vllm-0"
url = "http://127.0.0.1:9"
model = "{MODEL}"
kv_events = "tcp://127.0.0.1:{pub.pub_port}"
replay = "tcp://127.0.0.1:{pub.replay_port}"
""")
    return str(path)


def feed(q) -> dict:
    return {e["id"]: e["feed"] for e in admin(q, "/v1/engines")["engines"]}["vllm-0"]


def start(quilld_factory, conf: str):
    q = quilld_factory("--dram", "64MiB", "--config", conf)
    r = q.client(protocol=2)
    assert r.execute_command("SCOPE", MODEL, "") == b"OK"
    return q, r


A, B, C = list(range(1, 9)), list(range(11, 19)), list(range(21, 25))


def fill(publisher: PausingPublisher, q, r) -> int:
    """Chains A and B stored by the engine, seen by ROUTE and committed; returns the last seq."""
    assert wait_until(lambda: feed(q)["state"] == "live", timeout=10)
    publisher.publish(vllm.gpu(A))
    last = publisher.publish(vllm.gpu(B, parent=A[-1]))
    assert wait_until(lambda: plan(r, A + B) == [HIT] * 16, timeout=10)
    assert wait_until(lambda: feed(q)["persisted_seq"] == last, timeout=10), feed(q)
    return last


@pytest.mark.parametrize("backend", PERSISTENT)
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_restart_routes_on_what_the_engine_held_then_catches_up(backend, how, publisher, quilld_factory, tmp_path):
    conf = config(tmp_path, publisher, backend)
    q, r = start(quilld_factory, conf)
    committed = fill(publisher, q, r)
    publisher.publish(vllm.removed(B[4:]), vllm.gpu(C))  # killed: may or may not be committed when quilld goes
    if how == "kill":
        q.proc.send_signal(signal.SIGKILL)
        q.proc.wait(10)
    else:  # applied, perhaps not yet committed: a clean stop commits it
        assert wait_until(lambda: plan(r, C) == [HIT] * 4, timeout=10)
        assert q.stop() == 0
    publisher.pause()
    publisher.publish_while_away(vllm.removed([A[-1]]))  # the engine evicts while quilld is down
    q2, r2 = start(quilld_factory, conf)
    # the engine is unreachable: this ROUTE can only come from the persisted index
    first = plan(r2, A[:-1])
    assert first == [HIT] * 7, first
    assert feed(q2)["persisted_seq"] >= committed and feed(q2)["batches"] == 0
    if how == "stop":  # a clean stop committed everything applied
        assert feed(q2)["persisted_seq"] == committed + 1 and plan(r2, C) == [HIT] * 4
    publisher.resume()
    want = [HIT] * 7 + [RECOMPUTE], [HIT] * 4 + [RECOMPUTE] * 4
    assert wait_until(lambda: (plan(r2, A), plan(r2, B)) == want, timeout=15), (plan(r2, A), plan(r2, B))
    assert plan(r2, C) == [HIT] * 4 and feed(q2)["restarts"] == 0 and feed(q2)["drops"] == 0
    assert wait_until(lambda: feed(q2)["persisted_seq"] == publisher.seq - 1, timeout=10)


@pytest.mark.parametrize("backend", PERSISTENT)
def test_a_publisher_that_restarted_while_quilld_was_down_leaves_no_stale_entry(backend, publisher, quilld_factory,
                                                                                tmp_path):
    conf = config(tmp_path, publisher, backend)
    q, r = start(quilld_factory, conf)
    fill(publisher, q, r)
    q.proc.send_signal(signal.SIGKILL)
    q.proc.wait(10)
    publisher.pause()
    q2, r2 = start(quilld_factory, conf)
    assert plan(r2, A) == [HIT] * 8  # what it held, until proven stale
    publisher.restart()  # a new vLLM process: empty cache, sequence from 0, other batches
    for i in range(3):
        publisher.publish(vllm.gpu([100 + i]))
    assert wait_until(lambda: plan(r2, [100, 101, 102]) == [HIT] * 3, timeout=15)
    assert plan(r2, A + B) == [RECOMPUTE] * 16
    f = feed(q2)
    assert f["restarts"] == 1 and f["drops"] == 1
    assert wait_until(lambda: feed(q2)["persisted_seq"] == 2, timeout=10)
    # and that is what a third start routes on
    q2.proc.send_signal(signal.SIGKILL)
    q2.proc.wait(10)
    publisher.pause()
    q3, r3 = start(quilld_factory, conf)
    assert plan(r3, [100, 101, 102]) == [HIT] * 3 and plan(r3, A) == [RECOMPUTE] * 8


@pytest.mark.parametrize("backend", PERSISTENT)
def test_a_kill_during_ingest_recovers_a_committed_state_and_converges(backend, publisher, quilld_factory, tmp_path):
    """kill -9 while batches stream in: the next start holds the entries of exactly the batches up to its
    persisted sequence number (never a part of one commit), and the replay brings the rest."""
    conf = config(tmp_path, publisher, backend)
    q, r = start(quilld_factory, conf)
    assert wait_until(lambda: feed(q)["state"] == "live", timeout=10)
    stop = threading.Event()

    def stream() -> None:  # block i stored by batch i (and block i - 50 evicted by it)
        i = 0
        while not stop.is_set() and i < 3000:
            events = [vllm.gpu([1000 + i])] + ([vllm.removed([1000 + i - 50])] if i >= 50 else [])
            publisher.publish(*events)
            i += 1

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    assert wait_until(lambda: (feed(q)["persisted_seq"] or 0) > 200, timeout=20)
    q.proc.send_signal(signal.SIGKILL)
    q.proc.wait(10)
    stop.set()
    streamer.join(10)
    publisher.pause()
    q2, r2 = start(quilld_factory, conf)
    seq = feed(q2)["persisted_seq"]
    assert seq > 200
    resident = [1000 + i for i in range(max(0, seq - 49), seq + 1)]
    assert plan(r2, resident) == [HIT] * len(resident)  # the 50 blocks batches 0..seq leave
    assert plan(r2, [1000 + seq - 50]) == [RECOMPUTE] and plan(r2, [1000 + seq + 1]) == [RECOMPUTE]
    publisher.resume()
    last = publisher.seq - 1
    tail = [1000 + i for i in range(last - 49, last + 1)]
    assert wait_until(lambda: plan(r2, tail) == [HIT] * 50, timeout=20)
    assert plan(r2, [1000 + last - 50]) == [RECOMPUTE] and feed(q2)["drops"] == 0


def test_an_index_that_cannot_write_on_a_full_disk_costs_no_ssd_flush(publisher, quilld_factory, tmp_path, tiny_fs):
    """Issue 29.21: RocksDB's close raised on a full disk and Node.stop, calling it unguarded before
    the SSD tier's stop, skipped the flush: 0 of 100 DRAM values came back (100 of 100 on a roomy
    disk), and /healthz said ok meanwhile."""
    conf = tmp_path / "full-index.toml"
    conf.write_text(f"""[index]
backend = "rocksdb"
path = "{tiny_fs / 'index'}"
commit_ms = 20

[[engines]]
id = "vllm-0"
url = "http://127.0.0.1:9"
model = "{MODEL}"
kv_events = "tcp://127.0.0.1:{publisher.pub_port}"
replay = "tcp://127.0.0.1:{publisher.replay_port}"
""")
    ssd = ["--ssd-dir", str(tmp_path / "ssd"), "--ssd-size", "64MiB"]
    env = {"QUILLD_SSD_SEGMENT_SIZE": "32MiB"}
    with open(tiny_fs / "filler", "wb", buffering=0) as f:  # the index's disk: 1 MiB left
        try:
            while True:
                f.write(b"\0" * (1 << 20))
        except OSError:
            pass
        f.truncate(max(0, f.tell() - (1 << 20)))
    q = quilld_factory("--dram", "64MiB", "--config", str(conf), *ssd, env=env)
    r = q.client(protocol=2)
    assert r.execute_command("SCOPE", MODEL, "") == b"OK"
    fill(publisher, q, r)

    def health():
        status, _, body = http(q.admin_port, "GET", "/healthz")
        return status, json.loads(body)

    deadline, n = time.monotonic() + 30, 100
    while health()[1]["status"] == "ok" and time.monotonic() < deadline:  # until a commit fails: disk full
        publisher.publish(vllm.gpu(list(range(n, n + 4000))))
        n += 4000
        time.sleep(0.1)
    status, seen = health()
    values = {f"v{i}": os.urandom(4096) for i in range(100)}
    plain = redis.Redis(port=q.port)
    for k, v in values.items():
        plain.set(k, v)
    code = q.stop()
    q2 = quilld_factory("--dram", "64MiB", *ssd, env=env)  # the memory index: only the SSD tier is asked
    r2 = redis.Redis(port=q2.port)
    back = sum(r2.get(k) == v for k, v in values.items())
    assert back == 100, f"{back} of 100 DRAM values came back after the stop"
    assert code == 1 and "stopping the control plane" in q.log() and "every key is on SSD" in q.log(), q.log()
    assert status == 503 and seen["status"] == "degraded", seen
    assert any("the residency index cannot write" in why for why in seen["reasons"]), seen


def _truncate(path) -> None:
    data = path / "lmdb" / "data.mdb"
    os.truncate(data, os.path.getsize(data) // 2 // 4096 * 4096)


def _garble_pages(path) -> None:
    data = path / "lmdb" / "data.mdb"
    rng = random.Random(29)
    with open(data, "r+b") as f:
        for page in range(2, os.path.getsize(data) // 4096):  # every page but the two meta pages
            f.seek(page * 4096 + 16)
            f.write(rng.randbytes(200))


def _not_json(path) -> None:
    store = open_store("lmdb", path)
    try:
        keys, _ = store.scan(b"s")  # the scope records: JSON
        store.write([(keys[0], b"\xffnot json")], [])
    finally:
        store.close()


@pytest.mark.parametrize("damage", [_truncate, _garble_pages, _not_json], ids=["truncated", "page", "not-json"])
def test_a_damaged_lmdb_index_is_set_aside_and_rebuilt_from_the_replay(damage, publisher, quilld_factory, tmp_path):
    """Issue 29.20: a truncated data.mdb killed quilld with SIGBUS before anything was logged; a
    damaged page or a record that is not JSON exited 1 with a traceback."""
    conf = config(tmp_path, publisher, "lmdb")
    q, r = start(quilld_factory, conf)
    fill(publisher, q, r)
    assert q.stop() == 0
    damage(tmp_path / "index")
    q2, r2 = start(quilld_factory, conf)
    lines = [line for line in q2.log().splitlines() if "is damaged" in line]
    assert len(lines) == 1 and "starting empty" in lines[0], q2.log()
    assert "Traceback" not in q2.log()
    assert [p.name for p in (tmp_path / "index").iterdir() if p.name.startswith("lmdb.damaged-")]
    # the engine's replay buffer gives back what the index held
    assert wait_until(lambda: plan(r2, A + B) == [HIT] * 16, timeout=15), plan(r2, A + B)
    assert q2.stop() == 0
    q3, r3 = start(quilld_factory, conf)  # the new index was committed: no damage now
    assert "is damaged" not in q3.log() and plan(r3, A + B) == [HIT] * 16
