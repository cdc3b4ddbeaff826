"""WAL framing and records: round trips across blocks, and a reader that stops at the
first torn, zeroed or corrupt record and keeps everything before it, or (with resync, as
recovery reads) skips the damaged block and keeps everything after it too (issue 19.18)."""

import os
import random

import pytest

from quilld.tiers.wal import (
    BLOCK_SIZE,
    FIRST,
    FULL,
    HEADER_SIZE,
    LAST,
    MIDDLE,
    BadRecord,
    DelRecord,
    MetaRecord,
    PutRecord,
    Stop,
    WalReader,
    WalWriter,
    decode_batch,
    encode_batch,
    frame,
    mask_crc,
    parse_wal_name,
    unmask_crc,
    wal_name,
)


def records(n, seed=1):
    rng = random.Random(seed)
    sizes = [0, 1, 7, BLOCK_SIZE - HEADER_SIZE, BLOCK_SIZE, 3 * BLOCK_SIZE + 5, 100_000]
    out = []
    for i in range(n):
        size = sizes[i] if i < len(sizes) else rng.choice([rng.randrange(200), rng.randrange(70_000)])
        out.append(rng.randbytes(size))
    return out


def read_all(data):
    reader = WalReader(data)
    got = [rec for _, rec in reader]
    return got, reader


def test_round_trip_across_blocks():
    recs = records(300)
    data = frame(recs, 0)
    got, reader = read_all(data)
    assert got == recs
    assert reader.stop is Stop.END and reader.end == len(data)
    assert len(data) > 10 * BLOCK_SIZE


def test_appending_in_pieces_equals_one_frame():
    recs = records(60, seed=2)
    pieces = b""
    for i in range(0, 60, 7):
        pieces += frame(recs[i:i + 7], len(pieces))
    assert pieces == frame(recs, 0)


def test_fragment_types_for_a_record_spanning_three_blocks():
    data = frame([b"x" * (2 * BLOCK_SIZE)], 0)
    types = []
    pos = 0
    while pos < len(data):
        length = int.from_bytes(data[pos + 4:pos + 6], "little")
        types.append(data[pos + 6])
        pos += HEADER_SIZE + length
    assert types == [FIRST, MIDDLE, LAST]


def test_block_tail_shorter_than_a_header_is_zero_padded():
    first = b"a" * (BLOCK_SIZE - HEADER_SIZE - 3)  # leaves 3 bytes in the block
    data = frame([first, b"b"], 0)
    assert data[BLOCK_SIZE - 3:BLOCK_SIZE] == bytes(3)
    assert data[BLOCK_SIZE + 6] == FULL
    assert read_all(data)[0] == [first, b"b"]


def test_exact_header_room_gives_an_empty_first_fragment():
    first = b"a" * (BLOCK_SIZE - 2 * HEADER_SIZE)  # leaves exactly one header of room
    data = frame([first, b"bc"], 0)
    assert data[BLOCK_SIZE - HEADER_SIZE + 6] == FIRST
    assert read_all(data)[0] == [first, b"bc"]


def test_mask_round_trip():
    for crc in (0, 1, 0xFFFFFFFF, 0x12345678):
        assert unmask_crc(mask_crc(crc)) == crc
        assert mask_crc(crc) != crc


def test_torn_tail_at_every_offset_keeps_the_complete_prefix():
    recs = [b"r%03d" % i * 50 for i in range(8)] + [bytes(range(256)) * 300]  # the last spans 3 blocks
    data = frame(recs, 0)
    ends = [0]
    for i in range(len(recs)):
        ends.append(len(frame(recs[:i + 1], 0)))
    cuts = list(range(0, 2000)) + list(range(len(data) - 2000, len(data)))
    cuts += list(range(BLOCK_SIZE - 20, BLOCK_SIZE + 20))
    for cut in cuts:
        got, reader = read_all(data[:cut])
        complete = sum(1 for e in ends[1:] if e <= cut)
        assert got == recs[:complete], cut
        assert reader.end == ends[complete]
        if cut == ends[complete]:
            assert reader.stop is Stop.END
        else:
            assert reader.stop is Stop.TORN, (cut, reader.detail)


def fragment_spans(data):
    """(start, end) of every fragment, header included, in order."""
    spans, pos = [], 0
    while pos < len(data):
        if BLOCK_SIZE - pos % BLOCK_SIZE < HEADER_SIZE:
            pos += BLOCK_SIZE - pos % BLOCK_SIZE
            continue
        length = int.from_bytes(data[pos + 4:pos + 6], "little")
        spans.append((pos, pos + HEADER_SIZE + length))
        pos += HEADER_SIZE + length
    return spans


def test_flipped_bit_stops_at_the_corrupted_record():
    recs = records(40, seed=3)
    data = frame(recs, 0)
    starts = [off for off, _ in WalReader(data)] + [len(data)]
    spans = fragment_spans(data)
    rng = random.Random(4)
    for _ in range(300):
        start, end = rng.choice(spans)
        pos = rng.randrange(start, end)
        i = max(j for j, s in enumerate(starts) if s <= pos)  # the record that owns the byte
        bad = bytearray(data)
        bad[pos] ^= 1 << rng.randrange(8)
        got, reader = read_all(bytes(bad))
        assert got == recs[:i], (i, pos)
        assert reader.stop in (Stop.CORRUPT, Stop.TORN)
        assert reader.end == starts[i]


