"""What a stop keeps, and what the next start says about it (issue 18.1, 18.2), through a
real quilld.

- 18.1: with an SSD tier a clean stop (SIGTERM) keeps every key, small values included:
  1,800 keys (1,000 metadata-sized values of 28 bytes beside 800 blocks, as LMCache's
  redis:// connector writes them) were 800 after a restart, every value of at most
  dram.inline_max bytes dropped and the log silent. Without an SSD tier the stop log
  says how many keys were not kept.
- 18.2: after a kill -9 the next start says, once, that the previous run did not stop
  cleanly, and about how many keys it held only in DRAM (the census in ssd.dir's LOCK);
  after a clean stop it says that one did. INFO persistence has both figures.
"""

from __future__ import annotations

import random
import re
import signal


from conftest import ssd_node, start_quilld, stop_process, tiers_of, wait_until

KiB = 1024
META, BLOCKS = 1000, 800


def value(name: str, size: int) -> bytes:
    return random.Random(name).randbytes(size)


def write_lmcache_like(r) -> dict[bytes, bytes]:
    """BLOCKS chunks of 64 KiB and META 28-byte metadata keys, pipelined; returns them."""
    want = {}
    pipe = r.pipeline(transaction=False)
    for i in range(max(META, BLOCKS)):
        if i < BLOCKS:
            k = b"chunk:%04d" % i
            want[k] = value(k.decode(), 64 * KiB)
            pipe.set(k, want[k])
        if i < META:
            k = b"meta:%04d" % i
            want[k] = value(k.decode(), 28)
            pipe.set(k, want[k])
        if i % 100 == 99:
            pipe.execute()
    pipe.execute()
    return want


def test_a_clean_stop_keeps_every_small_value_with_an_ssd_tier(tmp_path, nodes):
    ssd_dir = tmp_path / "ssd"
    q = ssd_node(tmp_path, ssd_dir, dram="64MiB", ssd_size="256MiB")
    nodes.append(q)
    r = q.client()
    want = write_lmcache_like(r)
    assert r.dbsize() == META + BLOCKS
    assert r.set(b"ttl:small", b"t" * 20, ex=3600) and r.set(b"ttl:block", b"T" * 20_000, px=3_600_000)
    deadline = r.pexpiretime(b"ttl:small"), r.pexpiretime(b"ttl:block")
    q.proc.send_signal(signal.SIGTERM)
    assert q.proc.wait(60) == 0, q.log()
    assert "ssd tier: every key is on SSD: the next start has them all" in q.log(), q.log()
    q = ssd_node(tmp_path, ssd_dir, dram="64MiB", ssd_size="256MiB")
    nodes.append(q)
    r = q.client()
    assert r.dbsize() == META + BLOCKS + 2  # before issue 18.1: 800, every metadata key gone
    for k, v in want.items():
        assert r.get(k) == v, k
    assert (r.pexpiretime(b"ttl:small"), r.pexpiretime(b"ttl:block")) == deadline
    assert "the previous run (pid" in q.log() and "stopped cleanly" in q.log()
    info = r.info("persistence")
    assert (info["last_run_unclean"], info["last_run_lost_keys"]) == (0, 0), info


def test_without_an_ssd_tier_the_stop_log_says_how_many_keys_are_not_kept(tmp_path):
    q = start_quilld(tmp_path, "--dram", "64MiB", admin=False)
    try:
        r = q.client()
        write_lmcache_like(r)
        assert r.dbsize() == META + BLOCKS
    finally:
        assert stop_process(q.proc) == 0
    said = re.search(r"(\d+) keys \(([\d.]+)M\) were held in DRAM only and are not kept: this node has no SSD "
                     r"tier", q.log())
    assert said and int(said[1]) == META + BLOCKS, q.log()


def test_after_a_kill_the_next_start_says_the_run_did_not_stop_cleanly_and_about_what_it_lost(tmp_path, nodes):
    ssd_dir = tmp_path / "ssd"
    q = ssd_node(tmp_path, ssd_dir, dram="32MiB", ssd_size="256MiB")
    nodes.append(q)
    r = q.client()
    for i in range(40):  # blocks the demoter takes to SSD: they survive the kill
        r.set(b"old:%02d" % i, value(f"old{i}", 1024 * KiB))
    assert wait_until(lambda: sum(tiers_of(r, b"old:%02d" % i) == {"ssd"} for i in range(40)) >= 10, timeout=30)
    pipe = r.pipeline(transaction=False)
    for i in range(330):  # small values written last: in DRAM only (DRAM is below its high watermark)
        pipe.set(b"new:%03d" % i, b"x" * 28)
    pipe.execute()
    lock = ssd_dir / "LOCK"

    def census() -> int | None:
        m = re.search(r"^dram_only=(\d+)$", lock.read_text(), re.M)
        return int(m[1]) if m else None

    counts: list[int] = []

    def settled() -> bool:  # the census (refreshed every 2 s) caught up with the node's own count
        counts[:] = [r.info("persistence")["dram_only_keys"], census() or -1]
        return counts[0] == counts[1] >= 330 and r.info("persistence")["dram_only_keys"] == counts[0]

    assert wait_until(settled, timeout=20), (counts, lock.read_text())
    dram_only = counts[0]
    assert re.search(r"^state=running$", lock.read_text(), re.M)
    q.proc.send_signal(signal.SIGKILL)
    q.proc.wait(10)

    q = ssd_node(tmp_path, ssd_dir, dram="32MiB", ssd_size="256MiB")
    nodes.append(q)
    r = q.client()
    log = q.log()
    said = re.findall(r"the previous run \(pid (\d+), started [^)]*\) did not stop cleanly \(killed or crashed\): "
                      r"about (\d+) keys it held only in DRAM were lost \(census of [\d: -]+", log)
    assert len(said) == 1, log  # once
    assert int(said[0][1]) == dram_only
    assert r.get(b"new:000") is None  # they were indeed lost
    info = r.info("persistence")
    assert (info["last_run_unclean"], info["last_run_lost_keys"]) == (1, dram_only), info
    assert stop_process(q.proc) == 0
    q = ssd_node(tmp_path, ssd_dir, dram="32MiB", ssd_size="256MiB")  # and after a clean stop, it says so
    nodes.append(q)
    assert "did not stop cleanly" not in q.log() and "stopped cleanly at" in q.log()
