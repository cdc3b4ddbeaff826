"""CLIENT TRACKING: which connections may cache which keys, and their invalidation messages.

Client-side caching as redis 7.0.15 keeps it (tracking.c). A connection that turned tracking
on is sent `invalidate` with a key's name when that key may have changed, so the copy it
cached is dropped:

- **default mode**: the keys of every read-only command the connection runs (their key
  specs: GET, MGET, STRLEN, EXISTS, GETBLK, ...) are remembered in the node's table,
  missing keys too; the first change of such a key sends it to every connection that read
  it and forgets them (read it again to hear of the next change). `OPTIN`: only the reads of
  the command after `CLIENT CACHING yes` are remembered; `OPTOUT`: all but those after
  `CLIENT CACHING no`.
- **BCAST**: nothing is remembered; every key that changes and starts with one of the
  connection's prefixes (`PREFIX`, none: every key) is sent, the keys changed while a batch of
  commands ran gathered in one message per prefix.
- **NOLOOP**: changes made by the connection itself are not sent to it.
- A flush (FLUSHALL, FLUSHDB) sends one `invalidate` with a null instead of keys: every key.

A key is tracked in its identity scope: the table's keys are full keys (scope tag + key),
BCAST prefixes match the keys of the scope the connection had when it turned BCAST on, and a
message names the plain key. So a connection hears only of keys it could read, and learns
nothing of another scope's keys; a change is matched only against its own scope's prefixes,
and a connection may have at most `MAX_PREFIXES` (redis has no such bound; a tenant's
prefixes would slow every write of its scope).

What changes a key is the keyspace's one `touched` hook (key_changes.py, shared with WATCH):
a write, delete, expiry (read or swept), eviction, rename, TTL set or removed, and in a
cluster an entry of a peer's log (that peer wrote, moved or dropped the key). A demotion to
the SSD tier or a promotion back changes nothing (the value is the same; redis has neither).

Messages: a RESP3 connection gets a push (`>2 invalidate [keys]`). `REDIRECT id` sends them
to another connection instead: a RESP3 one gets the push, a RESP2 one subscribed to
`__redis__:invalidate` gets a pub/sub `message` on that channel, anyone else nothing. If the
connection redirected to has gone, the tracking connection is told (`tracking-redir-broken`,
RESP3 only) and its TRACKINGINFO says `broken_redirect`. A message to the connection whose
command made the change is sent after that command's reply, as redis does.

Bounds: the table holds at most `tracking-table-max-keys` keys (CONFIG SET, or
server.tracking_table_max_keys; 0: no bound, redis's default 1000000): past it the oldest
keys are forgotten, each sent to the connections that had read it as if it had changed, at
most `TRIM_EFFORT` times the number of passes that found the table still too full per pass
(redis's trackingLimitUsedSlots). A connection that does not read what it is sent is closed
once more than `PUSH_BACKLOG_MAX` bytes beyond server.client_output_high_water wait for it (its
own replies stop its reading at that high water, so the rest is messages; redis closes a pub/sub
client past its client-output-buffer-limit, 32mb): messages never grow a connection's memory
without bound.
A connection that closes or turns tracking off is forgotten lazily, as redis forgets it: its
entries go with the keys' next change or with the trim.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from quilld.protocol.command_specs import keys_from_specs
from quilld.protocol.resp import encode
from quilld.protocol.replies import Push
from quilld.scopes import TAG_LEN

CHANNEL = b"__redis__:invalidate"  # where a RESP2 connection redirected to hears the messages
MAX_PREFIXES = 1024  # BCAST prefixes one connection may have (each change of a key of its scope is matched against them)
TRIM_EFFORT = 100  # keys forgotten per pass over a full table, times the passes that found it still full
PUSH_BACKLOG_MAX = 32 * 1024 * 1024  # unsent bytes a connection may have before it is closed (redis's pubsub hard limit)
log = logging.getLogger("quilld.protocol")


class ClientTracking:
    """A connection's tracking state (Session.tracking while tracking is on)."""

    __slots__ = ("bcast", "optin", "optout", "noloop", "caching", "redirect", "broken", "prefixes", "tag")

    def __init__(self) -> None:
        self.bcast = self.optin = self.optout = self.noloop = False
        self.caching = False  # CLIENT CACHING given for the next command (yes in OPTIN, no in OPTOUT)
        self.redirect = 0  # the connection the messages go to (0: this one)
        self.broken = False  # that connection has gone
        self.prefixes: list[bytes] = []  # BCAST's, as given (without the scope's tag)
        self.tag = b""  # the scope they match keys of: the connection's when it turned BCAST on

    def flags(self) -> list[bytes]:
        """TRACKINGINFO's flags after `on`, in redis's order."""
        out = [b"bcast"] if self.bcast else []
        if self.optin:
            out += [b"optin", b"caching-yes"] if self.caching else [b"optin"]
        if self.optout:
            out += [b"optout", b"caching-no"] if self.caching else [b"optout"]
        if self.noloop:
            out.append(b"noloop")
        if self.broken:
            out.append(b"broken_redirect")
        return out


