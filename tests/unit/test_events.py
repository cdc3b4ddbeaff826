"""KV-event decoding on plain bytes: vLLM's positional and map encodings, the ZMQ
frames around them, the seed's JSON shape, sequence gaps, and every malformed input
failing with MalformedEvent (never another exception, never half a batch).
"""

from __future__ import annotations

import json

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quilld.errors import CommandError
from quilld.index import events as ev
from quilld.index.events import (
    Batch,
    Cleared,
    MalformedEvent,
    Removed,
    SequenceTracker,
    Stored,
    decode_frames,
    decode_json,
    decode_payload,
    is_replay_end,
    medium_tier,
)
from quilld.model import CacheTier

BIG = 2**64 - 1
NEG = -(2**63)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


# ---------------------------------------------------------------- positional (array_like)


def test_positional_batch_with_all_three_events():
    payload = pack(
        [
            1712.25,
            [
                ["BlockStored", [1, 2], None, list(range(8)), 4, None, "GPU"],
                ["BlockRemoved", [1], "GPU"],
                ["AllBlocksCleared"],
            ],
            3,
        ]
    )
    assert decode_payload(payload) == Batch(
        ts=1712.25,
        events=(
            Stored((1, 2), None, tuple(range(8)), 4, None, "GPU"),
            Removed((1,), "GPU"),
            Cleared(),
        ),
        dp_rank=3,
        seq=None,
    )


def test_int_hashes_keep_sign_and_width():
    payload = pack([0, [["BlockStored", [NEG, -1, 0, 2**63, BIG], BIG, [], 16, None, None]]])
    (stored,) = decode_payload(payload).events
    assert stored.block_hashes == (NEG, -1, 0, 2**63, BIG)
    assert stored.parent == BIG
    assert all(type(h) is int for h in stored.block_hashes)


def test_bytes_hashes_stay_bytes():
    h1, h2 = b"\x00" * 32, bytes(range(32))
    payload = pack([0.0, [["BlockStored", [h1, h2], h1, [5, 6], 1, None, None], ["BlockRemoved", [h2], None]]])
    stored, removed = decode_payload(payload).events
    assert stored.block_hashes == (h1, h2) and stored.parent == h1
    assert removed.block_hashes == (h2,)


def test_lora_id_medium_and_lora_name():
    payload = pack([0, [["BlockStored", [7], 6, [1, 2], 2, 42, "CPU", "my-adapter"]]])
    (stored,) = decode_payload(payload).events
    assert (stored.lora_id, stored.medium, stored.lora_name) == (42, "CPU", "my-adapter")


def test_omitted_trailing_fields_default_to_none():
    payload = pack(
        [0, [["BlockStored", [1], None, [9, 9], 2], ["BlockStored", [2], 1, [3], 1, 5], ["BlockRemoved", [1]]]]
    )
    a, b, removed = decode_payload(payload).events
    assert (a.lora_id, a.medium, a.lora_name) == (None, None, None)
    assert (b.lora_id, b.medium) == (5, None)
    assert removed == Removed((1,), None)


def test_extra_positional_fields_are_ignored():
    # newer vLLM appends extra_keys, group_idx, kv_cache_spec_* after lora_name
    payload = pack(
        [
            0,
            [
                ["BlockStored", [1], None, [1], 1, None, "GPU", None, [["mm", 1]], 0, "full", None],
                ["BlockRemoved", [1], "GPU", 0],
            ],
        ]
    )
    stored, removed = decode_payload(payload).events
    assert stored == Stored((1,), None, (1,), 1, None, "GPU")
    assert removed == Removed((1,), "GPU")


def test_dp_rank_is_optional():
    assert decode_payload(pack([5, []])) == Batch(5.0, (), None, None)
    assert decode_payload(pack([5, [], None])).dp_rank is None
    assert decode_payload(pack([5, [], 0])).dp_rank == 0


# ---------------------------------------------------------------- map-encoded events


