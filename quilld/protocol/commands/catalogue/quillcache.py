"""quilld's own commands' rows: identity scopes, block puts and reads, routing, cluster peers.

In redis's terms, so that COMMAND INFO, COMMAND DOCS and COMMAND GETKEYS describe them as
they describe redis's commands: flags, ACL categories, key specs and documented arguments.
Their group is `quillcache`.
"""

from __future__ import annotations

from quilld.protocol.table import Arg as A
from quilld.protocol.table import Doc as D
from quilld.protocol.table import KeySpec as K

G = "quillcache"
SINCE = "0.1.0"


def _peer_secret(argv: list) -> list[int]:
    """PEERAUTH's cluster secret never shows in MONITOR or the slowlog."""
    return [1] if len(argv) > 1 else []


def _put2phase_multi(argv: list) -> str | None:
    """The phases of a put are never queued: a DATA payload lands in its put as it arrives, before
    any EXEC, and a handle outlives any transaction. A whole block (PUT) is queued as SET is."""
    phase = bytes(argv[1]).upper() if len(argv) > 1 else b""
    if phase == b"PUT":
        return None
    return ("PUT2PHASE BEGIN, DATA, COMMIT and ABORT run outside transactions (a put's payload lands as it "
            "arrives); PUT2PHASE PUT and SET may be queued")


def _put2phase_keys(argv: list) -> list[tuple[int, str]] | None:
    """BEGIN and PUT name their key (the argument after the phase); DATA, COMMIT and ABORT name a
    put's handle, whose key was checked when BEGIN reserved it. The key specs cannot tell a phase
    from a payload or a handle that spells BEGIN or PUT, so they are marked incomplete and this
    decides (ACL's key patterns, COMMAND GETKEYS)."""
    phase = bytes(argv[1]).upper() if len(argv) > 1 else b""
    if phase in (b"BEGIN", b"PUT"):
        return [(2, "OW update")] if len(argv) > 2 else None
    return []


def _shm_reserve_keys(argv: list) -> list[tuple[int, str]] | None:
    """SHM RESERVE's keys: every other argument after the lease, or every fourth after CHAINED."""
    if len(argv) % 4 == 0 and len(argv) > 4 and bytes(argv[3]).upper() == b"CHAINED":
        return [(i, "OW update") for i in range(4, len(argv), 4)]
    return [(i, "OW update") for i in range(3, len(argv), 2)] if len(argv) % 2 else None


_PEER_ONLY = "admin no_multi"  # a cluster peer's commands are never queued (peers send no MULTI)


# ROUTE HASHES' and ROUTE PACKED's options (the JSON and key value forms name the same fields)
_ROUTE_OPTIONS = (
    A("block-size", "integer", token="BLOCK_SIZE", flags="optional"),
    A("decode-tokens", "integer", token="DECODE_TOKENS", flags="optional"),
    A("session", "string", token="SESSION", flags="optional"),
    A("acquire", "pure-token", token="ACQUIRE", flags="optional",
      summary="count the request in flight on the engine chosen and return a lease"),
    A("compact", "pure-token", token="COMPACT", flags="optional",
      summary="reply [engine, url, cost, lease, [step, count, ...]] instead of the map"),
)

