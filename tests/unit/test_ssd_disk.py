"""The SSD tier and the disk it lives on (issue 29.1, 29.2): a size the file system has no
room for is refused before anything is preallocated, a start that fails while creating
segments leaves nothing behind, and the tier's files are its owner's alone."""

import errno
import os
import stat
from types import SimpleNamespace

import pytest

from quilld.config import SsdConfig
from quilld.errors import ConfigError
from quilld.tiers.ssd import SsdTier, seg_name
from quilld.tiers.ssd_files import KEY_FILE
from quilld.tiers.ssd_format import PAGE
from quilld.tiers.tiering import size_line

SEG = 64 * PAGE


def files_of(path):
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def test_a_size_the_disk_has_no_room_for_is_refused_before_preallocating(tmp_path, monkeypatch):
    real = os.statvfs(tmp_path)
    free = 3 * SEG  # what the file system says it has free: room for 3 segments of the 8 asked
    blocks = free // real.f_frsize
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_bavail=blocks, f_frsize=real.f_frsize))
    d = tmp_path / "ssd"
    with pytest.raises(ConfigError) as e:
        SsdTier(str(d), 8 * SEG, SEG).recover()
    msg = str(e.value)
    assert "\n" not in msg
    assert "ssd.size 2.0 MiB (--ssd-size)" in msg and "0.8 MiB free" in msg, msg
    assert not [n for n in files_of(d) if n.startswith("seg-")], "segments were preallocated anyway"
    assert not d.exists(), "the directory the refused start made was left behind"


def test_a_start_failing_midway_through_the_segments_leaves_no_partial_tier(tmp_path, monkeypatch):
    real = os.posix_fallocate
    calls = []

    def full_at_the_third(fd, offset, length):
        calls.append(fd)
        if len(calls) >= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", full_at_the_third)
    d = tmp_path / "ssd"
    with pytest.raises(ConfigError, match="No space left"):
        SsdTier(str(d), 6 * SEG, SEG).recover()
    assert len(calls) == 3
    assert files_of(d) == [], f"a partial tier was left behind: {files_of(d)}"
    # a directory that was there before keeps what it had, and gets no segment
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    calls.clear()
    with pytest.raises(ConfigError, match="No space left"):
        SsdTier(str(d), 6 * SEG, SEG).recover()
    assert not [n for n in files_of(d) if n.startswith("seg-")]
    assert (d / "notes.txt").read_text() == "mine"


def test_growing_a_tier_checks_room_only_for_the_new_segments(tmp_path, monkeypatch):
    d = tmp_path / "ssd"
    tier = SsdTier(str(d), 2 * SEG, SEG, fsync=False)
    tier.recover()
    tier.close()
    real = os.statvfs(tmp_path)
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_bavail=SEG // real.f_frsize,
                                                                 f_frsize=real.f_frsize))
    tier = SsdTier(str(d), 3 * SEG, SEG, fsync=False)  # one more segment: it fits
    tier.recover()
    tier.close()
    with pytest.raises(ConfigError, match="2 segments of 0.2 MiB to preallocate need 0.5 MiB"):
        SsdTier(str(d), 5 * SEG, SEG, fsync=False).recover()
    assert not (d / seg_name(3)).exists()


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_tiers_files_are_the_owners_alone(tmp_path):
    old = os.umask(0o022)  # the usual umask: files created 0644 unless asked otherwise
    try:
        d = tmp_path / "ssd"
        tier = SsdTier(str(d), 2 * SEG, SEG, fsync=False, checkpoint_wal_bytes=0)
        tier.recover()
        tier.checkpoint(tier.seal())
        tier.close()
    finally:
        os.umask(old)
    assert mode(d) == 0o700
    names = files_of(d)
    assert KEY_FILE in names and seg_name(0) in names and any(n.startswith("wal-") for n in names), names
    assert any(n.startswith("checkpoint-") for n in names), names
    too_open = {n: oct(mode(d / n)) for n in names if mode(d / n) & 0o077}
    assert not too_open, f"readable by other users: {too_open}"


def test_a_key_file_others_can_read_refuses_the_start(tmp_path):
    d = tmp_path / "ssd"
    tier = SsdTier(str(d), 2 * SEG, SEG, fsync=False)
    tier.recover()
    tier.close()
    os.chmod(d / KEY_FILE, 0o644)
    with pytest.raises(ConfigError, match=r"readable by other users \(mode 0644\).*chmod 600"):
        SsdTier(str(d), 2 * SEG, SEG, fsync=False).recover()
    os.chmod(d / KEY_FILE, 0o600)
    os.chmod(d / seg_name(0), 0o644)  # a segment an older quilld made: tightened, not refused
    tier = SsdTier(str(d), 2 * SEG, SEG, fsync=False)
    tier.recover()
    tier.close()
    assert mode(d / seg_name(0)) == 0o600


def test_the_start_line_says_what_is_preallocated_and_when_it_is_the_default():
    line = size_line(SsdConfig(dir="/x"), 16 << 30)
    assert line.startswith("16.0 GiB preallocated on disk") and "--ssd-size" in line
    assert size_line(SsdConfig(dir="/x", size=64 << 20), 64 << 20) == "64.0 MiB preallocated on disk"
