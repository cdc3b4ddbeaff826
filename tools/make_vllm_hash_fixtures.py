"""Golden vectors of vLLM's prefix-cache block hashes, made by vLLM's own functions.

    /work/vllm-venv/bin/python tools/make_vllm_hash_fixtures.py [--out tests/fixtures/vllm_block_hashes.json]

Run it with a Python that has vLLM 0.33 installed (a private venv, never the project's:
`python3 -m venv V && V/bin/pip install torch && V/bin/pip install --no-deps vllm==0.33.0`,
then what its imports name). quilld does not import vLLM: tests/unit/test_engine_hashes.py
checks quilld/index/engine_hashes.py against the JSON this writes.

For each case (token ids, block size, LoRA adapter, cache_salt) and each of vLLM's four
`prefix_caching_hash_algo`s, with PYTHONHASHSEED unset and set, it builds a real
`vllm.v1.request.Request` with `get_request_block_hasher` (the engine core's hasher), reads
`request.block_hashes`, then caches the request's full blocks in a real `BlockPool` with KV
events on, in two steps (so the second event has a parent), and records the `BlockStored`
events it queued, once with int hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default)
and once with bytes. Where vLLM draws a random NONE_HASH seed (the xxhash algos with
PYTHONHASHSEED unset) it records only that two draws differ.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

try:  # vLLM's own environment only: --help answers anywhere (tests/unit/test_tools.py)
    import vllm
    from vllm.distributed.kv_events import BlockStored
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.request import Request
except ImportError as e:
    MISSING: ImportError | None = e
else:
    MISSING = None

ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
SEEDS = (None, "0", "4242")  # PYTHONHASHSEED unset, and two values Python itself accepts
OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "vllm_block_hashes.json"


def tokens(n: int, start: int = 0) -> list[int]:
    """n token ids that cross pickle's and CBOR's integer widths (1, 2 and 4 bytes)."""
    widths = (0, 7, 255, 256, 1000, 65535, 65536, 151643, 200000)
    return [widths[(start + i) % len(widths)] + i for i in range(n)]


def lora(spec: str, int_id: int) -> LoRARequest:
    """A LoRA request as vLLM's server builds it from `--lora-modules name=path` (two parsed strings)."""
    name, _, path = spec.partition("=")
    return LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=path)


# (name, token ids, block size, LoRA "name=path" or None, cache_salt or None)
CASES = [
    ("shorter_than_a_block", tokens(5), 16, None, None),
    ("one_block_exactly", tokens(16), 16, None, None),
    ("partial_last_block", tokens(37), 16, None, None),
    ("four_blocks", tokens(64, 3), 16, None, None),
    ("block_size_32_partial", tokens(100, 5), 32, None, None),
    ("block_size_1", tokens(4, 1), 1, None, None),
    ("lora", tokens(40), 16, "sql-adapter=/models/loras/sql", None),
    ("lora_name_equals_path", tokens(33), 16, "adapter-x=adapter-x", None),
    ("cache_salt", tokens(40), 16, None, "tenant-a"),
    ("cache_salt_empty_is_none", tokens(40), 16, None, ""),
    ("lora_and_cache_salt", tokens(50, 2), 16, "sql-adapter=/models/loras/sql", "tenant-b"),
    ("wide_token_ids", [2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 40] * 4 + [1, 2, 3], 8, None, None),
]


def set_seed(seed: str | None) -> None:
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed


def request_of(name: str, token_ids: list[int], block_size: int, hash_fn, lora_spec: str | None,
               salt: str | None) -> Request:
    return Request(request_id=name, prompt_token_ids=list(token_ids), sampling_params=SamplingParams(max_tokens=1),
                   pooling_params=None, lora_request=lora(lora_spec, 1) if lora_spec else None, cache_salt=salt,
                   block_hasher=kv_cache_utils.get_request_block_hasher(block_size, hash_fn))


def stored_events(request: Request, block_size: int, int_hashes: bool) -> list[dict]:
    """The BlockStored events a BlockPool queues for the request's full blocks, cached in two steps."""
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if int_hashes else "0"
    n = len(request.block_hashes)
    pool = BlockPool(num_gpu_blocks=n + 2, enable_caching=True, hash_block_size=block_size,
                     enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(n)
    half = n // 2
    for done, upto in ((0, half), (half, n)):
        if upto > done:
            pool.cache_full_blocks(request, blocks, done, upto, block_size, 0)
    out = []
    for e in pool.take_events():
        assert isinstance(e, BlockStored)
        out.append({"block_hashes": [wire(h) for h in e.block_hashes], "parent_block_hash": wire(e.parent_block_hash),
                    "token_ids": e.token_ids, "block_size": e.block_size, "lora_name": e.lora_name,
                    "extra_keys": e.extra_keys})
    return out


def wire(h: int | bytes | None) -> int | str | None:
    """An event's hash in JSON: an int as is, bytes as hex."""
    return h.hex() if isinstance(h, bytes) else h


def layout(doc: dict) -> str:
    """The JSON with one line per list item (a case, a seed), so a regenerated file diffs by case."""
    lines = []
    for key, value in doc.items():
        if isinstance(value, list):
            items = ",\n".join("  " + json.dumps(v) for v in value)
            lines.append(f" {json.dumps(key)}: [\n{items}\n ]" if value else f" {json.dumps(key)}: []")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    if MISSING is not None:
        sys.exit(f"vLLM is not importable here ({MISSING}): run this with the Python of a venv that has "
                 "vllm==0.33.* (see the docstring)")
    assert vllm.__version__.startswith("0.33."), vllm.__version__
    doc: dict = {
        "vllm_version": vllm.__version__, "python": platform.python_version(),
        "generated_by": "tools/make_vllm_hash_fixtures.py (vLLM's own functions; see its docstring)",
        "default_none_hash_seed": kv_cache_utils.DEFAULT_NONE_HASH_SEED,
        "none_hashes": [], "random_seed": [], "cases": [],
    }
    for algo in ALGOS:
        hash_fn = get_hash_fn_by_name(algo)
        for seed in SEEDS:
            set_seed(seed)
            kv_cache_utils.init_none_hash(hash_fn)
            first = kv_cache_utils.NONE_HASH
            kv_cache_utils.init_none_hash(hash_fn)
            if first != kv_cache_utils.NONE_HASH:  # a fresh random seed per init: nothing to reproduce
                doc["random_seed"].append({"algo": algo, "hash_seed": seed})
                continue
            doc["none_hashes"].append({"algo": algo, "hash_seed": seed, "none_hash": first.hex(),
                                       "seed_used": kv_cache_utils.get_none_hash_seed()})
            for name, token_ids, block_size, lora_spec, salt in CASES:
                request = request_of(name, token_ids, block_size, hash_fn, lora_spec, salt)
                hashes = list(request.block_hashes)
                case = {"name": name, "algo": algo, "hash_seed": seed, "block_size": block_size,
                        "token_ids": token_ids, "cache_salt": salt,
                        "lora": None if lora_spec is None else dict(zip(("name", "path"), lora_spec.split("=", 1))),
                        "block_hashes": [h.hex() for h in hashes],
                        "events_int": stored_events(request, block_size, True),
                        "events_bytes": stored_events(request, block_size, False)}
                doc["cases"].append(case)
    set_seed(None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(layout(doc))
    print(f"{args.out}: {len(doc['cases'])} cases, {len(doc['none_hashes'])} seeds reproducible, "
          f"{len(doc['random_seed'])} random ({sys.executable})")


if __name__ == "__main__":
    main()
