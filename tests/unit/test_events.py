"""KV-event decoding on plain bytes: vLLM 0.33's schema (msgspec structs mirroring its
kv_events.py field for field: array-like batch, tagged map events, omit_defaults), the
older positional encoding, the ZMQ frames around them, the seed's JSON shape, sequence
gaps; a bad event is skipped and counted while the rest of its batch decodes, a broken
envelope fails with MalformedEvent (never another exception), and JSON stays all or nothing.
"""

from __future__ import annotations

import json

import msgpack
import pytest
import vllm_schema as vllm
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


def test_group_fields_and_extra_positional_fields():
    # newer vLLM appends extra_keys, group_idx, kv_cache_spec_*, locality, ownership, session_id
    payload = pack(
        [
            0,
            [
                ["BlockStored", [1], None, [1], 1, None, "GPU", None, [["mm", 1]], 1, "sliding_window", 4096,
                 "LOCAL", None, "sess"],
                ["BlockRemoved", [1], "GPU", 1, "LOCAL", None],
            ],
        ]
    )
    stored, removed = decode_payload(payload).events
    assert stored == Stored((1,), None, (1,), 1, None, "GPU", None, 1, "sliding_window", 4096, (["mm", 1],))
    assert removed == Removed((1,), "GPU", 1)


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
    assert stored == Stored((b"\xaa" * 8, -5), b"\xbb" * 8, (1, 2, 3, 4), 2, 1, "DISK", "x", 0)
    assert removed == Removed((-5,), "disk")
    assert cleared == Cleared()


def test_map_event_optional_fields_may_be_absent():
    payload = pack([0, [{"type": "BlockStored", "block_hashes": [1], "block_size": 16}]])
    assert decode_payload(payload).events == (Stored((1,), None, (), 16, None, None),)


def test_map_encoded_batch():
    # newer vLLM: EventBatch is a plain struct, so the batch itself is a map
    payload = pack({"ts": 3.0, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 2})
    assert decode_payload(payload) == Batch(3.0, (Cleared(),), 2, None)


def test_vllm_033_encoding_decodes_field_for_field():
    """vLLM 0.33's own declarations (tests/vllm_schema.py): array-like batch, tagged map events."""
    payload = vllm.encode(
        [
            vllm.BlockStored([BIG, b"\x01" * 32], None, [1, 2], 1, 3, "GPU", "ad", extra_keys=[("mm", 1), None],
                             group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4096,
                             locality="LOCAL", session_id="s-1"),
            vllm.BlockRemoved([BIG], "CPU", group_idx=1, locality="LOCAL"),
            vllm.AllBlocksCleared(),
        ],
        ts=10.5,
        dp_rank=1,
    )
    obj = msgpack.unpackb(payload)
    assert isinstance(obj, list) and isinstance(obj[1][0], dict) and obj[1][0]["type"] == "BlockStored"
    assert "ownership" not in obj[1][0]  # omit_defaults: a field at its default is not sent
    got = decode_frames([b"kv", seq(7), payload])
    assert got == Batch(
        10.5,
        (
            Stored((BIG, b"\x01" * 32), None, (1, 2), 1, 3, "GPU", "ad", 1, "sliding_window", 4096, (["mm", 1], None)),
            Removed((BIG,), "CPU", 1),
            Cleared(),
        ),
        1,
        7,
    )
    assert got.malformed == 0


def test_legacy_positional_encoding_decodes():
    payload = vllm.encode([vllm.gpu([1, 2]), vllm.removed([1]), vllm.AllBlocksCleared()], ts=2.0, legacy=True)
    assert isinstance(msgpack.unpackb(payload)[1][0], list)
    stored, removed, cleared = decode_payload(payload).events
    assert stored == Stored((1, 2), None, tuple(range(32)), 16, None, "GPU")
    assert removed == Removed((1,), "GPU") and cleared == Cleared()


def test_offload_placeholders_and_storage_medium():
    """vLLM's offloading connector: block_size=0, token_ids=[], medium CPU or STORAGE; vLLM 0.33 names
    the offloaded block's group_idx (older releases, none)."""
    payload = vllm.encode([vllm.offloaded([5, 6]), vllm.offloaded([7], vllm.MEDIUM_STORAGE),
                           vllm.removed([5], vllm.MEDIUM_CPU, group=None), vllm.offloaded([8], group=2)])
    a, b, r, g = decode_payload(payload).events
    assert a == Stored((5, 6), None, (), 0, None, "CPU")
    assert b == Stored((7,), None, (), 0, None, "STORAGE") and medium_tier(b.medium) is CacheTier.STORAGE
    assert r == Removed((5,), "CPU", None)
    assert g == Stored((8,), None, (), 0, None, "CPU", None, 2)


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
    assert decode_frames(end).malformed == 1  # never a batch of events


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
        ("STORAGE", CacheTier.STORAGE),
        ("storage", CacheTier.STORAGE),
        ("DISK", CacheTier.STORAGE),  # the engine's own disk, never this pool's SSD tier
        ("Disk", CacheTier.STORAGE),
        ("CPU_PINNED", CacheTier.CPU),  # SGLang's names
        ("EXTERNAL", CacheTier.STORAGE),
    ],
)
def test_medium_tier(medium, tier):
    assert medium_tier(medium) == tier
    assert medium_tier(medium) == tier.value  # a plain string comparison works too


