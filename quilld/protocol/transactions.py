"""MULTI/EXEC's state: a connection's queued commands, and the node's watched keys.

A connection in MULTI keeps its queue in its `Session` (`multi`: a list of (command,
arguments), None outside MULTI). The dispatcher (table.py) checks a command as it checks
any (existence, arity, auth, redis's order) and then, instead of running it, asks
`queue` here, which queues it or refuses it: either way an error while queueing marks the
transaction (`multi_error`), and its EXEC answers `-EXECABORT` without running anything,
as redis does. `RUN_IN_MULTI` are the commands run at once even inside MULTI (redis's
processCommand). The EXEC itself, and what it does while a queued command waits for the
disk or a peer, is commands/multi.py.

Which commands may be queued is the command table's: a row whose flags (COMMAND INFO's)
say `no_multi` is refused at queue time ("Command not allowed inside a transaction"), and
a row's `Doc.multi(args)` may refuse some forms only (PUT2PHASE's phases). A refused
command's arguments are not kept.

A queued command keeps its arguments until EXEC, DISCARD, RESET or the connection's end;
a large value received into an arena block (SET, MSET, PUT2PHASE PUT) keeps that block
reserved meanwhile (it counts against the tenant's unfilled reservations), so EXEC
publishes it without a copy. The queue's other bytes count against
`client_query_buffer_limit`, as unfinished input does: past it a command is refused and
the transaction marked.

`Watches` is the node's WATCH registry: full key (scope tag + key, so a key is watched in
the scope it was watched in) -> the sessions watching it. While any key is watched it hears
the keyspace's `touched` hook, which the keyspace calls after any change of a key: a write,
delete, expiry (read or swept), eviction, FLUSHALL/FLUSHDB (the caller's scope), TTL set
or removed, rename; never a demotion to SSD or a promotion back (the value did not
change, and redis has no such thing to count). A touch marks the watching sessions
(`cas_dirty`) and unwatches all their keys, as redis's touchWatchedKey; EXEC then answers
a null array. A key that had already expired (not yet reclaimed) when it was watched
counts as changed only if it comes back to life; its reclaiming is no change. At EXEC a
watched key that has expired since it was watched counts as changed (isWatchedKeyExpired).

In a cluster the registry also hears the directory's `touched` hook: every entry of a peer's
replication log (a block that peer placed, moved between its tiers or removed) counts as a
change of that key here, as soon as this node applies it. So a change on another node is
seen where this node can know of it, conservatively (a demotion there counts too), and only
once its log has arrived; values of at most `dram.inline_max` bytes are not logged, and a
change to one on another node is never seen (docs/commands.md, "Transactions").
"""

from __future__ import annotations

from typing import Any

from quilld.errors import CommandError, QuillError
from quilld.protocol.resp import Status
from quilld.scopes import TAG_LEN
from quilld.tiers.expiry import now_ms

QUEUED = Status(b"QUEUED")
# run at once even inside MULTI, never queued (redis's processCommand)
RUN_IN_MULTI = frozenset({"exec", "discard", "multi", "watch", "quit", "reset"})
NOT_IN_MULTI = "Command not allowed inside a transaction"
QUEUED_ARG_COST = 8  # what redis counts per queued argument beyond its bytes (a pointer: multiStateMemOverhead)
QUEUED_CMD_COST = 24  # ... per queued command (a multiCmd)
WATCHED_KEY_COST = 56  # ... per watched key (a list node and a watchedKey)


class ExecAbort(QuillError):
    """EXEC refused because queueing failed (redis's `-EXECABORT`)."""

    prefix = "EXECABORT"


def refusal(cmd: Any, args: list) -> str | None:
    """Why `cmd` with `args` may not be queued, or None when it may."""
    if "no_multi" in cmd.info_flags:
        return NOT_IN_MULTI
    doc = cmd.doc
    if doc is not None and doc.multi is not None:
        why = doc.multi(args)
        if why:
            return f"{NOT_IN_MULTI}: {why}"
    return None


def queue(client: Any, cmd: Any, args: list, limit: int) -> CommandError | None:
    """Queue `cmd` for the client's EXEC, or return why not (the caller marks the transaction).

    The queue keeps the arguments; the caller's list is left holding plain empty bytes where it
    held anything else (a value received into the arena), so what gives back a command's
    unconsumed arguments after it ran leaves those to the queue."""
    why = refusal(cmd, args)
    if why is not None:
        return CommandError(why)
    size = QUEUED_CMD_COST + sum(len(a) + QUEUED_ARG_COST if a.__class__ is bytes else QUEUED_ARG_COST
                                 for a in args)
    if client.multi_bytes + size > limit:
        return CommandError(f"the transaction's queued commands would hold more than {limit} bytes "
                            "(client-query-buffer-limit): DISCARD it, or EXEC smaller ones")
    kept = list(args)
    for i, a in enumerate(args):
        if a.__class__ is not bytes:
            args[i] = b""
    client.multi.append((cmd, kept))
    client.multi_bytes += size
    return None


