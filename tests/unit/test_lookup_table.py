"""The same-host lookup table (quilld/tiers/lookup_table.py) on a real keyspace, read through its
descriptors by quillclient's own reader (quillclient/lookup.py), as a mapped client reads it.

What a reader observes: a block published with its CRC32C is found under its key, in its own
scope only; a reader that loses the race (its key overwritten, deleted, evicted, demoted,
renamed, changed in place, given a TTL or flushed between its first look and the end of its
copy, the block's space written by its next owner meanwhile) never gets those bytes: it gets
the key's value as it is now, or is told to ask quilld. The reads it makes are counted in the
keyspace's LRU; a dead quilld's table is never read.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap

import crc32c
import pytest
from quillclient import lookup
from quillclient.errors import BufferTooSmall
from quillclient.lookup import NOT_HERE, Lookup
from quillclient.segments import Segments

from quilld.config import DramConfig
from quilld.model import IdentityScope, Pinned
from quilld.scopes import ScopeRegistry
from quilld.tiers.arena import PAGE
from quilld.tiers.block import Block
from quilld.tiers.expiry import now_ms
from quilld.tiers.keyspace import Keyspace
from quilld.tiers.lookup_table import (ENTRY_WORDS, HEADER_WORDS, PROBE, VERSION, LookupTable, digest,
                                      table_slots)

ALICE = IdentityScope("alice", "llama", "tok", "")
CAROL = IdentityScope("carol", "llama", "tok", "")  # another tenant: her values fill and reuse the arena
VALUE = 3 * PAGE


@pytest.fixture
def ks():
    k = Keyspace(DramConfig(size=32 * PAGE, inline_max=256), ScopeRegistry())
    yield k
    k.close()


@pytest.fixture
def table(ks):
    t = LookupTable(ks, 64, frozenset({"alice"}))
    ks.lookup_table = t
    yield t
    if t.fd >= 0:
        t.close()


def put(ks: Keyspace, tag: bytes, key: bytes, value: bytes, crc: bool = True) -> Block:
    """A block published as a put publishes it: with its CRC32C (in the table at once)."""
    block = ks.reserve(len(value))
    ks.write_view(block)[:] = value
    if crc:
        block.crc = crc32c.crc32c(value)
    ks.publish(tag, key, block)
    return block


class Preempted:
    """The arena as a reader copies out of it, with `between()` run just before its first copy
    starts (a reader preempted after its look at the entry): the copy takes the memory as it is
    then."""

    def __init__(self, arena: memoryview, between) -> None:
        self.arena, self.between, self.ran = arena, between, False

    def __getitem__(self, where: slice) -> memoryview:
        if not self.ran:
            self.ran = True
            self.between()
        return self.arena[where]


def reader(ks: Keyspace, table: LookupTable, tag: bytes) -> Lookup:
    """A client's view: the arena and the table mapped through their descriptors, the salt of its scope."""
    arena = mmap.mmap(ks.arena.fd, ks.capacity, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return Lookup(table.shared_fd, table.marks_fd, table.slots, PROBE, table.salt(tag), memoryview(arena))


def now_value(ks: Keyspace, tag: bytes, key: bytes) -> bytes | None:
    """What a GET answers now."""
    value = ks.get(tag, key)
    if value.__class__ is Pinned:
        try:
            return bytes(value.view)
        finally:
            value.release()
    return value


def test_a_block_is_found_in_its_own_scope_only_and_small_values_are_not_in_the_table(ks, table):
    scopes = ks.scopes
    a, a2 = scopes.tag(ALICE), scopes.tag(IdentityScope("alice", "other-model", "tok", ""))
    bob = scopes.tag(IdentityScope("bob", "llama", "tok", ""))
    value = os.urandom(VALUE)
    put(ks, a, b"k", value)
    put(ks, bob, b"k", os.urandom(VALUE))  # bob may not map: never in the table
    ks.publish(a, b"small", b"inline")
    assert table.entries == 1 and table.salt(bob) is None
    view = bytearray(VALUE)
    assert reader(ks, table, a).read_key(b"k", memoryview(view), verify=True) == VALUE and bytes(view) == value
    assert reader(ks, table, a2).read_key(b"k", memoryview(view), verify=True) == NOT_HERE, "another scope's salt"
    assert reader(ks, table, a).read_key(b"small", memoryview(view), verify=True) == NOT_HERE
    with pytest.raises(BufferTooSmall):
        reader(ks, table, a).read_key(b"k", memoryview(bytearray(10)), verify=True)


def test_a_block_published_without_its_crc_waits_for_shm_get(ks, table):
    tag = ks.scopes.tag(ALICE)
    block = put(ks, tag, b"k", os.urandom(VALUE), crc=False)  # a SET: nobody computed its CRC32C
    assert table.entries == 0
    block.crc = crc32c.crc32c(ks.view(block))  # SHM GET computes it, then puts the block there
    entry = table.add(tag + b"k", block)
    assert entry >= 0 and table.add(tag + b"k", block) == entry, "once"
    view = bytearray(VALUE)
    assert reader(ks, table, tag).read_entry(entry, b"k", memoryview(view), verify=False) == VALUE


def test_an_entry_carries_its_keys_deadline_and_is_not_believed_past_it(ks, table, monkeypatch):
    tag = ks.scopes.tag(ALICE)
    block = put(ks, tag, b"k", os.urandom(VALUE))
    at = now_ms() + 60_000
    ks.set_expire(tag, b"k", at)
    assert table.entries == 0, "its entry said it never expires: it went"
    entry = table.add(tag + b"k", block)  # SHM GET puts it back, with its deadline
    assert table.words[8 + entry * 8 + 6] == at
    r, view = reader(ks, table, tag), memoryview(bytearray(VALUE))
    assert r.read_key(b"k", view, verify=False) == VALUE
    with monkeypatch.context() as later:  # the clock past its deadline (quilld's sweep has not run yet)
        later.setattr(lookup.time, "time", lambda: at / 1000)
        assert r.read_key(b"k", view, verify=False) == NOT_HERE, "quilld expires it when asked"
    assert ks.persist(tag, b"k") and table.entries == 0


def _reuse(ks: Keyspace, nbytes: int, fill: bytes) -> Block:
    """The next owner of freed space: a value written where a block was (the allocator's first fit)."""
    block = ks.reserve(nbytes)
    ks.write_view(block)[:] = fill * nbytes
    ks.publish(ks.scopes.tag(CAROL), b"next-owner", block)
    return block


def _overwrite_small(ks, tag):
    ks.publish(tag, b"k", b"now a small value")  # no block to put in the table: its entry must go
    return True


def _overwrite_block(ks, tag):
    put(ks, tag, b"k", b"N" * VALUE)
    return False


def _delete(ks, tag):
    assert ks.delete(tag, b"k")
    return True


def _rename(ks, tag):
    assert ks.rename(tag, b"k", b"k2") == 1
    ks.delete(tag, b"k2")
    return True


def _expire(ks, tag):
    ks.set_expire(tag, b"k", now_ms() - 1)
    assert ks.lookup(tag, b"k") is None  # expired by this read
    return True


def _ttl(ks, tag):
    ks.set_ttl(tag, b"k", now_ms() + 60_000)  # its entry held no deadline: it goes
    return False


def _in_place(ks, tag):
    def change(view):
        view[:4] = b"XXXX"
    ks.write_range(tag, b"k", 0, 4, change)  # SETRANGE on an unpinned block: its bytes change where they lie
    return False


def _evict(ks, tag):
    for i in range(64):  # fill the arena: the least recently used go, `k` first
        filler = put(ks, ks.scopes.tag(CAROL), b"filler%d" % i, b"F" * VALUE, crc=False)
        if ks.data.get(tag + b"k") is None:
            return filler  # the value whose room it made: already written where k was
    raise AssertionError("k was never evicted")


def _flush(ks, tag):
    ks.flush_scope(tag)
    return True


CHANGES = {"overwritten-by-a-small-value": _overwrite_small, "overwritten-by-a-block": _overwrite_block,
           "deleted": _delete, "renamed-away": _rename, "expired": _expire, "given-a-ttl": _ttl,
           "changed-in-place": _in_place, "evicted": _evict, "flushed": _flush}


@pytest.mark.parametrize("into", ["a-buffer", "segments"])  # the reader's inline path, and its careful one
@pytest.mark.parametrize("change", CHANGES)
def test_a_reader_that_loses_the_race_never_returns_what_it_copied(ks, table, change, into):
    """The reader found the key's entry and read its fields; quilld then changes the key (and, when
    that freed the block, its next owner writes other bytes there) before the reader copies: the
    copy takes the memory as it is then, and the reader must throw it away."""
    tag = ks.scopes.tag(ALICE)
    old = os.urandom(VALUE)
    block = put(ks, tag, b"k", old)
    offset = ks.arena.offset(block.handle)
    r = reader(ks, table, tag)
    seen = []

    def between():  # quilld runs between the reader's look and its copy
        freed = CHANGES[change](ks, tag)  # True: k's block is free; a Block: its next owner already
        if freed is True:
            freed = _reuse(ks, VALUE, b"Z")
        seen.append(ks.arena.offset(freed.handle) if freed else None)

    r.arena = Preempted(r.arena, between)
    view = bytearray(VALUE)
    target = memoryview(view) if into == "a-buffer" else Segments([memoryview(view)])
    got = r.read_key(b"k", target, verify=False)
    if seen[0] is not None:
        assert seen[0] == offset, "the test must make the block's space hold another value's bytes"
    assert r.retries >= 1, "the first copy was thrown away"
    if got != NOT_HERE:  # else the reader asks quilld
        now = now_value(ks, tag, b"k")
        assert got == len(now) and bytes(view[:got]) == now, "what the reader returns is the key's value now"


def test_a_demoted_block_leaves_the_table_before_its_dram_goes_and_a_promoted_one_comes_back(tmp_path):
    """With an SSD tier: a block read back from SSD (promoted, its CRC32C known) is in the table; one
    evicted to make room (its copy is on SSD already: demoted, its DRAM freed and reused) is not,
    and a reader caught between its look and its copy never returns the next owner's bytes."""
    from test_tiering import demote_all, read_back, run, tiered

    async def body():
        async with tiered(tmp_path, pages=16, ssd_pages=64) as (ks, t, _):
            tag = ks.scopes.tag(ALICE)
            table = LookupTable(ks, 64, frozenset({"alice"}))
            ks.lookup_table = table
            try:
                value = os.urandom(VALUE)
                put(ks, tag, b"k", value)
                await demote_all(t)
                assert tag + b"k" in ks.lower and table.entries == 0, "left the table when it left DRAM"
                assert await read_back(ks, tag, b"k") == value  # promoted: in DRAM again, its SSD copy kept
                block = ks.data[tag + b"k"]
                offset = ks.arena.offset(block.handle)
                assert table.entries == 1
                r = reader(ks, table, tag)
                seen = []

                def between():
                    filler = []
                    while tag + b"k" not in ks.lower:  # k, least recently used, goes down (a clean demotion)
                        assert len(filler) < 16
                        filler.append(put(ks, ks.scopes.tag(CAROL), b"f%d" % len(filler), b"F" * VALUE,
                                          crc=False))
                    seen.append(any(ks.arena.offset(f.handle) == offset for f in filler))

                r.arena = Preempted(r.arena, between)
                view = bytearray(VALUE)
                assert r.read_key(b"k", memoryview(view), verify=False) == NOT_HERE
                assert seen == [True], "the demoted block's space was written by its next owner"
                assert r.retries >= 1 and table.entries == 0
            finally:
                table.close()

    run(body())


def test_reads_through_the_table_count_in_the_lru(ks, table):
    tag = ks.scopes.tag(ALICE)
    for key in (b"a", b"b", b"c"):
        put(ks, tag, key, os.urandom(VALUE))
    r = reader(ks, table, tag)
    assert r.read_key(b"a", memoryview(bytearray(VALUE)), verify=False) == VALUE
    assert list(ks.data)[0] == tag + b"a", "quilld has not seen the read yet"
    hits = ks.hits[tag]
    assert table.note_reads() == 1 and table.reads_noted == 1
    assert list(ks.data)[-1] == tag + b"a" and ks.hits[tag] == hits + 1
    assert table.note_reads() == 0, "each read is counted once"


def test_reads_through_the_table_count_for_an_lfu_policy(ks, table):
    """Under allkeys-lfu a key read only through the table is not the least frequently used."""
    ks.set_policy("allkeys-lfu")
    tag = ks.scopes.tag(ALICE)
    put(ks, tag, b"a", os.urandom(VALUE))
    fk = tag + b"a"
    assert ks.facts(tag, b"a").freq == 5  # a new key's counter
    r = reader(ks, table, tag)
    assert r.read_key(b"a", memoryview(bytearray(VALUE)), verify=False) == VALUE
    assert table.note_reads() == 1
    assert ks.freq.of(fk) == 6  # the first hit always counts


def test_a_key_whose_every_entry_is_taken_is_not_put_in_the_table(ks):
    table = LookupTable(ks, PROBE, frozenset({"alice"}))  # PROBE entries: one home window for all
    ks.lookup_table = table
    tag = ks.scopes.tag(ALICE)
    try:
        for i in range(PROBE + 1):
            put(ks, tag, b"k%d" % i, os.urandom(PAGE))
        assert table.entries == PROBE and table.full == 1
        ks.delete(tag, b"k0")
        assert table.entries == PROBE - 1
    finally:
        table.close()


def test_quilld_and_the_client_hash_a_key_alike(ks, table):
    """The table's layout is two programs' contract: quilld's writer and quillclient's reader."""
    tag = ks.scopes.tag(ALICE)
    r = reader(ks, table, tag)
    for key in (b"k", b"vllm@model@1@0@" + b"ab" * 32, "unicode-\u00e9".encode()):
        assert table._digest(tag + key) == digest(table.salt(tag), key) == r.digest(key)[:2]
    assert r.digest("unicode-\u00e9")[:2] == r.digest("unicode-\u00e9".encode())[:2], "a str key is its UTF-8"
    assert lookup.VERSION == VERSION and (lookup.HEADER_WORDS, lookup.ENTRY_WORDS) == (HEADER_WORDS, ENTRY_WORDS)


def test_sizes_and_seals():
    assert table_slots(-1, 1 << 30) == 0
    assert table_slots(0, 1 << 30) == 32768 and table_slots(0, 1 << 20) == 4096 and table_slots(0, 1 << 50) == 1 << 22
    assert table_slots(1000, 1 << 30) == 1024


def test_the_table_is_sealed_read_only_for_clients_and_its_marks_writable(ks, table):
    assert table.sealed and table.usable
    with pytest.raises(PermissionError):
        mmap.mmap(table.shared_fd, 64, flags=mmap.MAP_SHARED)  # no client writes the table
    for fd in (table.fd, table.marks_fd):
        with pytest.raises(PermissionError):
            os.ftruncate(os.open(f"/proc/self/fd/{fd}", os.O_RDWR), 0)
    marks = mmap.mmap(table.marks_fd, table.slots, flags=mmap.MAP_SHARED)
    marks[0] = 1  # a client's read mark
    marks.close()


HOLDER = textwrap.dedent("""
    import os, sys, time
    sys.path[:0] = sys.argv[2:]
    from quilld.config import DramConfig
    from quilld.scopes import ScopeRegistry
    from quilld.tiers.keyspace import Keyspace
    from quilld.tiers.lookup_table import LookupTable
    ks = Keyspace(DramConfig(size=1 << 20), ScopeRegistry())
    table = LookupTable(ks, 64, frozenset({"alice"}))
    print(os.getpid(), table.shared_fd, table.marks_fd, flush=True)
    sys.stdin.readline()
    if sys.argv[1] == "stop":
        table.close()
        print("closed", flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("end", ["killed", "stop"])
def test_a_dead_or_stopped_quillds_table_is_never_read(end):
    """The table's header holds quilld's robust mutex: SIGKILL marks it (the kernel), a stop unlocks
    it; either way a reader sees it with a load, no system call, and asks quilld instead."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    child = subprocess.Popen([sys.executable, "-c", HOLDER, end, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        pid, shared, marks = (int(x) for x in child.stdout.readline().split())
        fds = [os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY if fd == shared else os.O_RDWR) for fd in (shared, marks)]
        r = Lookup(fds[0], fds[1], 64, PROBE, b"s" * 16, memoryview(bytearray(PAGE)))
        assert r.alive()
        child.stdin.write(b"go\n")
        child.stdin.flush()
        if end == "killed":
            child.kill()
            child.wait(10)
        else:
            assert child.stdout.readline() == b"closed\n"
        assert not r.alive()
        assert r.read_key(b"k", memoryview(bytearray(8)), verify=False) == NOT_HERE
        for fd in fds:
            os.close(fd)
    finally:
        child.kill()
        child.wait(10)