@pytest.mark.parametrize("medium", ["NVME", "", "GPU0", "SSD", 3])
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
            Stored((b"\x00\xff", b"\xab\xcd", 12), b"\x01", (1, 2, 3), 16, None, "CPU", "sql", 0),
            Removed((b"\x00\xff",), None, 0),
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


# A broken envelope: nothing in the payload can be trusted, decode_payload raises.
BROKEN = [
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
]


@pytest.mark.parametrize("payload, fragment", [m[1:] for m in BROKEN], ids=[m[0] for m in BROKEN])
def test_broken_envelope(payload, fragment):
    with pytest.raises(MalformedEvent) as exc:
        decode_payload(payload)
    assert fragment in exc.value.message
    assert exc.value.message.startswith("malformed KV event")
    assert isinstance(exc.value, CommandError)
    assert exc.value.wire().startswith("ERR malformed KV event")
    # inside ZMQ frames the sequence number still counts: an empty batch marked malformed
    got = decode_frames([b"t", seq(41), payload])
    assert (got.seq, got.events, got.malformed) == (41, (), 1) and fragment in got.problems[0]


# One bad event: skipped and counted, the good events around it apply.
BAD_EVENTS = [
    ("event scalar", 5, "events[1]"),
    ("event empty array", [], "events[1]"),
    ("tag not string", [1, [1]], "tag"),
    ("unknown tag", ["BlockEvicted", [1]], "unknown event tag"),
    ("unknown tag in map", {"type": "Nope"}, "unknown event tag"),
    ("map without type", {"block_hashes": [1]}, "type"),
    ("missing block_hashes", ["BlockRemoved"], "block_hashes"),
    ("missing block_size", ["BlockStored", [1], None, [1]], "block_size"),
    ("block_hashes not array", stored_with(block_hashes=1), "block_hashes"),
    ("block_hashes a string", {"type": "BlockStored", "block_hashes": "abc", "block_size": 1}, "block_hashes"),
    ("hash string", stored_with(block_hashes=["ab"]), "bad hash type"),
    ("hash float", stored_with(block_hashes=[1.0]), "bad hash type"),
    ("hash bool", stored_with(block_hashes=[True]), "bad hash type"),
    ("hash nil", stored_with(block_hashes=[None]), "bad hash type"),
    ("hash empty bytes", stored_with(block_hashes=[b""]), "empty hash"),
    ("hash ext type", stored_with(block_hashes=[msgpack.ExtType(1, b"x")]), "bad hash type"),
    # msgpack has no integer wider than 64 bits: a 65-bit value can only arrive as a float
    ("hash 65 bits", stored_with(block_hashes=[2, float(2**64)]), "bad hash type"),
    ("removed hash 65 bits", ["BlockRemoved", [float(2**64 + 5)], "GPU"], "bad hash type"),
    ("parent string", stored_with(parent_block_hash="p"), "parent_block_hash"),
    ("token_ids nil", stored_with(token_ids=None), "token_ids"),
    ("token_ids a string", stored_with(token_ids="abc"), "token_ids"),
    ("block_size negative", stored_with(block_size=-1), "block_size"),
    ("block_size nil", stored_with(block_size=None), "block_size"),
    ("block_size float", stored_with(block_size=16.0), "block_size"),
    ("lora_id string", stored_with(lora_id="a"), "lora_id"),
    ("lora_name int", STORED_OK + [7], "lora_name"),
    ("medium int", stored_with(medium=1), "medium"),
    ("medium unknown", stored_with(medium="TAPE"), "unknown medium"),
    ("removed medium unknown", ["BlockRemoved", [1], "HBM"], "unknown medium"),
    ("group_idx string", {"type": "BlockRemoved", "block_hashes": [1], "group_idx": "0"}, "group_idx"),
    ("group_idx too large", {"type": "BlockRemoved", "block_hashes": [1], "group_idx": 64}, "group_idx"),
    ("group_idx negative", STORED_OK + [None, None, -1], "group_idx"),
    ("window string", {"type": "BlockStored", "block_hashes": [1], "block_size": 1,
                       "kv_cache_spec_sliding_window": "4k"}, "sliding_window"),
]


