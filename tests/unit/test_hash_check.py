"""quilld/index/hash_check.py: an engine's KV events checked against the hashes quilld computes.

Events are vLLM 0.33's own BlockStored, encoded with vLLM's struct declarations
(tests/vllm_schema.py) and decoded by quilld's decoder, carrying the golden hashes of
tests/fixtures/vllm_block_hashes.json (made by vLLM's own code).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import vllm_schema as vllm
from quilld.index import hash_check
from quilld.index.events import decode_payload
from quilld.index.engine_hashes import EngineHashing
from quilld.index.hash_check import CHECK_FIRST, SAMPLE_EVERY, HashCheck

FIXTURES = json.loads((Path(__file__).resolve().parent.parent / "fixtures" / "vllm_block_hashes.json").read_text())
CASES = [c for c in FIXTURES["cases"] if c["block_hashes"]]


def find(name: str, algo: str = "sha256", seed: str | None = None) -> dict:
    return next(c for c in CASES if c["name"] == name and c["algo"] == algo and c["hash_seed"] == seed)


def decoded(case: dict, int_hashes: bool = True) -> list:
    """The case's BlockStored events as quilld's decoder gives them from vLLM's encoding."""
    def h(x):
        return x if int_hashes or x is None else bytes.fromhex(x)
    out = []
    for e in case["events_int" if int_hashes else "events_bytes"]:
        stored = vllm.BlockStored(block_hashes=[h(x) for x in e["block_hashes"]],
                                  parent_block_hash=h(e["parent_block_hash"]), token_ids=e["token_ids"],
                                  block_size=e["block_size"], lora_id=None, medium=vllm.MEDIUM_GPU,
                                  lora_name=e["lora_name"], extra_keys=e["extra_keys"], group_idx=0,
                                  kv_cache_spec_kind="full_attention")
        out += decode_payload(vllm.encode([stored])).events
    return out


def check_of(case: dict, **over) -> HashCheck:
    cfg = {"algo": case["algo"], "hash_seed": case["hash_seed"] or "", "block_size": case["block_size"],
           "lora_modules": (), "int_hashes": True} | over
    return HashCheck("e1", cfg["algo"], cfg["hash_seed"], cfg["block_size"], cfg["lora_modules"], cfg["int_hashes"])


def ids(case: dict) -> str:
    return f"{case['algo']}-seed:{case['hash_seed']}-{case['name']}"


@pytest.mark.parametrize("int_hashes", [True, False], ids=["int", "bytes"])
@pytest.mark.parametrize("case", CASES, ids=ids)
def test_vllms_events_agree_block_for_block(case, int_hashes, caplog):
    check = check_of(case, int_hashes=int_hashes)  # the engine's kv_event_hashes
    with caplog.at_level(logging.WARNING, "quilld.index.hash_check"):
        check.events(decoded(case, int_hashes))
    blocks = len(case["block_hashes"])
    if case["lora"]:  # the adapter's path is in the hash, not in the event
        assert check.view() == {"agreed": 0, "disagreed": 0, "unverifiable": blocks, "state": "checking",
                                "cause": None}
        # ... but in the engine's lora_modules: checked with it, every block
        named = check_of(case, lora_modules=((case["lora"]["name"], case["lora"]["path"]),), int_hashes=int_hashes)
        named.events(decoded(case, int_hashes))
        assert named.view() == {"agreed": blocks, "disagreed": 0, "unverifiable": 0, "state": "checking",
                                "cause": None}
    else:  # every block, the child events' too (their parent agreed just before)
        assert check.view() == {"agreed": blocks, "disagreed": 0, "unverifiable": 0, "state": "checking",
                                "cause": None}
    assert not caplog.records


