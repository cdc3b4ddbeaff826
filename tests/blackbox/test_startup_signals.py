"""Issue 11, finding 10: SIGINT and SIGTERM stop a real quilld cleanly at any moment of its start.

The SSD tier is filled through a real quilld with a small arena (every value
a block: inline_max 0), so about 20,000 blocks are demoted to SSD as they are
written, and that quilld is killed (-9): no checkpoint, so the next recovery
replays the whole log, a second or more, in which the signal is sent. Each
run asserts a clean exit, a log line naming the signal and the start step it
interrupted, that nothing was served, and that the next start recovers every
block intact.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, ignoring_sigint, start_quilld, stop_process, wait_until

pytestmark = pytest.mark.timeout(240)

MiB = 1024 * 1024
WRITTEN = 24_000  # values written; all but what the 16 MiB arena holds (about 4,000) are demoted to SSD
SSD_SIZE, SEGMENT = 256 * MiB, 32 * MiB  # 20,000 demoted blocks of 2 pages each (head page + payload page)
SSD_ENV = {"QUILLD_SSD_SEGMENT_SIZE": str(SEGMENT), "QUILLD_DRAM_INLINE_MAX": "0"}
WAIT = 60.0  # seconds any one step may take on a slow, shared machine


def value(i: int) -> bytes:
    return b"block %08d " % i * 4


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[Path, int]:
    """(an SSD tier directory left by kill -9, without a checkpoint; the blocks it holds)."""
    tmp = tmp_path_factory.mktemp("ssd")
    path = tmp / "pristine"
    q = start_quilld(tmp, "--dram", "16MiB", "--ssd-dir", str(path), "--ssd-size", str(SSD_SIZE), admin=False,
                     env=SSD_ENV)
    try:
        r = q.client()
        for start in range(0, WRITTEN, 1_000):
            pipe = r.pipeline(transaction=False)
            for i in range(start, start + 1_000):
                pipe.set(b"block-%08d" % i, value(i))
            pipe.execute()
        # demotion done: what is on SSD stops growing
        last = [-1]

        def settled() -> bool:
            keys = r.info("persistence")["ssd_keys"]
            done, last[0] = keys == last[0], keys
            return done and keys >= WRITTEN // 2
        assert wait_until(settled, timeout=WAIT, interval=0.5), r.info("persistence")
    finally:
        q.proc.kill()
        q.proc.wait()
    # What the kill left durable is known only to a recovery: a group commit can still have been
    # in flight (and ssd_keys counts it). An undisturbed recovery of a copy is the reference the
    # interrupted ones must match.
    reference = tmp / "reference"
    shutil.copytree(path, reference)
    q = start_quilld(tmp, "--dram", "64MiB", "--ssd-dir", str(reference), "--ssd-size", str(SSD_SIZE), admin=False,
                     env=SSD_ENV)
    try:
        info = q.client().info("persistence")
    finally:
        assert stop_process(q.proc, timeout=WAIT) == 0, q.log()
    assert info["recovery_dropped_corrupt"] == 0 and info["recovery_blocks"] >= WRITTEN // 2, info
    shutil.rmtree(reference)
    return path, info["recovery_blocks"]


def spawn(ssd_dir: Path, log: Path, ignore_sigint: bool = False) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")}
    env.update(SSD_ENV, PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "quilld", "--port", "0", "--admin-port", "0", "--dram", "64MiB",
            "--ssd-dir", str(ssd_dir), "--ssd-size", str(SSD_SIZE)]
    # a shell's background job starts with SIGINT ignored: Ctrl-C must stop quilld all the same
    with open(log, "wb") as f:
        return subprocess.Popen(ignoring_sigint(argv) if ignore_sigint else argv, stdout=f, stderr=subprocess.STDOUT,
                                cwd=ROOT, env=env)


def wait_for_line(log: Path, text: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + WAIT
    while text not in log.read_text(errors="replace"):
        assert proc.poll() is None, f"quilld exited ({proc.returncode}) before {text!r}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} within {WAIT} s:\n{log.read_text()}"
        time.sleep(0.005)


def wait_exit(proc: subprocess.Popen, log: Path) -> int:
    try:
        return proc.wait(WAIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"quilld still running {WAIT} s after the signal:\n{log.read_text()}")


def assert_intact(tmp_path: Path, ssd_dir: Path, blocks: int) -> None:
    """The next start recovers every block, none dropped, and serves their bytes."""
    q = start_quilld(tmp_path, "--dram", "64MiB", "--ssd-dir", str(ssd_dir), "--ssd-size", str(SSD_SIZE),
                     admin=False, env=SSD_ENV)
    try:
        r = q.client()
        info = r.info("persistence")
        assert "recovery_blocks" in info, f"{info}\n{q.log()}"
        assert (info["recovery_blocks"], info["recovery_dropped_corrupt"], info["recovery_wal_stops"]) \
            == (blocks, 0, 0), info
        for i in (0, 1, 1_234, blocks // 2):  # the oldest values were demoted first
            assert r.get(b"block-%08d" % i) == value(i), i
    finally:
        assert stop_process(q.proc, timeout=WAIT) == 0, q.log()


@pytest.mark.parametrize("sig, ignore_sigint", [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["SIGINT-from-a-background-job", "SIGTERM"])
def test_a_signal_during_ssd_recovery_stops_cleanly(pristine, tmp_path, sig, ignore_sigint):
    ssd_dir, blocks = tmp_path / "ssd", pristine[1]
    shutil.copytree(pristine[0], ssd_dir)
    log = tmp_path / "quilld.log"
    proc = spawn(ssd_dir, log, ignore_sigint)
    wait_for_line(log, "ssd tier: recovering", proc)
    proc.send_signal(sig)
    assert wait_exit(proc, log) == 0
    text = log.read_text()
    said = f"{sig.name} received while starting (recovering the SSD tier): stopping without serving"
    assert said in text, text
    assert text.index(said) < text.index(f"recovered {blocks} values"), "the signal came after recovery"
    assert "listening on" not in text and "quilld ready" not in text  # it never served
    assert text.rstrip().endswith("quilld stopped") and "Traceback" not in text, text
    assert_intact(tmp_path, ssd_dir, blocks)


def test_ctrl_c_twice_exits_at_once_and_recovery_copes(pristine, tmp_path):
    """As redis: a second SIGINT while stopping exits without waiting; the SSD tier is crash-safe."""
    ssd_dir, blocks = tmp_path / "ssd", pristine[1]
    shutil.copytree(pristine[0], ssd_dir)
    log = tmp_path / "quilld.log"
    proc = spawn(ssd_dir, log)
    wait_for_line(log, "ssd tier: recovering", proc)
    proc.send_signal(signal.SIGINT)
    wait_for_line(log, "waiting for recovery to finish", proc)
    proc.send_signal(signal.SIGINT)
    assert wait_exit(proc, log) == 1
    text = log.read_text()
    assert "SIGINT received again while stopping: exiting now, without a clean stop" in text, text
    assert "quilld stopped" not in text and "Traceback" not in text, text
    assert_intact(tmp_path, ssd_dir, blocks)


def test_sigterm_before_the_node_is_built_exits_cleanly(tmp_path):
    """The earliest moment a signal can be handled: the node's modules still being imported."""
    log = tmp_path / "quilld.log"
    proc = spawn(tmp_path / "ssd", log)
    wait_for_line(log, "starting, pid", proc)
    proc.send_signal(signal.SIGTERM)
    assert wait_exit(proc, log) == 0
    text = log.read_text()
    assert "SIGTERM received before the node started: exiting" in text \
        or "SIGTERM received while starting" in text, text
    assert "Traceback" not in text and "quilld ready" not in text, text