def test_map_events_with_type_field():
    payload = pack(
        [
            2.5,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [b"\xaa" * 8, -5],
                    "parent_block_hash": b"\xbb" * 8,
                    "token_ids": [1, 2, 3, 4],
                    "block_size": 2,
                    "lora_id": 1,
                    "medium": "DISK",
                    "lora_name": "x",
                    "group_idx": 0,
                },
                {"type": "BlockRemoved", "block_hashes": [-5], "medium": "disk"},
                {"type": "AllBlocksCleared"},
            ],
            1,
        ]
    )
    stored, removed, cleared = decode_payload(payload).events
    assert stored == Stored((b"\xaa" * 8, -5), b"\xbb" * 8, (1, 2, 3, 4), 2, 1, "DISK", "x")
    assert removed == Removed((-5,), "disk")
    assert cleared == Cleared()


def test_map_event_optional_fields_may_be_absent():
    payload = pack([0, [{"type": "BlockStored", "block_hashes": [1], "block_size": 16}]])
    assert decode_payload(payload).events == (Stored((1,), None, (), 16, None, None),)


def test_map_encoded_batch():
    # newer vLLM: EventBatch is a plain struct, so the batch itself is a map
    payload = pack({"ts": 3.0, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 2})
    assert decode_payload(payload) == Batch(3.0, (Cleared(),), 2, None)


def test_real_msgspec_encodings_decode():
    """vLLM's own struct declarations, encoded by msgspec both ways (array_like and map)."""
    import msgspec  # the `test` extra installs it
    for array_like in (True, False):

        class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, tag=True):
            pass

        class BlockStored(KVCacheEvent):
            block_hashes: list[int | bytes]
            parent_block_hash: int | bytes | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None
            extra_keys: list | None = None
            group_idx: int | None = None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[int | bytes]
            medium: str | None
            group_idx: int | None = None

        class AllBlocksCleared(KVCacheEvent):
            pass

        class KVEventBatch(msgspec.Struct, array_like=array_like, omit_defaults=True):
            ts: float
            events: list[BlockStored | BlockRemoved | AllBlocksCleared]
            data_parallel_rank: int | None = None

        batch = KVEventBatch(
            ts=10.5,
            events=[
                BlockStored([BIG, b"\x01" * 32], None, [1, 2], 1, 3, "GPU", "ad", group_idx=1),
                BlockRemoved([BIG], "CPU"),
                AllBlocksCleared(),
            ],
            data_parallel_rank=1,
        )
        payload = msgspec.msgpack.encode(batch)
        got = decode_frames([b"kv", seq(7), payload])
        assert got == Batch(
            10.5,
            (Stored((BIG, b"\x01" * 32), None, (1, 2), 1, 3, "GPU", "ad"), Removed((BIG,), "CPU"), Cleared()),
            1,
            7,
        ), f"array_like={array_like}"


# ---------------------------------------------------------------- frames


def test_frames_with_topic_carry_the_sequence():
    payload = pack([1, [["AllBlocksCleared"]]])
    assert decode_frames([b"kv-events", seq(2**40 + 3), payload]) == Batch(1.0, (Cleared(),), None, 2**40 + 3)


def test_frames_without_topic_from_replay():
    payload = pack([1, []])
    assert decode_frames([seq(0), payload]).seq == 0
    assert decode_frames((memoryview(seq(9)), bytearray(payload))).seq == 9


def test_replay_end_marker():
    end = [(-1).to_bytes(8, "big", signed=True), b""]
    assert is_replay_end(end)
    assert not is_replay_end([seq(1), pack([1, []])])
    with pytest.raises(MalformedEvent):
        decode_frames(end)


@pytest.mark.parametrize(
    "frames, fragment",
    [
        ([], "frames"),
        ([pack([1, []])], "frames"),
        ([b"t", seq(1), pack([1, []]), b"extra"], "frames"),
        ([b"t", b"\x00" * 7, pack([1, []])], "8 bytes"),
        ([b"t", b"\x00" * 9, pack([1, []])], "8 bytes"),
        ([b"t", seq(1), "not bytes"], "frame 2"),
        ("abc", "frames"),
        ([b"t", seq(1), b""], "not msgpack"),
    ],
)
def test_malformed_frames(frames, fragment):
    with pytest.raises(MalformedEvent) as exc:
        decode_frames(frames)
    assert fragment in exc.value.message


# ---------------------------------------------------------------- sequence tracking


def test_sequence_in_order_gap_and_duplicates():
    t = SequenceTracker()
    assert t.observe(5) == 0  # first observation: nothing known to be missing
    assert t.observe(6) == 0
    assert t.observe(9) == 2  # 7 and 8 missing
    assert t.observe(9) == -1  # duplicate
    assert t.observe(4) == -1  # older
    assert t.last == 9
    assert t.observe(10) == 0
    t.reset()
    assert t.observe(0) == 0