class Tracking:
    """The node's tracking table and BCAST prefixes (see the module's docstring)."""

    def __init__(self, clients: Any) -> None:
        self.clients = clients  # protocol/clients.py Clients: connections by session id, the running one
        self.keys: dict[bytes, set[int]] = {}  # full key -> ids of the sessions that read it
        self.items = 0  # ids over all keys (INFO's tracking_total_items)
        # BCAST: scope tag -> prefix -> {session id: session}; and the keys changed since the last
        # broadcast: scope tag -> prefix -> {full key: the session that changed it last}
        self.prefixes: dict[bytes, dict[bytes, dict[int, Any]]] = {}
        self.changed: dict[bytes, dict[bytes, dict[bytes, Any]]] = {}
        self.tracking_clients = 0
        self.max_keys = 1_000_000  # tracking-table-max-keys (0: no bound)
        self._full_passes = 0  # passes of trim that found the table still over max_keys
        self._flushing: bytes | None = None  # the scope being flushed: its keys' changes are one message
        self._broadcast_due = False
        self._keyspace: Any = None

    # -- turning it on and off ---------------------------------------------------------
    def enable(self, s: Any, redirect: int, bcast: bool, optin: bool, optout: bool, noloop: bool,
               prefixes: list[bytes]) -> None:
        """CLIENT TRACKING ON with its options (checked by the caller): a connection tracking
        already keeps its BCAST prefixes and adds these."""
        t = s.tracking
        if t is None:
            t = s.tracking = ClientTracking()
            self.tracking_clients += 1
        t.redirect, t.broken = redirect, False
        t.bcast, t.optin, t.optout, t.noloop = bcast, optin, optout, noloop
        if bcast:
            if not t.prefixes:
                t.tag = s.tag
            mine = self.prefixes.setdefault(t.tag, {})
            for p in prefixes or [b""]:
                if p not in t.prefixes:
                    t.prefixes.append(p)
                    mine.setdefault(p, {})[s.id] = s
        keyspace = s.ctx.keyspace
        cluster = s.ctx.cluster
        if self._keyspace is None:
            self._keyspace = keyspace
            self.clients.changes.listen(self, keyspace, cluster.link if cluster is not None else None)
        if cluster is not None:
            cluster.link.ctag(s.tag)  # the directory names scopes by digest: this one's is known from now on

    def disable(self, s: Any) -> None:
        """CLIENT TRACKING OFF, RESET, the connection's end."""
        t, s.tracking = s.tracking, None
        if t is None:
            return
        self.tracking_clients -= 1
        mine = self.prefixes.get(t.tag)
        for p in t.prefixes if mine is not None else ():
            subs = mine.get(p)
            if subs is not None:
                subs.pop(s.id, None)
                if not subs:
                    del mine[p]
                    self.changed.get(t.tag, {}).pop(p, None)
        if mine is not None and not mine:
            del self.prefixes[t.tag]
        if not self.tracking_clients and self._keyspace is not None:
            self.clients.changes.unlisten(self)
            self._keyspace = None
            self.keys.clear()
            self.items = 0
            self.changed.clear()

    @staticmethod
    def overlap(old: list[bytes], new: list[bytes]) -> bytes | None:
        """redis's checkPrefixCollisionsOrReply: the error text when two prefixes would both match
        one key (one starts the other), else None. Whether any do is seen in the sorted order (a
        prefix sorts right before the strings it starts, with nothing else between them); only
        then are the pairs walked in redis's order, for the one it names."""
        every = sorted(old + new)
        if not any(q.startswith(p) for p, q in zip(every, every[1:])):
            return None
        for i, p in enumerate(new):
            for q in old:
                if p.startswith(q) or q.startswith(p):
                    return (b"Prefix '%b' overlaps with an existing prefix '%b'. "
                            b"Prefixes for a single client must not overlap." % (p, q))
            for q in new[i + 1:]:
                if p.startswith(q) or q.startswith(p):
                    return (b"Prefix '%b' overlaps with another provided prefix '%b'. "
                            b"Prefixes for a single client must not overlap." % (p, q))
        return None

    # -- what a connection read ----------------------------------------------------------
    def after_command(self, s: Any, cmd: Any, args: list, top: bool) -> None:
        """`s` (tracking) ran `cmd`: a read's keys are remembered (default mode, as OPTIN/OPTOUT
        and CLIENT CACHING say). `top`: run on its own, not by EXEC; CLIENT CACHING's flag lasts
        for the one command (or transaction) after it, as redis's resetClient."""
        t = s.tracking
        if not t.bcast and "readonly" in cmd.info_flags and "pubsub" not in cmd.info_flags and not (
                (t.optin and not t.caching) or (t.optout and t.caching)):
            self._remember(s, cmd, args)
        if top and t.caching and s.multi is None and not cmd.name.startswith("client"):
            t.caching = False

    def _remember(self, s: Any, cmd: Any, args: list) -> None:
        found = keys_from_specs(cmd, args)
        if not found:
            return
        tag, keys, sid, added = s.tag, self.keys, s.id, 0
        for i, _ in found:
            fk = tag + bytes(args[i])
            ids = keys.get(fk)
            if ids is None:
                ids = keys[fk] = set()
            if sid not in ids:
                ids.add(sid)
                added += 1
        self.items += added
        if self.max_keys and len(keys) > self.max_keys:
            self.trim()

    def trim(self) -> None:
        """Forget the oldest keys while the table holds more than `max_keys`, each sent to whoever
        had read it; at most TRIM_EFFORT x (passes that found it still full) keys a pass."""
        keys, limit = self.keys, self.max_keys
        if not limit or len(keys) <= limit:
            self._full_passes = 0
            return
        effort = TRIM_EFFORT * (self._full_passes + 1)
        while effort > 0 and len(keys) > limit:
            effort -= 1
            self._invalidate(next(iter(keys)), None)
        self._full_passes = 0 if len(keys) <= limit else self._full_passes + 1

    # -- what changed -------------------------------------------------------------------
    def touched(self, fk: bytes) -> None:
        """The keyspace changed `fk` (key_changes.py): whoever may cache it is told."""
        flushing = self._flushing
        if flushing is not None and fk[:TAG_LEN] == flushing:
            return  # the flush sends one message for all of them
        if self.prefixes and fk[:TAG_LEN] in self.prefixes:
            self._note_for_bcast(fk)
        if fk in self.keys:
            self._invalidate(fk, self.clients.running)

    def _invalidate(self, fk: bytes, writer: Any) -> None:
        ids = self.keys.pop(fk)
        self.items -= len(ids)
        sessions = self.clients.sessions
        key = [fk[TAG_LEN:]]
        for sid in ids:
            s = sessions.get(sid)
            if s is None:
                continue
            t = s.tracking
            if t is None or t.bcast or (t.noloop and s is writer):
                continue
            self._send(s, key)

    def flush(self, tag: bytes) -> "_Flush":
        """`with tracking.flush(tag):` around the flush of scope `tag`: its tracking connections get
        one `invalidate` with a null (every key), not one message a key, and its keys are forgotten."""
        return _Flush(self, tag)

    def _flushed(self, tag: bytes) -> None:
        for fk in [fk for fk in self.keys if fk[:TAG_LEN] == tag]:
            self.items -= len(self.keys.pop(fk))
        self.changed.pop(tag, None)
        for s in list(self.clients.sessions.values()):
            if s.tracking is not None and s.tag == tag:
                self._send(s, None)

    def _note_for_bcast(self, fk: bytes) -> None:
        """`fk` changed: remembered for each prefix of its scope it starts with, with who changed it."""
        tag, key = fk[:TAG_LEN], fk[TAG_LEN:]
        writer = self.clients.running
        pending = None
        for p in self.prefixes[tag]:
            if key.startswith(p):
                if pending is None:
                    pending = self.changed.setdefault(tag, {})
                pending.setdefault(p, {})[fk] = writer
        if pending is not None and not self._broadcast_due:
            self._broadcast_due = True
            try:
                asyncio.get_running_loop().call_soon(self.broadcast)
            except RuntimeError:  # no event loop (handler tests): sent at once
                self.broadcast()

    def broadcast(self) -> None:
        """Send each BCAST prefix's changed keys to its connections (after the commands that
        changed them, as redis's beforeSleep): one message a prefix, a NOLOOP connection's own
        changes left out of its copy."""
        self._broadcast_due = False
        changed, self.changed = self.changed, {}
        for tag, per_prefix in changed.items():
            mine = self.prefixes.get(tag, {})
            for p, keys in per_prefix.items():
                if not keys:
                    continue
                every = [fk[TAG_LEN:] for fk in keys]
                for s in list(mine.get(p, {}).values()):
                    t = s.tracking
                    if t is None:
                        continue
                    if t.noloop:
                        own = [fk[TAG_LEN:] for fk, w in keys.items() if w is not s]
                        if own:
                            self._send(s, own)
                    else:
                        self._send(s, every)

    def _send(self, s: Any, keys: list | None) -> None:
        """One invalidation (`keys`; None: every key) for tracking session `s`, where it goes."""
        t = s.tracking
        target = s
        if t.redirect:
            target = self.clients.sessions.get(t.redirect)
            if target is None:
                t.broken = True
                if s.resp3:
                    self._push(s, Push((b"tracking-redir-broken", t.redirect)), True)
                return
        if target.resp3:
            self._push(target, Push((b"invalidate", keys)), True)
        elif target is not s and CHANNEL in target.channels:
            self._push(target, [b"message", CHANNEL, keys], False)

    def _push(self, s: Any, frame: Any, resp3: bool) -> None:
        conn = self.clients.connections.get(s.id)
        if conn is None or conn.transport is None:
            return
        out: list = []
        encode(frame, resp3, out)
        data = b"".join(out)
        waiting = conn.transport.get_write_buffer_size()
        if waiting + len(data) > conn.ctx.cfg.server.client_output_high_water + PUSH_BACKLOG_MAX:
            log.warning("closing client id=%d addr=%s: it does not read its invalidation messages (%d bytes "
                        "wait unsent)", s.id, s.addr, waiting)
            conn.transport.abort()  # close() would wait to send what waits: it never would be read
            return
        if s is self.clients.running:
            conn.push_after(data)  # after the reply of the command that made the change
        else:
            conn.push(data)

    # -- figures -----------------------------------------------------------------------
    def figures(self) -> tuple[int, int, int, int]:
        """(tracking_clients, tracking_total_keys, tracking_total_items, tracking_total_prefixes)."""
        return self.tracking_clients, len(self.keys), self.items, sum(len(m) for m in self.prefixes.values())


class _Flush:
    __slots__ = ("tracking", "tag")

    def __init__(self, tracking: Tracking, tag: bytes) -> None:
        self.tracking, self.tag = tracking, tag

    def __enter__(self) -> None:
        if self.tracking.tracking_clients:
            self.tracking._flushing = self.tag

    def __exit__(self, *exc: Any) -> None:
        tr = self.tracking
        if tr._flushing is not None:
            tr._flushing = None
            tr._flushed(self.tag)