def test_a_lora_path_other_than_the_engines_is_counted_and_named(caplog):
    case = next(c for c in CASES if c["lora"] and c["algo"] == "sha256" and c["hash_seed"] is None)
    check = check_of(case, lora_modules=((case["lora"]["name"], "/somewhere/else"),))
    assert len(set(run_twice(check, decoded(case), caplog))) == 1
    assert check.view()["agreed"] == 0 and check.view()["disagreed"] > 0
    assert f"LoRA adapter {case['lora']['name']!r}: the path the engine loaded it from" in check.view()["cause"]


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def run_twice(check: HashCheck, events: list, caplog) -> list[str]:
    with caplog.at_level(logging.WARNING, "quilld.index.hash_check"):
        check.events(events)
        check.events(events)
    return warnings(caplog)


def test_a_wrong_seed_is_counted_and_named_once(caplog):
    case = find("four_blocks", "xxhash", "4242")
    check = check_of(case, hash_seed="0")
    logged = run_twice(check, decoded(case), caplog)
    view = check.view()
    # the root events disagree (2 blocks each time); their children cannot be checked (no parent agreed)
    assert (view["agreed"], view["disagreed"], view["unverifiable"]) == (0, 4, 4)
    assert len(logged) == 1 and "hash_seed" in logged[0] and "engine e1" in logged[0]
    assert "PYTHONHASHSEED likely differs" in view["cause"]
    assert "4242" not in logged[0] and "'0'" not in logged[0]  # a seed is a secret


def test_a_wrong_algo_is_counted_and_the_engines_algo_named(caplog):
    case = find("four_blocks", "sha256_cbor", "4242")
    check = check_of(case, algo="sha256")
    logged = run_twice(check, decoded(case), caplog)
    assert check.view()["disagreed"] == 4 and check.view()["agreed"] == 0
    assert len(logged) == 1
    assert check.view()["cause"] == "the engine hashes with sha256_cbor, the config says prefix_caching_hash_algo = sha256"


def test_a_seed_configured_for_an_engine_without_one_is_named(caplog):
    case = find("cache_salt", "sha256", None)
    check = check_of(case, hash_seed="4242")
    run_twice(check, decoded(case), caplog)
    assert check.view()["disagreed"] == 2
    assert check.view()["cause"] == "the engine runs sha256 with PYTHONHASHSEED unset, the config gives a hash_seed"


def test_a_wrong_block_size_is_counted_and_named(caplog):
    case = find("four_blocks", "sha256", "0")
    check = check_of(case, block_size=32)
    logged = run_twice(check, decoded(case), caplog)
    assert check.view()["disagreed"] == 8 and check.view()["agreed"] == 0
    assert len(logged) == 1
    assert check.view()["cause"] == "the events' block_size is 16, the config's 32; with block_size 16 they agree"


def test_xxhash_without_a_seed_cannot_be_checked_and_says_so(caplog):
    case = find("four_blocks", "xxhash", "0")
    with caplog.at_level(logging.WARNING, "quilld.index.hash_check"):
        check = check_of(case, hash_seed="")
        check.events(decoded(case))
    assert check.view() == {"agreed": 0, "disagreed": 0, "unverifiable": 0, "state": "seed_unknown", "cause": None}
    assert len(warnings(caplog)) == 1 and "PYTHONHASHSEED" in warnings(caplog)[0]


def test_a_child_whose_parent_was_never_seen_is_unverifiable():
    case = find("four_blocks", "sha256", None)
    check = check_of(case)
    check.events(decoded(case)[1:])  # the child event only: its parent is 64 bits of a digest
    assert check.view()["unverifiable"] == 2 and check.view()["agreed"] == 0


def chain(hashing: EngineHashing, first_token: int) -> list:
    """One request's events as vLLM sends them: its prompt's 2 blocks, then a decode block with the
    prompt's last block as parent (hashes by engine_hashes.py, which the golden vectors pin)."""
    size = hashing.block_size
    tokens = list(range(first_token, first_token + 3 * size))
    full = hashing.block_hashes(tokens)
    forms = [h.event_form() for h in full]
    return [decode_payload(vllm.encode([vllm.gpu(forms[:2]), vllm.gpu(forms[2:], parent=forms[1])])).events[i]
            ._replace(token_ids=tuple(tokens[i * 2 * size:(i + 1) * 2 * size] if i == 0 else tokens[2 * size:]))
            for i in range(2)]


