"""The secret cluster peers authenticate with (PEERAUTH) when `cluster.secret` is not set.

PEERAUTH never takes an empty secret: a connection that passes it may read any tenant's
blocks (PEERGET) and follow every residency log (REPLOG), so "no secret" must not mean "any
client may". A cluster without `cluster.secret` is a loopback one (config.py refuses one bound
to another address, or whose clients need passwords), so all its nodes run on this host. They
share a secret of 32 random bytes, made by the first of them in a file only their user may
read: `$XDG_RUNTIME_DIR/quilld/cluster.secret`, else `/tmp/quilld-<uid>/cluster.secret`. Nodes
run by different users, or with different runtime directories, share none: set
`cluster.secret` then. The file is never trusted unless it and its directory are this user's
and closed to everyone else, so another local user can neither plant nor read it.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile

from quilld.errors import ConfigError

FILE_NAME = "cluster.secret"
SECRET_BYTES = 32


def secret_dir() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime):
        return os.path.join(runtime, "quilld")
    return os.path.join(tempfile.gettempdir(), f"quilld-{os.getuid()}")


def _private(st: os.stat_result, what: str, path: str) -> None:
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(f"{what} {path} is not this user's alone (owner uid {st.st_uid}, mode "
                          f"{stat.S_IMODE(st.st_mode):o}): refusing to use it for the cluster's peer secret. "
                          "Set cluster.secret (QUILLD_CLUSTER_SECRET) on every node, or remove it")


def _read(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{path} is not a regular file: set cluster.secret (QUILLD_CLUSTER_SECRET)")
        _private(st, "the file", path)
        text = os.read(fd, 4 * SECRET_BYTES).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    if len(text) != 2 * SECRET_BYTES or any(ch not in "0123456789abcdef" for ch in text):
        raise ConfigError(f"{path} does not hold a peer secret (64 hex digits): remove it, or set "
                          "cluster.secret (QUILLD_CLUSTER_SECRET)")
    return text


def local_secret(directory: str | None = None) -> str:
    """This host's peer secret for this user, made the first time (race-free among nodes starting
    together: the file appears whole, by link, or not at all). ConfigError when it cannot be had."""
    directory = directory or secret_dir()
    path = os.path.join(directory, FILE_NAME)
    try:
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{directory} is not a directory: set cluster.secret (QUILLD_CLUSTER_SECRET)")
        _private(st, "the directory", directory)
        found = _read(path)
        if found is not None:
            return found
        fd, tmp = tempfile.mkstemp(prefix=".secret-", dir=directory)  # mode 0600
        try:
            try:
                os.write(fd, (secrets.token_hex(SECRET_BYTES) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another node made it first: theirs is the one
        finally:
            os.unlink(tmp)
        found = _read(path)
    except OSError as e:
        raise ConfigError(f"cluster.secret is not set and the host's peer secret {path} cannot be made or read "
                          f"({e.strerror or e}): set cluster.secret (QUILLD_CLUSTER_SECRET) on every node") from None
    if found is None:
        raise ConfigError(f"{path} vanished while it was made: start again, or set cluster.secret")
    return found