def test_sequence_rejects_non_sequence_values():
    t = SequenceTracker()
    for bad in (-1, 2**64, True, 1.0, "1"):
        with pytest.raises(MalformedEvent):
            t.observe(bad)
    assert t.last is None


# ---------------------------------------------------------------- media


@pytest.mark.parametrize(
    "medium, tier",
    [
        (None, CacheTier.HBM),
        ("GPU", CacheTier.HBM),
        ("gpu", CacheTier.HBM),
        ("CPU", CacheTier.CPU),
        ("cpu", CacheTier.CPU),
        ("DISK", CacheTier.SSD),
        ("Disk", CacheTier.SSD),
    ],
)
def test_medium_tier(medium, tier):
    assert medium_tier(medium) == tier
    assert medium_tier(medium) == tier.value  # a plain string comparison works too


@pytest.mark.parametrize("medium", ["NVME", "", "GPU0", 3])
def test_unknown_medium(medium):
    with pytest.raises(MalformedEvent):
        medium_tier(medium)


# ---------------------------------------------------------------- JSON (seed shape)


def test_json_seed_shape():
    doc = {
        "engine_id": "vllm-0",
        "ts_ms": 1500,
        "model_id": "llama",
        "tokenizer_id": "llama-tok",
        "adapter_id": None,
        "tenant_id": "t1",
        "bytes_per_block": 4096,
        "events": [
            {
                "type": "block_stored",
                "block_hashes": ["00ff", "0xABCD", 12],
                "parent_block_hash": "01",
                "token_ids": [1, 2, 3],
                "block_size": 16,
                "medium": "CPU",
                "lora_name": "sql",
                "group_idx": 0,
                "bytes_per_block": 4096,
            },
            {"type": "block_removed", "block_hashes": ["00ff"], "medium": None, "group_idx": 0},
            {"kind": "all_blocks_cleared"},
            {"type": "BlockRemoved", "block_hashes": [BIG]},
        ],
    }
    want = Batch(
        1.5,
        (
            Stored((b"\x00\xff", b"\xab\xcd", 12), b"\x01", (1, 2, 3), 16, None, "CPU", "sql"),
            Removed((b"\x00\xff",), None),
            Cleared(),
            Removed((BIG,), None),
        ),
        None,
        None,
        "vllm-0",
    )
    assert decode_json(doc) == want
    assert decode_json(json.dumps(doc)) == want
    assert decode_json(json.dumps(doc).encode()) == want


def test_json_minimal():
    assert decode_json('{"events": []}') == Batch(0.0, (), None, None, None)


@pytest.mark.parametrize(
    "doc, fragment",
    [
        ("{not json", "not JSON"),
        ("[]", "JSON object"),
        ({"engine_id": "e"}, "batch.events"),
        ({"engine_id": 5, "events": []}, "batch.engine_id"),
        ({"ts_ms": -1, "events": []}, "ts_ms"),
        ({"ts_ms": 1.5, "events": []}, "ts_ms"),
        ({"tenant_id": 1, "events": []}, "tenant_id"),
        ({"events": {}}, "events"),
        ({"events": [{"type": "block_stored", "block_hashes": ["xyz"], "block_size": 1}]}, "hex"),
        ({"events": [{"type": "block_stored", "block_hashes": ["abc"], "block_size": 1}]}, "hex"),
        ({"events": [{"type": "block_stored", "block_hashes": ["ab cd"], "block_size": 1}]}, "hex"),
        ({"events": [{"type": "block_stored", "block_hashes": [""], "block_size": 1}]}, "hex"),
        ({"events": [{"type": "block_stored", "block_hashes": [1.5], "block_size": 1}]}, "bad hash type"),
        ({"events": [{"type": "block_stored", "block_hashes": [2**64], "block_size": 1}]}, "64 bits"),
        ({"events": [{"type": "block_stored", "block_hashes": ["ab"]}]}, "block_size"),
        ({"events": [{"type": "block_evicted", "block_hashes": ["ab"]}]}, "unknown event tag"),
        ({"events": [{"block_hashes": ["ab"]}]}, "type"),
        ("[" * 100_000 + "]" * 100_000, "JSON"),
    ],
)
def test_json_malformed(doc, fragment):
    with pytest.raises(MalformedEvent) as exc:
        decode_json(doc)
    assert fragment in exc.value.message


