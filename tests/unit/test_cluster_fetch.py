"""`Cluster.fetch` (cluster/cluster.py): a key held only by peers, read into this node.

Real keyspace, scope registry, control plane, residency feed and directory; gossip is
never started. The directory holds the peers' entries as an owner would (`place`: every
node owns everything in a cluster this small, so lookups are local). Only the network is replaced:
`Peers` stands in for `Transfers.fetch_into` (TCP or RDMA), writing each peer's answer
into the memory `target(length)` names, as the real transfers do.
"""

from __future__ import annotations

import asyncio
import time
import random

import crc32c
import pytest

from quilld.cluster.cluster import Cluster
from quilld.cluster.peer_client import PeerError
from quilld.cluster.dir_entries import KEY as KEY_ENTRY, TIER_BIT, code_of, key_shard
from quilld.config import ClusterConfig, Config, DramConfig
from quilld.index.control import ControlPlane
from quilld.index.residency_feed import ResidencyFeed
from quilld.model import CacheTier, IdentityScope, Pinned
from quilld.scopes import ScopeRegistry
from quilld.tiers.arena import PAGE
from quilld.tiers.block import Block, page_extent
from quilld.tiers.keyspace import Keyspace

SCOPE = IdentityScope("acme", "llama", "tok", "")
INLINE_MAX = 512
KEY = b"block-17"
TIMEOUT = 5.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


