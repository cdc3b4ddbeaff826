"""The host's peer secret of a cluster without cluster.secret (quilld/cluster/local_secret.py):
made once, race-free, by the first node; trusted only when it and its directory are this user's
alone (issue 19 item 13)."""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor

import pytest

from quilld.cluster.local_secret import FILE_NAME, local_secret
from quilld.errors import ConfigError


def test_made_once_private_and_shared_by_every_caller(tmp_path):
    d = tmp_path / "quilld"
    with ThreadPoolExecutor(8) as pool:
        got = set(pool.map(lambda _: local_secret(str(d)), range(32)))
    assert len(got) == 1
    secret = got.pop()
    assert len(secret) == 64 and int(secret, 16) >= 0
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(d / FILE_NAME).st_mode) == 0o600
    assert [p.name for p in d.iterdir()] == [FILE_NAME]  # no temporary file left behind
    assert local_secret(str(d)) == secret


@pytest.mark.parametrize("what", ["open directory", "open file", "symlink", "garbage"])
def test_anything_another_user_could_have_planted_or_read_is_refused(tmp_path, what):
    d = tmp_path / "quilld"
    d.mkdir(mode=0o700)
    target = d / FILE_NAME
    if what == "open directory":
        d.chmod(0o755)
    elif what == "open file":
        target.write_text("a" * 64)
        target.chmod(0o644)
    elif what == "symlink":
        planted = tmp_path / "planted"
        planted.write_text("a" * 64)
        planted.chmod(0o600)
        target.symlink_to(planted)
    else:
        target.write_text("not a secret")
        target.chmod(0o600)
    with pytest.raises(ConfigError, match="cluster.secret"):
        local_secret(str(d))