# ---------------------------------------------------------------- malformed msgpack payloads

STORED_OK = ["BlockStored", [1], None, [1], 1, None, "GPU"]


def stored_with(**changes):
    names = ("tag", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
    ev_ = dict(zip(names, STORED_OK)) | changes
    return [ev_[n] for n in names]


MALFORMED = [
    ("empty", b"", "not msgpack"),
    ("truncated", pack([1.0, [STORED_OK]])[:-3], "not msgpack"),
    ("trailing bytes", pack([1.0, []]) + b"\x00", "not msgpack"),
    ("reserved byte", b"\xc1", "not msgpack"),
    ("invalid utf-8 str", b"\xa2\xff\xfe", "not msgpack"),
    ("int map key", pack({1: 2}), "not msgpack"),
    ("batch not array", pack("hello"), "batch"),
    ("batch too short", pack([1.0]), "batch"),
    ("batch map missing events", pack({"ts": 1.0}), "batch.events"),
    ("ts string", pack(["1", []]), "batch.ts"),
    ("ts bool", pack([True, []]), "batch.ts"),
    ("ts nan", pack([float("nan"), []]), "batch.ts"),
    ("ts inf", pack([float("inf"), []]), "batch.ts"),
    ("events not array", pack([1.0, {"a": 1}]), "events"),
    ("dp_rank string", pack([1.0, [], "0"]), "dp_rank"),
    ("dp_rank negative", pack([1.0, [], -1]), "dp_rank"),
    ("event scalar", pack([1.0, [5]]), "events[0]"),
    ("event empty array", pack([1.0, [[]]]), "events[0]"),
    ("tag not string", pack([1.0, [[1, [1]]]]), "tag"),
    ("unknown tag", pack([1.0, [["BlockEvicted", [1]]]]), "unknown event tag"),
    ("unknown tag in map", pack([1.0, [{"type": "Nope"}]]), "unknown event tag"),
    ("map without type", pack([1.0, [{"block_hashes": [1]}]]), "type"),
    ("missing block_hashes", pack([1.0, [["BlockRemoved"]]]), "block_hashes"),
    ("missing block_size", pack([1.0, [["BlockStored", [1], None, [1]]]]), "block_size"),
    ("block_hashes not array", pack([1.0, [stored_with(block_hashes=1)]]), "block_hashes"),
    ("hash string", pack([1.0, [stored_with(block_hashes=["ab"])]]), "bad hash type"),
    ("hash float", pack([1.0, [stored_with(block_hashes=[1.0])]]), "bad hash type"),
    ("hash bool", pack([1.0, [stored_with(block_hashes=[True])]]), "bad hash type"),
    ("hash nil", pack([1.0, [stored_with(block_hashes=[None])]]), "bad hash type"),
    ("hash empty bytes", pack([1.0, [stored_with(block_hashes=[b""])]]), "empty hash"),
    ("hash ext type", pack([1.0, [stored_with(block_hashes=[msgpack.ExtType(1, b"x")])]]), "bad hash type"),
    ("parent string", pack([1.0, [stored_with(parent_block_hash="p")]]), "parent_block_hash"),
    ("token_ids nil", pack([1.0, [stored_with(token_ids=None)]]), "token_ids"),
    ("token id negative", pack([1.0, [stored_with(token_ids=[1, -1])]]), "token_ids[1]"),
    ("token id string", pack([1.0, [stored_with(token_ids=["a"])]]), "token_ids[0]"),
    ("block_size zero", pack([1.0, [stored_with(block_size=0)]]), "block_size"),
    ("block_size nil", pack([1.0, [stored_with(block_size=None)]]), "block_size"),
    ("block_size float", pack([1.0, [stored_with(block_size=16.0)]]), "block_size"),
    ("lora_id string", pack([1.0, [stored_with(lora_id="a")]]), "lora_id"),
    ("lora_name int", pack([1.0, [STORED_OK + [7]]]), "lora_name"),
    ("medium int", pack([1.0, [stored_with(medium=1)]]), "medium"),
    ("medium unknown", pack([1.0, [stored_with(medium="TAPE")]]), "unknown medium"),
    ("removed medium unknown", pack([1.0, [["BlockRemoved", [1], "HBM"]]]), "unknown medium"),
    ("bad event after good ones", pack([1.0, [STORED_OK, ["AllBlocksCleared"], ["BlockRemoved", "x"]]]), "events[2]"),
]


@pytest.mark.parametrize("payload, fragment", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_payload(payload, fragment):
    with pytest.raises(MalformedEvent) as exc:
        decode_payload(payload)
    assert fragment in exc.value.message
    assert exc.value.message.startswith("malformed KV event")
    assert isinstance(exc.value, CommandError)
    assert exc.value.wire().startswith("ERR malformed KV event")


def test_payload_not_bytes():
    with pytest.raises(MalformedEvent):
        decode_payload("text")  # type: ignore[arg-type]


def test_payload_size_limit(monkeypatch):
    payload = pack([1.0, [STORED_OK] * 10])
    monkeypatch.setattr(ev, "MAX_PAYLOAD_BYTES", len(payload))
    assert len(decode_payload(payload).events) == 10
    monkeypatch.setattr(ev, "MAX_PAYLOAD_BYTES", len(payload) - 1)
    with pytest.raises(MalformedEvent, match="exceeds"):
        decode_payload(payload)


def test_deep_nesting_is_rejected_cleanly():
    payload = b"\x91" * 100_000 + b"\xc0"  # 100k nested one-element arrays
    with pytest.raises(MalformedEvent):
        decode_payload(payload)


# ---------------------------------------------------------------- property tests

FIELD_NAMES = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"]
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "CPU", "DISK", "type"]),
    lambda children: st.lists(children, max_size=6)
    | st.dictionaries(st.text(max_size=6) | st.sampled_from(FIELD_NAMES), children, max_size=6),
    max_leaves=40,
)