def test_zero_filled_tail():
    recs = records(5, seed=5)
    data = frame(recs, 0)
    got, reader = read_all(data + bytes(3 * BLOCK_SIZE))
    assert got == recs
    assert reader.stop is Stop.ZEROS
    assert reader.stop_offset == len(data)
    assert reader.end == len(data)


def test_zeroed_record_in_the_middle_stops_there():
    recs = [b"a" * 100, b"b" * 100, b"c" * 100]
    data = bytearray(frame(recs, 0))
    data[107:214] = bytes(107)
    got, reader = read_all(bytes(data))
    assert got == [b"a" * 100]
    assert reader.stop is Stop.ZEROS and reader.stop_offset == 107


def test_missing_second_fragment_loses_only_that_record():
    big = b"z" * (BLOCK_SIZE + 100)
    data = frame([b"small", big], 0)
    # the log ends at the block boundary, after the FIRST fragment
    got, reader = read_all(data[:BLOCK_SIZE])
    assert got == [b"small"]
    assert reader.stop is Stop.TORN and reader.end == HEADER_SIZE + 5
    # the LAST fragment replaced by zeros, as a filesystem may leave it
    got, reader = read_all(data[:BLOCK_SIZE] + bytes(BLOCK_SIZE))
    assert got == [b"small"] and reader.stop is Stop.ZEROS


def test_fragment_out_of_sequence_is_corrupt():
    a = frame([b"x" * (BLOCK_SIZE + 10)], 0)  # FIRST, LAST
    b = frame([b"y" * (BLOCK_SIZE + 10)], 0)
    spliced = a[:BLOCK_SIZE] + a[:BLOCK_SIZE]  # FIRST then another FIRST
    got, reader = read_all(spliced)
    assert got == [] and reader.stop is Stop.CORRUPT and reader.stop_offset == BLOCK_SIZE
    got, reader = read_all(b[BLOCK_SIZE:])  # LAST with no FIRST
    assert got == [] and reader.stop is Stop.CORRUPT and reader.stop_offset == 0


def test_length_crossing_the_block_is_corrupt():
    data = bytearray(frame([b"q" * 10], 0))
    data[4:6] = (BLOCK_SIZE).to_bytes(2, "little")
    got, reader = read_all(bytes(data))
    assert got == [] and reader.stop is Stop.CORRUPT


def test_put_del_and_meta_batch_round_trip():
    put = PutRecord(7, ("t", "llama", "tok", ""), b"\x00key\xff", 3, 1 << 33, 123456, 0xDEADBEEF)
    ttl = PutRecord(8, ("t", "llama", "tok", ""), b"k2", 3, 4096, 28, 0xBEEF, 1_767_225_600_123)
    dele = DelRecord(2**63 + 5, ("tenant-é", "m", "", "lora"), b"")
    meta = MetaRecord(8, ("t", "llama", "tok", ""), b"k2", 0)
    assert decode_batch(encode_batch([put, dele, put, ttl, meta])) == [put, dele, put, ttl, meta]
    assert put.expire == 0 and ttl.expire == 1_767_225_600_123
    assert decode_batch(encode_batch([])) == []
    assert len(encode_batch([put])) < 50


@pytest.mark.parametrize("raw", [b"", b"\x01", b"\xc1", b"\x91\x93\x01\x02\x03", b"\x91\x01",
                                 b"\x91\x97\x03\x01\xa0\xa0\xa0\xa0\xc4\x00"])
def test_bad_batch_is_typed(raw):
    with pytest.raises(BadRecord):
        decode_batch(raw)


def test_writer_appends_where_the_file_ends(tmp_path):
    path = str(tmp_path / wal_name(3))
    recs = records(30, seed=6)
    w = WalWriter(path, 3)
    assert w.append(recs[:10]) == w.size
    w.close()
    w = WalWriter(path, 3)
    w.append(recs[10:])
    w.close()
    with open(path, "rb") as f:
        data = f.read()
    assert data == frame(recs, 0)
    assert os.path.getsize(path) == len(data)
    assert parse_wal_name(wal_name(3)) == 3
    assert parse_wal_name("wal-x.log") is None and parse_wal_name("checkpoint") is None


# -- replay rules the SSD tier's durability rests on (issue 11, finding 8) ---------------------

SCOPE = ("alice", "llama-3-8b", "tok-v1", "")


def replay(records, retired=None):
    from quilld.tiers.ssd_format import replay_log

    state, scopes = {}, {}
    applied, max_gen, problems = replay_log(frame([encode_batch(r) for r in records], 0), state, scopes, retired)
    assert problems == []
    return {k[1]: loc.generation for k, loc in state.items()}, applied, max_gen