@pytest.mark.parametrize("bad, fragment", [m[1:] for m in BAD_EVENTS], ids=[m[0] for m in BAD_EVENTS])
def test_one_bad_event_is_skipped_and_the_rest_of_its_batch_applies(bad, fragment):
    good_before = ["BlockStored", [10, 11], None, [], 0, None, "STORAGE"]
    good_after = {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU", "group_idx": 0}
    batch = decode_frames([b"t", seq(3), pack([1.0, [good_before, bad, good_after, ["AllBlocksCleared"]], 0])])
    assert batch.seq == 3 and batch.malformed == 1
    assert batch.events == (Stored((10, 11), None, (), 0, None, "STORAGE"), Removed((12,), "GPU", 0), Cleared())
    assert len(batch.problems) == 1 and fragment in batch.problems[0] and "events[1]" in batch.problems[0]
    # the JSON shape is answered at once, so it stays all or nothing
    if isinstance(bad, dict):
        with pytest.raises(MalformedEvent, match=r"events\[1\]"):
            decode_json({"events": [{"type": "all_blocks_cleared"}, {k: v for k, v in bad.items()}]})


def test_many_bad_events_are_all_counted_and_a_few_described():
    events = [["BlockEvicted", [i]] for i in range(10)] + [STORED_OK]
    batch = decode_payload(pack([1.0, events]))
    assert batch.malformed == 10 and len(batch.events) == 1
    assert len(batch.problems) == ev.MAX_PROBLEMS


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
        st.integers(0, 1024),
        st.none() | st.integers(0, 100),
        st.sampled_from([None, "GPU", "CPU", "STORAGE", "DISK"]),
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
def test_valid_batches_round_trip_and_one_bad_event_costs_only_itself(events, n, data):
    payload = pack([1.0, events, 0])
    batch = decode_frames([b"topic", seq(n), payload])
    assert batch.seq == n and len(batch.events) == len(events) and batch.malformed == 0
    for raw, got in zip(events, batch.events):
        if isinstance(got, Cleared):
            assert raw == ["AllBlocksCleared"]
        else:
            assert list(got.block_hashes) == raw[1]
            assert got.medium == raw[-1]
    # inserting one malformed event anywhere skips that event only
    at = data.draw(st.integers(0, len(events)))
    bad = events[:at] + [["BlockStored", [1], None, [1], -1]] + events[at:]
    spoiled = decode_payload(pack([1.0, bad]))
    assert spoiled.events == batch.events and spoiled.malformed == 1
    assert f"events[{at}].block_size" in spoiled.problems[0]


# ---------------------------------------------------------------- the strict path (msgspec) and the lenient one


def _lenient(payload: bytes, seq_no: int | None = None) -> Batch:
    """What the lenient decoder alone gives (the strict path bypassed)."""
    try:
        obj = msgpack.unpackb(payload, raw=False)
    except Exception as e:
        raise MalformedEvent(f"payload is not msgpack ({type(e).__name__}: {e})") from None
    return ev._batch(obj, ev._msgpack_hash, seq_no)


def test_vllm_payloads_take_the_strict_path():
    """What vLLM sends, keyed (0.33) and positional (older), is decoded by msgspec in one pass, not
    by the lenient decoder: the same batch, every field in place."""
    events = [vllm.gpu([1, BIG], parent=NEG, lora="ad"), vllm.offloaded([5], group=2), vllm.removed([NEG]),
              vllm.removed([b"\x01" * 32], medium=None, group=None), vllm.AllBlocksCleared(),
              vllm.BlockStored([b"\xaa" * 8], b"\xbb", [], 0, 7, "STORAGE", None, extra_keys=[("mm", 1), None],
                               group_idx=3, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=128)]
    for legacy in (False, True):
        payload = vllm.encode(events, ts=4.5, dp_rank=2, legacy=legacy)
        strict = ev._strict(payload, 9)
        assert strict is not None, f"legacy={legacy}"
        assert strict == _lenient(payload, 9) == decode_payload(payload, 9)
        assert [type(e) for e in strict.events] == [Stored, Stored, Removed, Removed, Cleared, Stored]


def test_strict_structs_follow_the_event_tuples_field_order():
    """A keyed event becomes a Stored/Removed by its fields' order alone (astuple): the two must agree."""
    renamed = {"parent_block_hash": "parent", "kv_cache_spec_sliding_window": "sliding_window"}
    assert tuple(renamed.get(f, f) for f in ev._KStored.__struct_fields__) == Stored._fields
    assert ev._KRemoved.__struct_fields__ == Removed._fields == ev._PRemoved.__struct_fields__
    assert set(ev._MEDIA) == set(ev._Medium.__args__)


@pytest.mark.parametrize("payload", [
    pack([1.0, [{"type": "BlockStored", "block_hashes": [1], "block_size": 16, "medium": "gpu"}]]),  # lower case
    pack([1.0, [{"kind": "BlockStored", "block_hashes": [1], "block_size": 16}]]),  # "kind", not "type"
    pack([1.0, [{"type": "block_removed", "block_hashes": [1]}]]),  # the JSON spelling
    pack([1.0, [{"type": "BlockStored", "block_hashes": [b""], "block_size": 16}]]),  # an empty hash
    pack([1.0, [{"type": "BlockStored", "block_hashes": [1], "block_size": -1}]]),
    pack([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "group_idx": ev.MAX_GROUPS}]]),
    pack([float("nan"), [], 0]),
    pack([1.0, [], -1]),
    pack({"ts": 1.0, "events": []}),
    pack([1.0, [["BlockStored", [1], None, [1], 16, None, "DISK", None, None, 1], ["Nope"]]]),
])
def test_what_the_strict_path_refuses_the_lenient_one_decodes_alike(payload):
    assert ev._strict(payload, 3) is None
    try:
        want = _lenient(payload, 3)
    except MalformedEvent as e:
        with pytest.raises(MalformedEvent, match=e.message[:30].replace("(", r"\(").replace(")", r"\)")):
            decode_payload(payload, 3)
    else:
        assert decode_payload(payload, 3) == want