QUILLCACHE = {
    "scope": D(
        "Set the connection's identity scope: the model, tokenizer and adapter its keys belong to", SINCE, G,
        complexity="O(1)",
        flags="fast",
        acl="connection",
        args=(A("model", "string"), A("tokenizer", "string"), A("adapter", "string", flags="optional")),
    ),
    "put2phase": D(
        "Put a block in two phases: reserve, fill in any order, commit atomically (or abort)", SINCE, G,
        complexity="O(1) for BEGIN, COMMIT and ABORT; O(N) for DATA, N being the payload's length",
        flags="write denyoom no_mandatory_keys",
        acl="string",
        multi=_put2phase_multi,
        getkeys=_put2phase_keys,
        keys=(K("OW update incomplete", keyword=("BEGIN", 1), range=(0, 1, 0),
                notes="BEGIN and PUT name a key; DATA, COMMIT and ABORT name the put's handle"),
              K("OW update incomplete", keyword=("PUT", 1), range=(0, 1, 0),
                notes="PUT key CRC32C crc bytes: a whole block at once")),
        args=(
            A("phase", "oneof", args=(
                A("begin", "block", token="BEGIN", args=(
                    A("key", "key", key_spec=0),
                    A("nbytes", "integer"),
                    A("ms", "integer", token="LEASE", flags="optional"),
                    A("blockhash", "string", token="HASH", flags="optional"),
                    A("shm", "pure-token", token="SHM", flags="optional"),
                    A("h", "string", token="HANDLE", flags="optional"),
                )),
                A("data", "block", token="DATA", args=(
                    A("handle", "string"), A("offset", "integer"), A("bytes", "string"),
                )),
                A("commit", "block", token="COMMIT", args=(
                    A("handle", "string"), A("crc", "integer", token="CRC32C", flags="optional"),
                )),
                A("handle", "string", token="ABORT"),
                A("put", "block", token="PUT", args=(
                    A("key", "key", key_spec=1),
                    A("crc", "integer", token="CRC32C"),
                    A("bytes", "string"),
                )),
            )),
        ),
    ),
    "mputblk": D(
        "Put many whole blocks at once, each checked against its CRC32C: per block OK, EXISTS or its error",
        SINCE, G,
        complexity="O(N), N being the bytes of the blocks",
        flags="write denyoom",
        acl="string",
        keys=(K("OW update", index=1, range=(-1, 3, 0)),),
        args=(A("block", "block", flags="multiple", args=(
            A("key", "key", key_spec=0), A("crc", "integer"), A("bytes", "string"))),),
    ),
    "getblk": D(
        "Get a block's bytes: this node's copy, else a peer's", SINCE, G,
        complexity="O(N), N being the block's length",
        flags="readonly fast",
        acl="string",
        keys=(K("RO access", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0), A("local", "pure-token", token="LOCAL", flags="optional")),
    ),
    "locate": D(
        "List every residency of each key: this node's tiers, peers, engines", SINCE, G,
        complexity="O(N), N being the number of keys",
        flags="readonly fast",
        acl="keyspace",
        keys=(K("RO", index=1, range=(-1, 1, 0)),),
        args=(A("key", "key", key_spec=0, flags="multiple"),),
    ),
    "route": D(
        "Choose the engine that recomputes the least for a request's blocks", SINCE, G,
        complexity="O(N*E), N being the request's blocks and E the engines",
        args=(A("request", "oneof", args=(
            A("json", "string"),
            A("field", "block", flags="multiple", args=(A("name", "string"), A("value", "string"))),
            A("hashes", "block", args=(
                A("numhashes", "integer", token="HASHES"),
                A("hash", "string", flags="multiple",
                  summary="a block hash: an unsigned or signed 64-bit decimal, or hex"),
                *_ROUTE_OPTIONS,
            )),
            A("packed", "block", args=(
                A("hashes", "string", token="PACKED",
                  summary="the block hashes as little-endian unsigned 64-bit ints, 8 bytes each"),
                *_ROUTE_OPTIONS,
            )),
        )),),
    ),
    "release": D(
        "End an in-flight request taken with ROUTE ... ACQUIRE", SINCE, G,
        complexity="O(1)",
        args=(A("lease", "string"),),
    ),
    "kvevents": D(
        "Apply a batch of an engine's KV-cache events", SINCE, G,
        complexity="O(N), N being the batch's events",
        args=(A("engine-id", "string"), A("batch", "string")),
    ),
    "peerauth": D(
        "Authenticate a cluster peer's connection with the cluster secret", SINCE, G,
        complexity="O(1)",
        flags="fast no_auth no_multi",
        acl="connection",
        args=(A("secret", "string"),),
        redact=_peer_secret,
    ),
    "dir": D(
        "A request to this node's part of the sharded directory (cluster peers)", SINCE, G,
        complexity="O(N), N being the entries the request names",
        flags=_PEER_ONLY,
        args=(A("from", "string"), A("request", "string")),
    ),
    "peermget": D(
        "Read this node's copies of small values for another node, with their CRC32C (cluster peers)", SINCE, G,
        complexity="O(N), N being the keys",
        flags="readonly no_multi",
        keys=(K("RO access", index=5, range=(-1, 1, 0)),),
        args=(A("tenant", "string"), A("model", "string"), A("tokenizer", "string"), A("adapter", "string"),
              A("key", "key", key_spec=0, flags="multiple")),
    ),
    "peerget": D(
        "Read this node's copy of a key in another node's request, with its CRC32C (cluster peers)", SINCE, G,
        complexity="O(N), N being the value's length",
        flags="readonly no_multi",
        keys=(K("RO access", index=5, range=(0, 1, 0)),),
        args=(
            A("tenant", "string"), A("model", "string"), A("tokenizer", "string"), A("adapter", "string"),
            A("key", "key", key_spec=0), A("min-bytes", "integer", token="RDMA", flags="optional"),
            A("pxat", "pure-token", token="PXAT", flags="optional"),
        ),
    ),
    "peerpull": D(
        "Pull keys from the pool into this node and keep them: a disaggregated request's prefetch (cluster "
        "peers)", SINCE, G,
        complexity="O(N), N being the keys",
        flags="write no_multi",
        keys=(K("RW insert", index=5, range=(-1, 1, 0)),),
        args=(
            A("tenant", "string"), A("model", "string"), A("tokenizer", "string"), A("adapter", "string"),
            A("key", "key", key_spec=0, flags="multiple"),
        ),
    ),
    "peerrdma": D(
        "Set up an RDMA queue pair with a cluster peer", SINCE, G,
        complexity="O(1)",
        flags=_PEER_ONLY,
        args=(A("json", "string", token="CONNECT"),),
    ),
    "peerrelease": D(
        "Release blocks a peer leased for RDMA READ", SINCE, G,
        complexity="O(N), N being the leases",
        flags="readonly no_multi",
        args=(A("lease", "integer", flags="multiple"),),
    ),
    "nodes": D(
        "List the cluster's members, one line each", SINCE, G,
        complexity="O(N), N being the members",
        flags="loading stale",
    ),
    "shm": D(
        "A container for the shared-memory path's commands (same-host clients)", SINCE, G,
        complexity="Depends on subcommand.",
    ),
    "shm|hello": D(
        "Say whether this client may use shared memory: the unix socket, the host's boot id, the arena's "
        "size, the lease length, and whether this user may map", SINCE, G,
        complexity="O(1)",
        flags="fast no_multi",
        acl="connection",
    ),
    "shm|attach": D(
        "Receive the DRAM arena's and the lease table's descriptors (SCM_RIGHTS; unix socket and "
        "security.map_users only); with TABLE, the lookup table's and its read marks' too, and the salt "
        "of this connection's identity scope", SINCE, G,
        complexity="O(1)",
        flags="no_multi",
        acl="connection dangerous",
        args=(A("table", "pure-token", token="TABLE", flags="optional"),),
    ),
    "shm|get": D(
        "Where each key's block lies in the arena, pinned by a lease: [offset, length, crc32c, slot, "
        "generation] (or, attached with TABLE, its lookup table entry), or the bytes of an inline value, "
        "or nil", SINCE, G,
        complexity="O(N), N being the number of keys",
        flags="readonly fast no_multi",
        acl="string",
        keys=(K("RO access", index=2, range=(-1, 1, 0)),),
        args=(A("key", "key", key_spec=0, flags="multiple"),),
    ),
    "shm|reserve": D(
        "Reserve regions for many blocks written in place: per key [handle, offset], EXISTS or its error",
        SINCE, G,
        complexity="O(N), N being the number of keys",
        flags="write denyoom no_multi",
        acl="string",
        getkeys=_shm_reserve_keys,
        keys=(K("OW update incomplete", index=3, range=(-1, 2, 0),
                notes="CHAINED key nbytes hash parent ...: every fourth argument from the fifth"),),
        args=(A("lease-ms", "integer", summary="the puts' lease (0: blocks.default_lease_ms)"),
              A("chained", "pure-token", token="CHAINED", flags="optional",
                summary="each block also names its engine hash and its parent's (empty: none)"),
              A("block", "block", flags="multiple", args=(A("key", "key", key_spec=0), A("nbytes", "integer")))),
    ),
    "shm|commit": D(
        "Commit many blocks written in place, each checked against its CRC32C: per handle OK or its error",
        SINCE, G,
        complexity="O(N), N being the bytes of the blocks",
        flags="write no_multi",
        acl="string",
        args=(A("put", "block", flags="multiple", args=(A("handle", "string"), A("crc", "integer"))),),
    ),
    "shm|release": D(
        "End shared-memory read leases", SINCE, G,
        complexity="O(N), N being the number of slots",
        flags="fast no_multi",
        acl="connection",
        args=(A("slot", "integer", flags="multiple"),),
    ),
}