def test_replay_lists_every_version_that_loses_so_recovery_can_scrub_it():
    records = [
        [PutRecord(1, SCOPE, b"k", 0, 0, 10, 1)],
        [PutRecord(3, SCOPE, b"k", 0, 4096, 10, 3)],  # replaces generation 1
        [PutRecord(2, SCOPE, b"k", 0, 8192, 10, 2)],  # older than what is installed: loses at once
        [DelRecord(3, SCOPE, b"k")],  # deletes generation 3
        [PutRecord(4, SCOPE, b"j", 0, 12288, 10, 4), DelRecord(3, SCOPE, b"j")],  # a DEL of an older version
    ]
    retired = []
    state, applied, max_gen = replay(records, retired)
    assert state == {b"j": 4} and applied == 6 and max_gen == 4
    assert [(k[1], loc.generation, loc.offset) for k, loc in retired] == [
        (b"k", 1, 0), (b"k", 2, 8192), (b"k", 3, 4096)]


@pytest.mark.parametrize("order", ["put-first", "del-first"])
def test_a_delete_never_removes_a_newer_version_in_either_order(order):
    put, stale_del = [PutRecord(9, SCOPE, b"k", 0, 0, 10, 9)], [DelRecord(5, SCOPE, b"k")]
    records = [put, stale_del] if order == "put-first" else [stale_del, put]
    assert replay(records)[0] == {b"k": 9}
    assert replay(records + [[DelRecord(9, SCOPE, b"k")]])[0] == {}  # the version itself deleted: gone


def test_a_group_of_deletions_spans_records_and_replays_whole():
    from quilld.tiers.ssd import DELETE_RECORD_OPS

    n = DELETE_RECORD_OPS + 10
    puts = [[PutRecord(i + 1, SCOPE, b"k%d" % i, 0, i * 4096, 1, 0) for i in range(n)]]
    dels = [DelRecord(i + 1, SCOPE, b"k%d" % i) for i in range(n)]
    chunks = [dels[i:i + DELETE_RECORD_OPS] for i in range(0, n, DELETE_RECORD_OPS)]
    assert len(chunks) == 2
    state, applied, _ = replay(puts + chunks)
    assert state == {} and applied == 2 * n


# -- resync: one damaged stretch costs one block's records, not the rest (issue 19.18) ---------

def expected_after_damage(data, recs, pos):
    """What a resyncing reader must return when the byte at `pos` is damaged: every record
    that ended before the fragment holding it, then every record that starts from the next
    32 KiB block on (the damaged block's own later records are skipped with it)."""
    spans = fragment_spans(data)
    bad = next(((a, b) for a, b in spans if a <= pos < b), None)
    if bad is None:
        return recs  # a byte of a block's zero-filled tail: never read
    starts = [off for off, _ in WalReader(data)]
    ends = [len(frame(recs[:i + 1], 0)) for i in range(len(recs))]
    resume = (bad[0] // BLOCK_SIZE + 1) * BLOCK_SIZE
    return [r for r, a, e in zip(recs, starts, ends) if e <= bad[0] or a >= resume]


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_resync_keeps_every_record_the_damage_spared(where):
    recs = records(60, seed=7)
    data = frame(recs, 0)
    spans = fragment_spans(data)
    rng = random.Random(8)
    third = len(spans) // 3
    pool = {"start": spans[:3], "middle": spans[third:2 * third], "end": spans[-3:]}[where]
    for _ in range(100):
        start, end = rng.choice(pool)
        pos = rng.randrange(start, end)
        bad = bytearray(data)
        bad[pos] ^= 1 << rng.randrange(8)
        reader = WalReader(bytes(bad), resync=True)
        got = [rec for _, rec in reader]
        assert got == expected_after_damage(data, recs, pos), pos
        assert reader.skipped and reader.skipped[0][1] in (Stop.CORRUPT, Stop.TORN), reader.skipped
        assert reader.stop is reader.skipped[0][1] and reader.stop_offset == reader.skipped[0][0]
        if where == "start":
            assert len(got) > len(recs) // 2  # the old reader kept nothing here


def test_resync_over_a_zeroed_stretch_and_a_torn_tail():
    recs = [b"r%03d" % i * 200 for i in range(400)]  # 800-byte records, about 40 per block
    data = bytearray(frame(recs, 0))
    data[BLOCK_SIZE + 100:3 * BLOCK_SIZE + 50] = bytes(2 * BLOCK_SIZE - 50)  # a hole of zeros
    torn = bytes(data[:-3])
    reader = WalReader(torn, resync=True)
    got = [rec for _, rec in reader]
    kinds = [why for _, why, _ in reader.skipped]
    # one damaged stretch (the fragment the zeros cut into, then zeros: one stretch), then the torn tail
    assert len(kinds) == 2 and kinds[0] in (Stop.CORRUPT, Stop.ZEROS) and kinds[1] is Stop.TORN, reader.skipped
    assert got[0] == recs[0] and got[-1] == recs[-2]  # the last record was torn
    kept_after = [r for r in got if int(r[1:4]) > 200]
    assert kept_after and len(got) > len(recs) // 2
    # a clean log has nothing to skip
    reader = WalReader(frame(recs, 0), resync=True)
    assert [rec for _, rec in reader] == recs and reader.skipped == [] and reader.stop is Stop.END