def data(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


class Peers:
    """Stands in for the network (Transfers.fetch_into) and nothing else.

    `answers[peer]` is what that peer does: ("ok", payload) sends the payload with its
    CRC32C (("ok", payload, at): and that it expires at unix ms `at` there); ("badcrc", payload)
    sends it with a wrong CRC; ("break", payload) receives
    half of it, then the connection breaks (PeerError); ("nil-after-target", payload)
    names the memory, then answers nil (an RDMA attempt fell back to TCP and the key was
    gone meanwhile); None answers nil; an exception instance is raised before any byte.
    """

    def __init__(self, answers: dict, keyspace) -> None:
        self.answers = answers
        self.keyspace = keyspace
        self.calls: list[str] = []
        self.arena_used_at_call: list[int] = []

    async def fetch_into(self, peer, addr, meta, scope, key, target):
        assert scope == SCOPE and key == KEY
        self.calls.append(peer)
        self.arena_used_at_call.append(self.keyspace.arena.used)
        await asyncio.sleep(0)
        answer = self.answers[peer]
        if answer is None:
            return None, None, -1
        if isinstance(answer, Exception):
            raise answer
        how, payload, *at = answer
        view = target(len(payload))
        if how == "nil-after-target":
            return None, None, -1
        if how == "break":
            half = len(payload) // 2
            view[:half] = payload[:half]
            raise PeerError("peer closed the connection mid-transfer")
        view[:] = payload
        crc = crc32c.crc32c(payload)
        return (crc ^ 1 if how == "badcrc" else crc), view, (at[0] if at else -1)


def make_cluster(answers: dict, holders: dict[str, CacheTier], keep: bool = True, pages: int = 16):
    """A Cluster over real parts, told by its peers' replication logs that `holders` have KEY."""
    cfg = Config(dram=DramConfig(size=pages * PAGE, inline_max=INLINE_MAX),
                 cluster=ClusterConfig(keep_fetched=keep, transfer="tcp"))
    scopes = ScopeRegistry()
    keyspace = Keyspace(cfg.dram, scopes)
    control = ControlPlane(cfg, scopes)
    feed = ResidencyFeed(control.index, "n1", scopes)
    keyspace.listener = feed
    cluster = Cluster(cfg, "n1", keyspace, scopes, control, feed,
                      lambda: {"port": 7379, "admin_port": 0})
    tag = scopes.tag(SCOPE)
    for port, (peer, tier) in enumerate(holders.items(), 17000):
        size = len(answers[peer][1]) if isinstance(answers.get(peer), tuple) else 1
        place(cluster, tag, peer, KEY, tier, size)
        cluster.addresses[peer] = ("127.0.0.1", port)
    cluster.transfers = cluster.reads.transfers = Peers(answers, keyspace)
    return cluster, keyspace, tag


def place(cluster: Cluster, tag: bytes, peer: str, key: bytes, tier: CacheTier, size: int) -> None:
    """`peer` holds `key` in `tier`, as the directory's owner (this node) hears it from that peer."""
    d = cluster.directory
    d.set_members({**d.members, cluster.node_id: 1.0, peer: 1.0}, 0.0)
    eid = cluster.link.ctag(tag) + key
    d.owned.put(peer, KEY_ENTRY, eid, key_shard(eid), d.bucket_of(key_shard(eid)), code_of(TIER_BIT[tier], size))


def check_nothing_held(ks) -> None:
    assert (ks.reserved_blocks, ks.held_bytes, ks.active_pins) == (0, 0, 0)
    assert ks.used == ks.arena.used + ks.inline_bytes


# -- success --------------------------------------------------------------------------------

def test_large_block_is_verified_returned_pinned_and_kept():
    payload = data(3 * PAGE + 11, 1)
    cluster, ks, tag = make_cluster({"n2": ("ok", payload)}, {"n2": CacheTier.DRAM})
    assert ks.get(tag, KEY) is None

    got = run(cluster.fetch(SCOPE, tag, KEY))
    assert type(got) is Pinned and bytes(got.view) == payload
    assert ks.active_pins == 1
    got.release()
    assert cluster.stats["peer_fetches"] == 1 and cluster.stats["peer_fetch_bytes"] == len(payload)
    block = ks.data[tag + KEY]
    assert type(block) is Block and block.crc == crc32c.crc32c(payload)
    local = ks.get(tag, KEY)  # kept: a second read is a local hit
    assert type(local) is Pinned and bytes(local.view) == payload
    local.release()
    assert ks.arena.used == page_extent(len(payload))
    check_nothing_held(ks)


def test_inline_sized_value_is_returned_as_bytes_and_kept():
    payload = data(INLINE_MAX, 2)
    cluster, ks, tag = make_cluster({"n2": ("ok", payload)}, {"n2": CacheTier.SSD})
    got = run(cluster.fetch(SCOPE, tag, KEY))
    assert type(got) is bytes and got == payload
    assert ks.get(tag, KEY) == payload and ks.arena.used == 0
    check_nothing_held(ks)


@pytest.mark.parametrize("size", [100, 3 * PAGE + 11])
def test_a_kept_copy_expires_when_the_holders_copy_does(size):
    at = int(time.time() * 1000) + 60_000
    payload = data(size, 4)
    cluster, ks, tag = make_cluster({"n2": ("ok", payload, at)}, {"n2": CacheTier.DRAM})
    got = run(cluster.fetch(SCOPE, tag, KEY))
    if type(got) is Pinned:
        got.release()
    assert ks.expire_time(tag, KEY) == at and 0 < ks.ttl_ms(tag, KEY) <= 60_000
    ks.set_expire(tag, KEY, int(time.time() * 1000) - 1)  # its time comes: gone here too
    assert ks.get(tag, KEY) is None
    check_nothing_held(ks)


@pytest.mark.parametrize("size", [100, 2 * PAGE + 1])
def test_not_kept_fetch_is_not_published_and_release_gives_the_space_back(size):
    payload = data(size, 3)
    cluster, ks, tag = make_cluster({"n2": ("ok", payload)}, {"n2": CacheTier.DRAM}, keep=False)
    got = run(cluster.fetch(SCOPE, tag, KEY))
    assert ks.get(tag, KEY) is None  # nothing published
    if size <= INLINE_MAX:
        assert type(got) is bytes and got == payload and ks.arena.used == 0
    else:
        assert type(got) is Pinned and bytes(got.view) == payload
        assert ks.arena.used == page_extent(size) and ks.reserved_blocks == 1
        got.release()
    assert ks.arena.used == 0 and ks.used == 0
    check_nothing_held(ks)


# -- failures ---------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [100, 2 * PAGE])
def test_checksum_mismatch_returns_nothing_discards_and_tries_the_next_holder(size):
    bad, good = data(size, 4), data(size, 5)
    answers = {"n2": ("badcrc", bad), "n3": ("ok", good)}
    cluster, ks, tag = make_cluster(answers, {"n2": CacheTier.DRAM, "n3": CacheTier.SSD})
    got = run(cluster.fetch(SCOPE, tag, KEY))
    peers = cluster.transfers
    assert peers.calls == ["n2", "n3"]  # DRAM holders first
    assert peers.arena_used_at_call == [0, 0]  # n2's reservation was given back before n3
    value = got if type(got) is bytes else bytes(got.view)
    assert value == good
    if type(got) is Pinned:
        got.release()
    assert cluster.stats["peer_fetch_checksum_failures"] == 1 and cluster.stats["peer_fetches"] == 1
    check_nothing_held(ks)


def test_checksum_mismatch_from_the_only_holder_raises_and_keeps_nothing():
    cluster, ks, tag = make_cluster({"n2": ("badcrc", data(2 * PAGE, 6))}, {"n2": CacheTier.DRAM})
    with pytest.raises(PeerError, match="checksum"):
        run(cluster.fetch(SCOPE, tag, KEY))
    assert ks.get(tag, KEY) is None and ks.arena.used == 0 and ks.used == 0
    check_nothing_held(ks)


@pytest.mark.parametrize("failure", ["refused", "break"])
def test_peer_error_is_counted_and_the_next_holder_tried(failure):
    good = data(2 * PAGE + 3, 7)
    first = PeerError("peer 127.0.0.1:17000: connection refused") if failure == "refused" \
        else ("break", data(2 * PAGE + 3, 8))
    cluster, ks, tag = make_cluster({"n2": first, "n3": ("ok", good)},
                                    {"n2": CacheTier.DRAM, "n3": CacheTier.SSD})
    got = run(cluster.fetch(SCOPE, tag, KEY))
    assert cluster.transfers.calls == ["n2", "n3"]
    assert cluster.transfers.arena_used_at_call == [0, 0]
    assert type(got) is Pinned and bytes(got.view) == good
    got.release()
    assert cluster.stats["peer_fetch_errors"] == 1 and cluster.stats["peer_fetches"] == 1
    check_nothing_held(ks)


def test_every_holder_failing_raises_peer_error():
    answers = {"n2": PeerError("connection refused"), "n3": ("break", data(3 * PAGE, 9))}
    cluster, ks, tag = make_cluster(answers, {"n2": CacheTier.DRAM, "n3": CacheTier.DRAM})
    with pytest.raises(PeerError) as err:
        run(cluster.fetch(SCOPE, tag, KEY))
    assert err.value.prefix == "PEERFAIL" and "mid-transfer" in err.value.message
    assert sorted(cluster.transfers.calls) == ["n2", "n3"]
    assert cluster.stats["peer_fetch_errors"] == 2 and cluster.stats["peer_fetches"] == 0
    assert ks.get(tag, KEY) is None and ks.arena.used == 0
    check_nothing_held(ks)


# -- nobody has it -------------------------------------------------------------------------------

def test_stale_directory_returns_none():
    cluster, ks, tag = make_cluster({"n2": None}, {"n2": CacheTier.DRAM})
    assert run(cluster.fetch(SCOPE, tag, KEY)) is None
    assert cluster.stats["peer_fetch_stale"] == 1 and cluster.transfers.calls == ["n2"]
    assert ks.get(tag, KEY) is None
    check_nothing_held(ks)


def test_nil_after_memory_was_named_gives_the_reservation_back():
    # Transfers in "auto" mode: an RDMA attempt reserves the block, fails, and the TCP
    # fallback finds the key gone (nil). The reservation must not be left behind.
    cluster, ks, tag = make_cluster({"n2": ("nil-after-target", data(2 * PAGE, 10))},
                                    {"n2": CacheTier.DRAM})
    assert run(cluster.fetch(SCOPE, tag, KEY)) is None
    assert cluster.stats["peer_fetch_stale"] == 1
    assert ks.arena.used == 0 and ks.used == 0
    check_nothing_held(ks)


def test_no_holder_or_no_address_asks_nobody():
    cluster, ks, tag = make_cluster({"n2": ("ok", b"x")}, {"n2": CacheTier.DRAM})
    assert run(cluster.fetch(SCOPE, tag, b"not-" + KEY)) is None
    del cluster.addresses["n2"]  # a holder gossip has not given an address for yet
    assert run(cluster.fetch(SCOPE, tag, KEY)) is None
    assert cluster.transfers.calls == []
    check_nothing_held(ks)