def _decode_or_malformed(payload: bytes) -> None:
    try:
        batch = decode_payload(payload)
    except MalformedEvent:
        return
    assert isinstance(batch, Batch)
    assert all(isinstance(e, (Stored, Removed, Cleared)) for e in batch.events)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=64))
def test_random_bytes_decode_or_raise_malformed(data):
    _decode_or_malformed(data)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgpack_values)
def test_random_msgpack_objects_decode_or_raise_malformed(obj):
    _decode_or_malformed(pack(obj))
    _decode_or_malformed(pack([1.0, [obj]]))
    _decode_or_malformed(pack([1.0, obj, 0]))


event_strategy = st.one_of(
    st.builds(
        lambda hs, parent, toks, bs, lora, medium: ["BlockStored", hs, parent, toks, bs, lora, medium],
        st.lists(st.integers(-(2**63), 2**64 - 1) | st.binary(min_size=1, max_size=32), max_size=4),
        st.none() | st.integers(-(2**63), 2**64 - 1) | st.binary(min_size=1, max_size=32),
        st.lists(st.integers(0, 2**32 - 1), max_size=8),
        st.integers(1, 1024),
        st.none() | st.integers(0, 100),
        st.sampled_from([None, "GPU", "CPU", "DISK"]),
    ),
    st.builds(
        lambda hs, medium: ["BlockRemoved", hs, medium],
        st.lists(st.integers(-(2**63), 2**64 - 1) | st.binary(min_size=1, max_size=32), max_size=4),
        st.sampled_from([None, "GPU", "cpu"]),
    ),
    st.just(["AllBlocksCleared"]),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(event_strategy, max_size=6), st.integers(0, 2**64 - 1), st.data())
def test_valid_batches_round_trip_and_one_bad_event_spoils_the_batch(events, n, data):
    payload = pack([1.0, events, 0])
    batch = decode_frames([b"topic", seq(n), payload])
    assert batch.seq == n and len(batch.events) == len(events)
    for raw, got in zip(events, batch.events):
        if isinstance(got, Cleared):
            assert raw == ["AllBlocksCleared"]
        else:
            assert list(got.block_hashes) == raw[1]
            assert got.medium == raw[-1]
    # inserting one malformed event anywhere rejects the whole batch
    at = data.draw(st.integers(0, len(events)))
    bad = events[:at] + [["BlockStored", [1], None, [1], 0]] + events[at:]
    with pytest.raises(MalformedEvent, match=rf"events\[{at}\]\.block_size"):
        decode_payload(pack([1.0, bad]))
