"""Cluster commands: NODES for people; PEERAUTH, DIR, PEERGET, PEERMGET, PEERPULL, PEERENGINES and
PEERKVEVENTS between nodes.

PEERAUTH gives a connection peer rights only: the node-to-node commands (flagged PEER in
the table: DIR, PEERGET, PEERMGET, PEERPULL, PEERRDMA, PEERRELEASE, PEERENGINES, PEERKVEVENTS),
which a peer may run whether it logged in
as a user or not. It logs nobody in: a peer that did not AUTH may run nothing else (NOAUTH),
and one that did keeps its user's rights, never the operator's. Wrong secrets are counted
(`peerauth_failures`) and slowed as AUTH's wrong passwords are (connection.py's throttle, one
of its own, keyed by the client's address and by the one secret all guesses aim at); an
empty secret is always wrong (cluster/local_secret.py: what a cluster without
cluster.secret uses instead).
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from quilld.cluster.cluster import node_line, standalone_meta
from quilld.cluster.prefetch import MAX_PULL_KEYS, pull
from quilld.errors import CommandError, PeerOnly, WrongPass
from quilld.index.events import decode_json
from quilld.model import IdentityScope, Pending, Pinned
from quilld.protocol.commands.common import parse_int, text
from quilld.context.auth_throttle import AuthThrottle
from quilld.protocol.commands.connection import after_throttle
from quilld.protocol.commands.route import MAX_EVENTS_BYTES  # a forwarded batch: KVEVENTS's own bound
from quilld.protocol.resp import OK
from quilld.protocol.table import ADMIN, NOAUTH, PEER, READONLY, WRITE, CommandTable

if TYPE_CHECKING:  # annotations only: the RDMA module is loaded only on a node that turns RDMA on
    from quilld.cluster.rdma import RdmaTransfer

MAX_BATCH = 50_000
MAX_WAIT_MS = 30_000


def _cluster(c):
    cluster = c.ctx.cluster
    if cluster is None:
        raise CommandError("this node is not in a cluster (no cluster.gossip_port, and cluster.registry is not etcd)")
    return cluster


def _peer(c):
    cluster = _cluster(c)
    if not c.peer:
        raise PeerOnly("node-to-node command: PEERAUTH first")
    return cluster


PEER_KEY = b"~peer"  # the throttle's "user" of PEERAUTH: every guess aims at the one cluster secret


def cmd_peerauth(c, args, throttle: AuthThrottle):
    """PEERAUTH secret: this connection is a cluster peer (the cluster's secret; never empty)."""
    cluster = _cluster(c)
    given = bytes(args[1])

    def check():
        if not hmac.compare_digest(given, cluster.peer_secret.encode()) or not given:
            raise WrongPass("invalid cluster secret")
        c.peer_login()
        c.ctx.clients.auth_changed(c)  # a peer's commands are parsed as a logged-in client's
        cluster.stats["peer_connections"] += 1
        return OK

    return after_throttle(c, throttle, PEER_KEY, check, "peerauth_throttled", "peerauth_failures")


def cmd_dir(c, args):
    """DIR from-node msgpack: a peer's request to this node's part of the directory (a batch of
    placements, a lookup, a copy of buckets); answered with the directory's reply, msgpacked."""
    cluster = _peer(c)
    try:
        return cluster.link.handle(text(args[1]), bytes(args[2]))
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise CommandError(f"DIR: malformed request ({type(e).__name__}: {e})") from None


def cmd_peerengines(c, args):
    """PEERENGINES from-node: this node's engine table and its digest, msgpacked (a peer whose
    digest differs pulls it: cluster/engines_sync.py)."""
    return _peer(c).engines.rows_reply()


def cmd_peerkvevents(c, args):
    """PEERKVEVENTS engine-id <json batch>: a batch of KV events another node received for an
    engine this node is home to (the sender checked who sent it); the events applied."""
    _peer(c)
    control = c.control
    engine_id = text(args[1])
    control.engines.get(engine_id)  # an unknown engine: an error, as KVEVENTS answers
    return control.apply(engine_id, decode_json(bytes(args[2])))


def _scope_of(args) -> IdentityScope:
    return IdentityScope(text(args[1]), text(args[2]), text(args[3]), text(args[4]))


PEERGET_SYNTAX = "syntax: PEERGET tenant model tokenizer adapter key [RDMA min_bytes] [PXAT]"


def cmd_peerget(c, args):
    """PEERGET tenant model tokenizer adapter key [RDMA min_bytes] [PXAT]: [crc32c, bytes] of this
    node's copy, or nil.

    With RDMA, a block of at least min_bytes is leased for an RDMA READ instead (cluster/rdma.py):
    `[crc32c, length, remote_addr, rkey, lease]`. With PXAT, each reply ends with one more
    integer: when the key expires (unix ms), or -1, so a copy kept by the peer expires with it.
    """
    cluster = _peer(c)
    opts = list(args[6:])
    pxat = bool(opts) and bytes(opts[-1]).upper() == b"PXAT"
    if pxat:
        opts.pop()
    if len(opts) not in (0, 2) or (opts and bytes(opts[0]).upper() != b"RDMA"):
        raise CommandError(PEERGET_SYNTAX)
    if opts:
        rdma = _rdma(c)
        min_bytes = parse_int(opts[1])
    ks = c.ctx.keyspace  # the scope is the one named, whatever the connection's own
    tag = c.ctx.scopes.tag(_scope_of(args))
    key = bytes(args[5])
    if opts:
        extent = ks.lease_extent(tag, key, min_bytes)
        if extent is not None:
            cluster.stats["peer_gets_served"] += 1
            crc, offset, length, pinned = extent
            lease = rdma.leases.grant(c.id, pinned.release)
            rdma.stats["rdma_leases_granted"] += 1
            reply = [crc, length, rdma.device.base + offset, rdma.device.rkey, lease]
            return reply + [ks.expire_time(tag, key)] if pxat else reply
    cluster.stats["peer_gets_served"] += 1
    return ks.peer_copy(tag, key, with_expiry=pxat)


MAX_MGET_KEYS = 1024  # keys one PEERMGET may ask for
MAX_MGET_BYTES = 64 << 20  # bytes of values one PEERMGET answers; past it, nil (read one at a time)


def cmd_peermget(c, args):
    """PEERMGET tenant model tokenizer adapter key [key ...]: for each key `[crc32c, bytes, pxat]`
    of this node's copy (pxat: when it expires, unix ms, or -1), or nil (no copy, or past the
    reply's byte budget). Peers read small values this way, many per request."""
    cluster = _peer(c)
    keys = args[5:]
    if len(keys) > MAX_MGET_KEYS:
        raise CommandError(f"PEERMGET: at most {MAX_MGET_KEYS} keys")
    tag = c.ctx.scopes.tag(_scope_of(args))
    ks = c.ctx.keyspace
    out: list = []
    pending: list[int] = []
    budget = MAX_MGET_BYTES
    for key in keys:
        got = ks.peer_copy(tag, bytes(key), with_expiry=True)
        if got is None:
            out.append(None)
        elif type(got) is Pending:
            pending.append(len(out))
            out.append(got)
        else:
            crc, value, pxat = got
            if value.__class__ is Pinned:
                data = bytes(value.view) if len(value.view) <= budget else None
                value.release()
            else:
                data = value if len(value) <= budget else None
            budget -= len(data) if data is not None else 0
            out.append(None if data is None else [crc, data, pxat])
    cluster.stats["peer_gets_served"] += len(keys)
    if not pending:
        return out

    async def settle():
        for i in pending:
            try:
                crc, data, pxat = await out[i].awaitable
                out[i] = [crc, data, pxat]
            except Exception:  # a lower-tier copy that cannot be read: the peer asks elsewhere
                out[i] = None
        return out

    return Pending(settle())


def cmd_peerpull(c, args):
    """PEERPULL tenant model tokenizer adapter key [key ...]: read the keys this node lacks from the
    pool and keep them here (a disaggregated request's prefetch, cluster/prefetch.py); answers how
    many of the keys this node holds once done."""
    cluster = _peer(c)
    keys = [bytes(k) for k in args[5:]]
    if len(keys) > MAX_PULL_KEYS:
        raise CommandError(f"PEERPULL: at most {MAX_PULL_KEYS} keys")
    return Pending(pull(cluster, _scope_of(args), keys))


def _rdma(c) -> RdmaTransfer:
    cluster = _peer(c)
    rdma = cluster.transfers.rdma
    if rdma is None:
        raise CommandError("RDMA is not enabled on this node (see INFO cluster: cluster_rdma_unavailable_reason)")
    return rdma


def cmd_peerrdma(c, args):
    """PEERRDMA CONNECT json: a peer sets up an RC queue pair with this node; answers with ours."""
    rdma = _rdma(c)
    if bytes(args[1]).upper() != b"CONNECT" or len(args) != 3:
        raise CommandError("syntax: PEERRDMA CONNECT json")
    return rdma.accept(bytes(args[2]))


def cmd_peerrelease(c, args):
    """PEERRELEASE lease [lease ...]: a peer is done reading blocks leased by PEERGET ... RDMA."""
    rdma = _rdma(c)
    return sum(rdma.leases.release(parse_int(a), c.id) for a in args[1:])


def cmd_nodes(c, args):
    """NODES: one line per member: id, state, incarnation, RESP and admin addresses, usage. A node
    outside any cluster answers with itself, in the same format."""
    cluster, ctx = c.ctx.cluster, c.ctx
    if cluster is not None:
        lines = cluster.node_lines()
    else:
        ks = ctx.keyspace
        meta = standalone_meta(ctx.cfg.server.bind, ctx.port, ctx.admin_port, ks.used, ks.capacity)
        lines = [node_line(ctx.node_id, "alive", 0, meta, myself=True)]
    return "".join(line + "\n" for line in lines).encode()


def register(t: CommandTable) -> None:
    throttle = AuthThrottle()  # PEERAUTH's own: AUTH guessers do not slow the peers, nor the reverse
    t.add("peerauth", 2, NOAUTH, lambda c, args: cmd_peerauth(c, args, throttle),
          "Authenticates a cluster peer connection.", "quillcache", "0.1.0")
    t.add("dir", 3, f"{ADMIN} {PEER}", cmd_dir, "A peer's request to this node's part of the directory.",
          "quillcache", "0.1.0")
    t.add("peermget", -6, f"{READONLY} {PEER}", cmd_peermget,
          "A peer reads this node's copies of small values, many at once, with their CRC32C.",
          "quillcache", "0.1.0")
    t.add("peerget", -6, f"{READONLY} {PEER}", cmd_peerget,
          "A peer reads this node's copy of a key, with its CRC32C.", "quillcache", "0.1.0")
    t.add("peerpull", -6, f"{WRITE} {PEER}", cmd_peerpull,
          "A peer asks this node to pull keys from the pool and keep them (a prefetch).", "quillcache", "0.1.0")
    t.add("peerrdma", 3, f"{ADMIN} {PEER}", cmd_peerrdma, "A peer sets up an RDMA queue pair with this node.",
          "quillcache", "0.1.0")
    t.add("peerrelease", -2, f"{READONLY} {PEER}", cmd_peerrelease,
          "A peer releases blocks leased for RDMA READ.", "quillcache", "0.1.0")
    t.add("peerengines", 2, f"{READONLY} {PEER}", cmd_peerengines,
          "A peer pulls this node's engine table.", "quillcache", "0.1.0")
    t.add("peerkvevents", 3, f"{ADMIN} {PEER}", cmd_peerkvevents,
          "A peer hands over KV events of an engine this node is home to.", "quillcache", "0.1.0",
          arg_limit=MAX_EVENTS_BYTES)
    t.add("nodes", 1, READONLY, cmd_nodes, "Lists the cluster's members.", "quillcache", "0.1.0")
