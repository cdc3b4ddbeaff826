"""quilld/index/engine_hashes.py against vLLM 0.33's own block hashes (issue 30, its first piece).

tests/fixtures/vllm_block_hashes.json was written by tools/make_vllm_hash_fixtures.py running
vLLM's real Request, block hasher and BlockPool; nothing of vLLM is imported here. Every case of
every algo and seed must come out byte for byte: the chain of full-block hashes, NONE_HASH, and
the BlockStored events' hashes (int and bytes forms), parents and extra keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quilld.errors import ConfigError
from quilld.index.engine_hashes import EngineBlockHash, EngineHashing, Lora, SeedUnknown

FIXTURES = json.loads((Path(__file__).resolve().parent.parent / "fixtures" / "vllm_block_hashes.json").read_text())
CASES = FIXTURES["cases"]


def case_id(case: dict) -> str:
    return f"{case['algo']}-seed:{case['hash_seed']}-{case['name']}"


def test_the_fixtures_cover_every_algo_with_and_without_a_seed_and_each_extra_key():
    assert FIXTURES["vllm_version"].startswith("0.33.")
    seen = {(c["algo"], c["hash_seed"] is None) for c in CASES}
    assert seen == {("sha256", True), ("sha256", False), ("sha256_cbor", True), ("sha256_cbor", False),
                    ("xxhash", False), ("xxhash_cbor", False)}
    assert {(r["algo"], r["hash_seed"]) for r in FIXTURES["random_seed"]} == {("xxhash", None), ("xxhash_cbor", None)}
    assert any(c["lora"] and c["cache_salt"] for c in CASES) and any(c["cache_salt"] == "" for c in CASES)
    assert any(len(c["token_ids"]) % c["block_size"] for c in CASES)  # partial last blocks
    assert any(len(c["token_ids"]) < c["block_size"] for c in CASES)  # no full block at all


@pytest.mark.parametrize("row", FIXTURES["none_hashes"], ids=lambda r: f"{r['algo']}-seed:{r['hash_seed']}")
def test_none_hash_is_vllms_for_each_algo_and_seed(row):
    assert EngineHashing(row["algo"], row["hash_seed"], 16).none_hash.hex() == row["none_hash"]


def hashing_of(case: dict) -> tuple[EngineHashing, Lora | None]:
    lora = None if case["lora"] is None else Lora(case["lora"]["name"], case["lora"]["path"])
    return EngineHashing(case["algo"], case["hash_seed"], case["block_size"]), lora


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_block_hashes_are_vllms_byte_for_byte(case):
    hashing, lora = hashing_of(case)
    got = hashing.block_hashes(case["token_ids"], lora, case["cache_salt"])
    assert [h.hex() for h in got] == case["block_hashes"]
    assert len(got) == len(case["token_ids"]) // case["block_size"]  # full blocks only
    assert all(type(h) is EngineBlockHash for h in got)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_kv_events_forms_of_hashes_parents_and_extra_keys_are_vllms(case):
    hashing, lora = hashing_of(case)
    chain = hashing.block_hashes(case["token_ids"], lora, case["cache_salt"])
    done = 0
    for int_hashes, events in ((True, case["events_int"]), (False, case["events_bytes"])):
        done = 0
        for event in events:
            n = len(event["block_hashes"])
            blocks = chain[done:done + n]

            def form(h: EngineBlockHash) -> int | str:
                f = h.event_form(int_hashes)
                return f if int_hashes else f.hex()

            assert event["block_hashes"] == [form(h) for h in blocks]
            assert event["parent_block_hash"] == (None if done == 0 else form(chain[done - 1]))
            keys = hashing.event_extra_keys(n, lora, case["cache_salt"], first_block=done == 0)
            assert event["extra_keys"] == (None if keys is None else [None if k is None else list(k) for k in keys])
            assert event["lora_name"] == (lora.name if lora else None)
            assert event["token_ids"] == case["token_ids"][done * case["block_size"]:(done + n) * case["block_size"]]
            done += n
    assert done == len(chain)


@pytest.mark.parametrize("case", [c for c in CASES if len(c["block_hashes"]) >= 2], ids=case_id)
def test_a_continued_prompt_chains_from_its_parent(case):
    """Hashing a prompt's tail from its head's last hash gives the same chain as hashing it whole
    (the engine hashes a request's new blocks so; the salt belongs to block 0 only)."""
    hashing, lora = hashing_of(case)
    size, whole = case["block_size"], hashing.block_hashes(case["token_ids"], lora, case["cache_salt"])
    head = hashing.block_hashes(case["token_ids"][:size], lora, case["cache_salt"])
    tail = hashing.block_hashes(case["token_ids"][size:], lora, case["cache_salt"], parent=head[-1])
    assert head + tail == whole


def test_an_engines_random_seed_is_refused_and_bad_configs_said_so():
    for algo in ("xxhash", "xxhash_cbor"):
        with pytest.raises(SeedUnknown, match="PYTHONHASHSEED"):
            EngineHashing(algo, None, 16)
    with pytest.raises(ConfigError, match="unknown prefix caching hash algo"):
        EngineHashing("md5", "0", 16)
    for size in (0, -16, 16.0):
        with pytest.raises(ConfigError, match="block_size"):
            EngineHashing("sha256", None, size)


def test_an_engine_block_hash_is_not_a_pool_key_and_its_event_form_is_the_low_64_bits():
    h = EngineHashing("sha256", None, 4).block_hashes([1, 2, 3, 4])[0]
    assert isinstance(h, bytes) and type(h) is EngineBlockHash and len(h) == 32
    assert h.event_form() == int.from_bytes(h[-8:], "big") and h.event_form(False) == bytes(h)
    assert type(h.event_form(False)) is bytes


def test_one_string_object_for_a_loras_name_and_path_hashes_as_the_engines_two():
    """The engine's LoRA name and path are two strings parsed apart (`--lora-modules name=path`), so
    pickle writes both; one object passed twice must not turn the second into a back-reference."""
    case = next(c for c in CASES if c["name"] == "lora_name_equals_path" and c["algo"] == "sha256")
    name = "".join(case["lora"]["name"])  # one object
    hashing = EngineHashing(case["algo"], case["hash_seed"], case["block_size"])
    got = hashing.block_hashes(case["token_ids"], Lora(name, name), case["cache_salt"])
    assert [h.hex() for h in got] == case["block_hashes"]