def end(client: Any) -> None:
    """Leave MULTI and forget the watched keys (DISCARD, EXEC, RESET, the connection's end):
    the queued commands' unconsumed arguments are given back."""
    queued, client.multi = client.multi, None
    client.multi_error = False
    client.multi_bytes = 0
    if queued:
        release = client.ctx.table.release_args
        for _, args in queued:
            release(client, args)
    unwatch(client)


def unwatch(client: Any) -> None:
    """UNWATCH: no key watched, and the changes seen so far forgotten."""
    if client.watched is not None:
        client.ctx.clients.watches.unwatch(client)
    client.cas_dirty = False


def touch(client: Any, key: bytes) -> None:
    """`key` of the client's scope counts as changed though the keyspace saw no change (redis
    signals some commands that change nothing, as APPEND of nothing)."""
    client.ctx.clients.changes.touched(client.tag + bytes(key))  # WATCH's and tracking's


def multi_mem(client: Any) -> int:
    """CLIENT LIST's multi-mem: the queue's bytes and the watched keys, as redis counts them."""
    return client.multi_bytes + WATCHED_KEY_COST * len(client.watched or ())


class Watches:
    """The node's watched keys (see the module's docstring)."""

    def __init__(self, changes: Any) -> None:
        self.keys: dict[bytes, dict[int, Any]] = {}  # full key -> {session id: session}
        self.keyspace: Any = None  # whose changes this hears while any key is watched
        self.changes = changes  # the keyspace's and the directory's `touched` hook (key_changes.KeyChanges)

    def watch(self, client: Any, keyspace: Any, tag: bytes, keys: list) -> None:
        """`client` watches `keys` of scope `tag` (a key watched already stays as it was)."""
        expires = keyspace.expires  # first: a connection with no scope is refused here (NOSCOPE)
        if client.watched is None:
            client.watched = {}
        watched = client.watched
        now = now_ms()
        for key in keys:
            fk = tag + bytes(key)
            if fk in watched:
                continue
            at = expires.get(fk)
            watched[fk] = at is not None and at <= now and self._present(keyspace, fk)
            self.keys.setdefault(fk, {})[client.id] = client
        cluster = client.ctx.cluster
        if cluster is not None:
            cluster.link.ctag(tag)  # the directory names scopes by digest: this one's is known from now on
        if self.keys and self.keyspace is None:
            self.keyspace = keyspace
            self.changes.listen(self, keyspace, cluster.link if cluster is not None else None)

    def unwatch(self, client: Any) -> None:
        watched, client.watched = client.watched, None
        keys = self.keys
        for fk in watched or ():
            watchers = keys.get(fk)
            if watchers is not None:
                watchers.pop(client.id, None)
                if not watchers:
                    del keys[fk]
        if not keys and self.keyspace is not None:
            self.changes.unlisten(self)
            self.keyspace = None

    def touched(self, fk: bytes) -> None:
        """The keyspace changed `fk`: every session watching it will see its EXEC fail."""
        watchers = self.keys.get(fk)
        if watchers is None:
            return
        for client in list(watchers.values()):
            if client.watched[fk]:  # expired already when watched: only coming back to life changes it
                if not self._present(self.keyspace, fk):
                    client.watched[fk] = False  # reclaimed: no change, and no longer an expired key
                    continue
                if self._stale(self.keyspace, fk, now_ms()):
                    continue
            client.cas_dirty = True
            self.unwatch(client)  # nothing more to learn: its EXEC fails

    def expired_since(self, client: Any) -> bool:
        """Whether a key `client` watches has expired since it was watched (EXEC fails then)."""
        ks, now = self.keyspace, now_ms()
        return any(not stale and self._stale(ks, fk, now) for fk, stale in (client.watched or {}).items())

    def clients_watching(self, sessions: Any) -> tuple[int, int]:
        """(how many of `sessions` watch keys, how many distinct keys they watch), for INFO
        (redis 7.4's watching_clients and total_watched_keys)."""
        watching = [s.watched for s in sessions if s.watched]
        return len(watching), len(set().union(*watching))

    @staticmethod
    def _present(keyspace: Any, fk: bytes) -> bool:
        """Whether the keyspace holds `fk`, expired or not (no read counted, nothing reclaimed)."""
        return keyspace.facts(fk[:TAG_LEN], fk[TAG_LEN:], expire=False) is not None

    @classmethod
    def _stale(cls, keyspace: Any, fk: bytes, now: int) -> bool:
        """Whether the keyspace holds `fk` past its deadline, not yet reclaimed."""
        at = keyspace.expires.get(fk)
        return at is not None and at <= now and cls._present(keyspace, fk)
