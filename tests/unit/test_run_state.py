"""The run marker in an SSD directory's LOCK (issue 18.2): what a run writes, and what the
next start makes of it, including LOCK files of an older quilld and damaged ones."""

from __future__ import annotations

from quilld.model import IdentityScope
from quilld.tiers.run_state import RUNNING, STOPPED, RunState
from quilld.tiers.ssd import SsdTier

A = IdentityScope("alice", "m", "t", "")


def test_encode_and_parse_round_trip():
    running = RunState(4242, RUNNING, 1767225600.125, 1767225610.5, 330)
    assert RunState.parse(running.encode()) == running
    stopped = RunState(4242, STOPPED, 1767225600.125, 1767225610.5, 0, 1767225620.25, 7)
    assert RunState.parse(stopped.encode()) == stopped
    assert running.encode().startswith(b"4242\n")  # the owner's pid first, as the lock refusal reads it


def test_what_the_next_start_says():
    warn, text = RunState(7, RUNNING, 1767225600, 1767225610, 330).report()
    assert warn and "did not stop cleanly (killed or crashed): about 330 keys it held only in DRAM were lost" in text
    warn, text = RunState(7, RUNNING, 1767225600).report()
    assert warn and "ended before its first census" in text
    warn, text = RunState(7, RUNNING, 1767225600, 1767225610, 0).report()
    assert warn and "no key only in DRAM at its last census" in text
    warn, text = RunState(7, STOPPED, 1767225600, 0, 0, 1767225620, 0).report()
    assert not warn and "stopped cleanly" in text
    warn, text = RunState(7, STOPPED, 1767225600, 0, 0, 1767225620, 12).report()
    assert warn and "12 keys it held only in DRAM could not be written to SSD" in text


def test_older_empty_and_damaged_lock_files():
    assert RunState.parse(b"") is None  # a new directory
    older = RunState.parse(b"4242\n")  # a quilld from before the marker wrote only its pid
    assert older.pid == 4242 and older.state == ""
    warn, text = older.report()
    assert not warn and "left no record of how it ended" in text
    torn = RunState.parse(b"4242\nstate=runn")  # a write cut short: not known, never "clean"
    assert torn.state == "" and torn.pid == 4242
    assert RunState.parse(b"\xff\xfe garbage").state == ""


def test_the_tier_reads_the_previous_run_before_writing_its_own(tmp_path):
    (tmp_path / "LOCK").write_bytes(RunState(99, RUNNING, 1767225600, 1767225610, 5).encode())
    tier = SsdTier(str(tmp_path), 64 * 4096, 64 * 4096, fsync=False)
    tier.recover()
    assert tier.files.previous_run == RunState(99, RUNNING, 1767225600, 1767225610, 5)
    mine = RunState.parse((tmp_path / "LOCK").read_bytes())
    assert mine.state == RUNNING and mine.pid == tier.files.run.pid and mine.census == 0
    tier.write_run(RunState(mine.pid, STOPPED, mine.started, 0, 0, 1767225620, 3), sync=True)
    tier.close()
    tier = SsdTier(str(tmp_path), 64 * 4096, 64 * 4096, fsync=False)
    tier.recover()
    assert tier.files.previous_run.state == STOPPED and tier.files.previous_run.not_kept == 3
    tier.close()
