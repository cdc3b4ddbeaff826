"""dram.memory_file: the arena as a named file (on /dev/shm) instead of an anonymous memfd.

It is created with mode 0600, holds what quilld stores, is refused with one clear line when
it already exists (another quilld's arena, or one left by a killed quilld), and is removed at
a clean stop.
"""

from __future__ import annotations

import os
import stat
import uuid

import pytest

from conftest import run_quilld, start_quilld, stop_process

pytestmark = pytest.mark.timeout(60)


def test_a_named_arena_file_is_private_used_refused_when_taken_and_removed_at_stop(tmp_path):
    path = f"/dev/shm/quilld-test-{uuid.uuid4().hex}"
    q = start_quilld(tmp_path, "--dram", "16MiB", admin=False, env={"QUILLD_DRAM_MEMORY_FILE": path})
    try:
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 16 << 20
        r = q.client()
        value = b"m" * (1 << 20)
        assert r.set("k", value) and r.get("k") == value
        with open(path, "rb") as f:  # the value's bytes are in the file, as a same-host mapping sees them
            assert value in f.read()
        other = run_quilld("--port", "0", "--admin-port", "0", env={"QUILLD_DRAM_MEMORY_FILE": path})
        assert other.returncode == 1, (other.stdout, other.stderr)
        assert f"quilld: cannot start: dram.memory_file {path} already exists: another quilld's arena, " \
               "or one left by a quilld that was killed (remove it if so)" in other.stderr, other.stderr
        assert "Traceback" not in other.stderr
        assert os.path.exists(path), "the refused second quilld must not remove the first one's arena"
    finally:
        assert stop_process(q.proc) == 0, q.log()
        if os.path.exists(path):
            os.unlink(path)
            pytest.fail("the arena file was left behind by a clean stop")
