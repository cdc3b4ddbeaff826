"""The SSD tier's write mode through a real quilld on /dev/shm (tmpfs), ssd.direct_io on: INFO
persistence and the start log say whether block writes use O_DIRECT (tmpfs takes it since
Linux 6.6; older kernels refuse it and the tier falls back to buffered writes, saying why),
with direct_io off (the default) they say so, and values of
unaligned lengths demoted to SSD come back byte-identical, before and after a restart.
Values up to dram.inline_max (4 KiB) are inline in DRAM and never demoted: 1 B and 4095 B
are checked through the SSD tier itself in tests/unit/test_ssd_direct.py."""

from __future__ import annotations

import random

import redis

from conftest import ssd_node, stop_process, takes_o_direct, tiers_of, wait_until

MiB = 1 << 20
LENGTHS = [4097, 8191, 65_537, MiB + 1]


def value(i: int, n: int) -> bytes:
    return random.Random(i).randbytes(n)


def test_unaligned_values_round_trip_through_the_ssd_and_the_mode_is_reported(tmp_path, shm_dir):
    ssd_dir = shm_dir / "ssd"
    expected_mode = "direct" if takes_o_direct(shm_dir) else \
        "buffered (O_DIRECT refused at open: Invalid argument)"
    keys = {f"u{i}-{n}": (i, n) for i, n in enumerate(LENGTHS * 6)}  # about 7 MiB through an 8 MiB arena
    q = ssd_node(tmp_path, ssd_dir, ssd_size="64MiB", QUILLD_SSD_SEGMENT_SIZE="16MiB", QUILLD_SSD_DIRECT_IO="true")
    try:
        r = redis.Redis(port=q.port, socket_timeout=20)
        assert r.info("persistence")["ssd_io_mode"] == expected_mode
        for k, (i, n) in keys.items():
            r.set(k, value(i, n))
        for j in range(12):  # push the oldest out of DRAM
            r.set(f"fill{j}", value(1000 + j, MiB))
        assert wait_until(lambda: all(tiers_of(r, k) == {"ssd"} for k in list(keys)[:8]), 30), \
            "the oldest values were not demoted"
        for k, (i, n) in keys.items():
            assert r.get(k) == value(i, n), k
    finally:
        stop_process(q.proc)
    assert f"ssd tier: block writes {expected_mode}, 4 I/O threads" in q.log_path.read_text()
    q = ssd_node(tmp_path, ssd_dir, ssd_size="64MiB", QUILLD_SSD_SEGMENT_SIZE="16MiB", QUILLD_SSD_DIRECT_IO="true")
    try:
        r = redis.Redis(port=q.port, socket_timeout=20)
        info = r.info("persistence")
        assert info["recovery_dropped_corrupt"] == 0 and info["ssd_io_mode"] == expected_mode
        for k, (i, n) in keys.items():
            assert r.get(k) == value(i, n), k
    finally:
        stop_process(q.proc)


def test_the_default_is_buffered_and_says_so(tmp_path):
    q = ssd_node(tmp_path, tmp_path / "ssd", ssd_size="32MiB", QUILLD_SSD_SEGMENT_SIZE="16MiB")
    try:
        r = redis.Redis(port=q.port, socket_timeout=20)
        info = r.info("persistence")
        assert info["ssd_io_mode"] == "buffered (ssd.direct_io is off)" and info["ssd_io_threads"] == 4
    finally:
        stop_process(q.proc)
    assert "ssd tier: block writes buffered (ssd.direct_io is off), 4 I/O threads" in q.log_path.read_text()