def test_after_the_first_events_one_chain_in_k_is_checked_with_its_children():
    hashing = EngineHashing("sha256", None, 16)
    check = HashCheck("e1", "sha256", "", 16)
    for i in range(CHECK_FIRST // 2):  # every event checked: the prompts and their decode blocks
        check.events(chain(hashing, 1000 * i))
    assert check.view()["agreed"] == 3 * CHECK_FIRST // 2
    for i in range(4 * SAMPLE_EVERY):  # then one request in SAMPLE_EVERY, with its decode block
        check.events(chain(hashing, 10**6 + 1000 * i))
    assert check.view()["agreed"] == 3 * CHECK_FIRST // 2 + 3 * 4
    assert check.view()["disagreed"] == check.view()["unverifiable"] == 0


def test_known_parents_are_bounded(monkeypatch):
    monkeypatch.setattr(hash_check, "KNOWN", 3)
    hashing = EngineHashing("sha256", None, 16)
    check = HashCheck("e1", "sha256", "", 16)
    for i in range(4):
        check.events(chain(hashing, 1000 * i))
    assert check.view()["agreed"] == 12 and len(check._known) == 3


def decode_chain(hashing: EngineHashing, first_token: int, events: int) -> list:
    """One request of `events` one-block events, each the parent of the next (a prompt's block,
    then decode blocks), as quilld's decoder gives them."""
    size = hashing.block_size
    tokens = list(range(first_token, first_token + events * size))
    forms = [h.event_form() for h in hashing.block_hashes(tokens)]
    stored = [vllm.gpu([f], parent=forms[i - 1] if i else None) for i, f in enumerate(forms)]
    return [ev._replace(token_ids=tuple(tokens[i * size:(i + 1) * size]))
            for i, ev in enumerate(decode_payload(vllm.encode(stored)).events)]


def test_a_chain_is_followed_follow_events_past_the_first_events_and_past_a_sampled_root(monkeypatch):
    monkeypatch.setattr(hash_check, "CHECK_FIRST", 2)
    hashing = EngineHashing("sha256", None, 16)
    check = HashCheck("e1", "sha256", "", 16)
    long = decode_chain(hashing, 0, hash_check.FOLLOW + 10)
    check.events(long[:2])  # the first events: both checked
    check.events(long[2:])  # then FOLLOW more of the same chain, not its end
    assert check.view()["agreed"] == 2 + hash_check.FOLLOW
    for i in range(1, SAMPLE_EVERY - 1):  # roots 2 to SAMPLE_EVERY - 1: not sampled, nor their chains
        check.events(decode_chain(hashing, 10**6 * i, 3))
    assert check.view()["agreed"] == 2 + hash_check.FOLLOW
    check.events(decode_chain(hashing, 10**9, hash_check.FOLLOW + 10))  # the root in SAMPLE_EVERY
    assert check.view()["agreed"] == 2 + hash_check.FOLLOW + 1 + hash_check.FOLLOW
    assert check.view()["disagreed"] == check.view()["unverifiable"] == 0


def test_events_in_the_other_hash_form_than_the_config_says_are_named_once(caplog):
    case = next(c for c in CASES if not c["lora"] and c["algo"] == "sha256" and c["hash_seed"] is None)
    check = check_of(case)  # kv_event_hashes = "int", the default
    said = run_twice(check, decoded(case, int_hashes=False), caplog)
    assert len(said) == 1 and "carry bytes block hashes, its config says kv_event_hashes = 'int'" in said[0]
    assert "set kv_event_hashes = 'bytes'" in check.view()["cause"]
    caplog.clear()
    right = HashCheck("e1", case["algo"], "", case["block_size"], (), int_hashes=False)
    assert run_twice(right, decoded(case, int_hashes=False), caplog) == [] and right.view()["cause"] is None
