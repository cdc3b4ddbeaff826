"""ROUTE's cost when quilld hashes the prompt as the model's engines do, against its own chain.

One real quilld, one engine registered with the fixture tokenizer directory
(tests/fixtures/chat_render/llama31) and `prefix_caching_hash_algo`; one client over RESP.
For a chat of each size, side by side in one run, the round-trip time of:

- `ROUTE {"messages": [...]}`: rendered with the model's template, tokenized and hashed
  as vLLM hashes (the token ids of a repeated system prompt or earlier turn are kept,
  index/token_segments.py, as in the gateway);
- `ROUTE {"tokens": [...]}`: the same token ids, hashed as vLLM hashes (`hashing auto`);
- `ROUTE {"tokens": [...], "hashing": "quilld"}`: quilld's own xxhash chain, the peer.

Prints p50 and p99 of each, and each one's p50 as a ratio to the peer's.

    python bench/route_hash_bench.py [--sizes 4096,32768] [--rounds 40] [--algo sha256]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from plot import Panel, add_flag, save  # noqa: E402
from procs import start_quilld, stop_process  # noqa: E402

FAMILY = ROOT / "tests" / "fixtures" / "chat_render" / "llama31"
WORDS = "the engine keeps a prefix cache of blocks, and the router sends each request where its prefix is.".split()


def chat(tokens: int) -> list[dict]:
    text = " ".join(WORDS[i % len(WORDS)] for i in range(int(tokens * 0.57)))  # about 1.75 tokens a word here
    return [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": text}]


def timed(r: redis.Redis, body: str, rounds: int) -> list[float]:
    r.execute_command("ROUTE", body)  # the first: the tokenizer, the template and the segments loaded
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        r.execute_command("ROUTE", body)
        out.append(time.perf_counter() - t0)
    return sorted(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4096,32768", help="chat sizes in tokens, comma-separated")
    p.add_argument("--rounds", type=int, default=40, help="ROUTEs of each kind and size")
    p.add_argument("--algo", default="sha256", choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"))
    add_flag(p)
    args = p.parse_args()
    from quilld.index import chat_render  # the gateway extra (jinja2, tokenizers)

    tok = chat_render.load(str(FAMILY))
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "quilld.toml"
        seed = "" if args.algo.startswith("sha256") else 'hash_seed = "7"\n'
        conf.write_text(f'[[engines]]\nid = "e1"\nurl = "http://127.0.0.1:9"\nmodel = "m"\ntokenizer = "{FAMILY}"\n'
                        f'prefix_caching_hash_algo = "{args.algo}"\nblock_size = 16\n{seed}')
        q = start_quilld(Path(tmp), "--config", str(conf), "--dram", "64MiB", admin=False)
        try:
            r = redis.Redis(port=q.port, single_connection_client=True)
            r.execute_command("SCOPE", "m", "")
            print(f"{'tokens':>7} {'request':<28} {'p50 ms':>8} {'p99 ms':>8} {'p50 vs quilld chain':>20}")
            rows: dict[int, dict[str, float]] = {}
            for size in (int(s) for s in args.sizes.split(",")):
                msgs = chat(size)
                ids = tok.chat_token_ids(msgs)
                kinds = {"messages, engine hashing": {"messages": msgs}, "tokens, engine hashing": {"tokens": ids},
                         "tokens, quilld chain": {"tokens": ids, "hashing": "quilld"}}
                got = {k: timed(r, json.dumps(v), args.rounds) for k, v in kinds.items()}
                chain = got["tokens, quilld chain"]
                peer = chain[len(chain) // 2]
                rows[len(ids)] = {kind: ts[len(ts) // 2] * 1e3 for kind, ts in got.items()}
                for kind, ts in got.items():
                    p50, p99 = ts[len(ts) // 2], ts[min(len(ts) - 1, int(len(ts) * 0.99))]
                    print(f"{len(ids):7d} {kind:<28} {p50 * 1e3:8.2f} {p99 * 1e3:8.2f} {p50 / peer:19.2f}x")
            r.close()
        finally:
            stop_process(q.proc)
    if args.plot:
        plot(args.plot, rows, args.algo)


def plot(path: str, rows: dict[int, dict[str, float]], algo: str) -> None:
    """One panel: each request kind's p50 per chat size, labelled with its ratio to quilld's chain."""
    kinds = list(next(iter(rows.values())))
    cats = [f"{n} tokens, {k}" for n in rows for k in kinds]
    values = [rows[n][k] for n in rows for k in kinds]
    labels = [f"{rows[n][k] / rows[n]['tokens, quilld chain']:.2f}x" for n in rows for k in kinds]
    save(path, [Panel("ROUTE round trip, p50", cats, {"ms": values}, "ms", labels)],
         f"ROUTE hashing a prompt as the engines do ({algo}) against quilld's chain")


if __name__ == "__main__":
    main()
