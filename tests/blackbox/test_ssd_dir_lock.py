"""One quilld per SSD directory: a second one pointed at it is refused with one clear line.

Two processes on one tier would each allocate pages the other holds and replay the
other's log as their own; the first's blocks would be overwritten. The owner flocks
`LOCK` in the directory (with its pid in it); the lock goes with the process, so a
quilld killed with -9 leaves nothing to remove by hand.
"""

from __future__ import annotations

import os

import pytest

from conftest import run_quilld, ssd_node, stop_process

pytestmark = pytest.mark.timeout(120)


def test_a_second_quilld_on_the_same_ssd_dir_is_refused_and_the_first_keeps_its_blocks(tmp_path):
    ssd_dir = tmp_path / "ssd"
    q = ssd_node(tmp_path, ssd_dir)
    try:
        r = q.client()
        values = {b"k%d" % i: os.urandom(64 * 1024) for i in range(400)}  # 25 MiB: most go to SSD
        for k, v in values.items():
            r.set(k, v)
        other = run_quilld("--port", "0", "--admin-port", "0", "--dram", "8MiB", "--ssd-dir", str(ssd_dir),
                           "--ssd-size", "128MiB", env={"QUILLD_SSD_SEGMENT_SIZE": "32MiB"})
        assert other.returncode == 2, (other.stdout, other.stderr)
        assert f"quilld: ssd.dir {ssd_dir} is in use by another quilld (pid {q.proc.pid}); two processes on " \
               "one SSD tier would overwrite each other's blocks" in other.stderr, other.stderr
        assert "Traceback" not in other.stderr
        assert all(r.get(k) == v for k, v in values.items())
    finally:
        assert stop_process(q.proc) == 0, q.log()
    q = ssd_node(tmp_path, ssd_dir)  # the lock went with the first: the directory opens again
    try:
        r = q.client()
        assert r.info("persistence")["recovery_dropped_corrupt"] == 0
        assert all(r.get(k) == v for k, v in values.items())
    finally:
        stop_process(q.proc)


def test_the_lock_of_a_killed_quilld_does_not_stand_in_the_way(tmp_path):
    ssd_dir = tmp_path / "ssd"
    q = ssd_node(tmp_path, ssd_dir)
    q.proc.kill()
    q.proc.wait()
    assert (ssd_dir / "LOCK").exists()
    q = ssd_node(tmp_path, ssd_dir)
    try:
        assert q.client().ping()
    finally:
        assert stop_process(q.proc) == 0, q.log()