keyed_event = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["BlockStored", "BlockStored", "block_stored"]),
         "block_hashes": st.lists(st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=9), max_size=3)},
        optional={"parent_block_hash": st.none() | st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=3),
                  "token_ids": st.none() | st.lists(st.integers(0, 9), max_size=3),
                  "block_size": st.integers(-1, 32) | st.booleans(), "lora_id": st.none() | st.integers(0, 3),
                  "medium": st.sampled_from([None, "GPU", "CPU", "STORAGE", "cpu", "DISK", "HBM", 1]),
                  "lora_name": st.none() | st.text(max_size=2), "group_idx": st.none() | st.integers(-1, 70),
                  "kv_cache_spec_kind": st.none() | st.text(max_size=3),
                  "kv_cache_spec_sliding_window": st.none() | st.integers(0, 9) | st.text(max_size=1),
                  "extra_keys": st.lists(st.none() | st.lists(st.integers(0, 9), max_size=2), max_size=2),
                  "locality": st.text(max_size=2)}),
    st.fixed_dictionaries(
        {"type": st.just("BlockRemoved"),
         "block_hashes": st.lists(st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=9), max_size=3)},
        optional={"medium": st.sampled_from([None, "GPU", "CPU", "gpu", 2]),
                  "group_idx": st.none() | st.integers(-1, 70)}),
    st.just({"type": "AllBlocksCleared"}),
)
positional_event = st.one_of(
    st.tuples(st.just("BlockStored"), st.lists(st.integers(0, 2**64 - 1) | st.binary(max_size=9), max_size=3),
              st.none() | st.integers(0, 9), st.lists(st.integers(0, 9), max_size=3), st.integers(-1, 32),
              st.none() | st.integers(0, 3), st.sampled_from([None, "GPU", "CPU", "cpu"]),
              st.none() | st.text(max_size=2),
              st.none() | st.lists(st.integers(0, 9), max_size=2), st.none() | st.integers(-1, 70)).map(list),
    st.tuples(st.just("BlockRemoved"), st.lists(st.integers(NEG, 9) | st.binary(max_size=9), max_size=3),
              st.sampled_from([None, "GPU", "DISK"])).map(list),
    st.just(["AllBlocksCleared"]),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(keyed_event, max_size=5) | st.lists(positional_event, max_size=5),
       st.floats(allow_nan=True, allow_infinity=True) | st.integers(0, 9), st.none() | st.integers(-1, 3))
def test_strict_and_lenient_paths_give_the_same_batch(events, ts, dp_rank):
    """On random payloads, valid or not, mixing what vLLM sends with what it never does: whatever
    the strict path accepts decodes exactly as the lenient decoder alone decodes it."""
    payload = pack([ts, events, dp_rank])
    strict = ev._strict(payload, 1)
    if strict is not None:
        assert strict == _lenient(payload, 1)
        assert strict.malformed == 0
    try:
        want = _lenient(payload, 1)
    except MalformedEvent:
        with pytest.raises(MalformedEvent):
            decode_payload(payload, 1)
    else:
        assert decode_payload(payload, 1) == want
