"""The gateway's added time to first token for long chat prompts: engine block hashes vs character chunks.

Starts two fake OpenAI-compatible engines (tests/fake_engine.py, no delays: the figure is the
gateway's own time) and one quilld with its gateway in front of them, on free loopback ports:

- `tok`: an engine of the family that names a Hugging Face tokenizer directory and vLLM's
  prefix-cache hashing (`tokenizer` = tests/fixtures/chat_render/llama31, a small BPE trained by
  tools/make_chat_render_fixtures.py with Llama 3.1's published chat template;
  `prefix_caching_hash_algo = "sha256"`, `block_size = 16`): the gateway renders each chat with
  the template, tokenizes it and hashes its blocks as vLLM does (quilld/index/engine_prompts.py),
  off the event loop;
- `chars`: an engine with no tokenizer: the gateway hashes 256-character chunks of the
  rendered prompt (quilld/http/prompt_blocks.py), today's default.

For each prompt size (`--tokens`, default 4096 and 32768 tokens of the chat as rendered for
`tok`; the same text goes to `chars`), one streaming chat request at a time, rotating among
straight to the engine, through the gateway to `chars` and through the gateway to `tok`, timed
from sending the request to the first SSE chunk read. Each request has a long system prompt
(the same for all) and a new short question. Printed: p50/p99 of each path and what the
gateway adds over straight to the engine at p50 and p99.

Also, per size, the loop check: while one long `tok` request after another is in flight, a
second client sends small `chars` chats; their TTFT against the same small chats with no long
request beside them shows whether the long prompt's rendering and hashing hold the gateway's
event loop (they run in a thread, which still takes the GIL in turns).

    python bench/gateway_ttft_bench.py                     # ~1 min
    python bench/gateway_ttft_bench.py --requests 100 --tokens 32768
    python bench/gateway_ttft_bench.py --tree /tmp/old     # the gateway of another source tree
    python bench/gateway_ttft_bench.py --plot ttft.png     # also the figure (the `bench` extra)

The prompts share their system prompt, so from the second request on the gateway finds its
pieces' token ids kept (quilld/index/token_segments.py): the figure is that of a shared system
prompt or a conversation's earlier turns, not of a chat never seen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from procs import free_port, stop_process as stop, wait_port  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from plot import Panel, add_flag, save  # noqa: E402

FAMILY = ROOT / "tests" / "fixtures" / "chat_render" / "llama31"
HEADERS = {"Content-Type": "application/json"}
WORDS = ("block cache tier engine prefill decode token route residency pool node gossip segment arena lease "
         "pin evict fetch replica shard scope tenant adapter prompt template hash chain parent event batch "
         "stream latency throughput quilld vLLM attention layer head sequence window budget").split()


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))]


def document(words: int, rng: random.Random) -> str:
    """Prose-like text: sentences of the glossary's words, with numbers and punctuation."""
    out, n = [], 0
    while n < words:
        k = rng.randrange(6, 18)
        out.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + f" ({rng.randrange(10**4)}).")
        n += k
    return " ".join(out)


def messages(system: str, i: int) -> list[dict]:
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"Question number {i}: which tier holds block {i * 7919 % 10007}?"}]


def system_prompt(tokens: int) -> tuple[str, int]:
    """A system prompt whose chat, as `tok` renders it, has about `tokens` token ids (and that count)."""
    from quilld.index import chat_render

    tok = chat_render.load(str(FAMILY))
    words = tokens // 4
    for _ in range(8):  # scale the word count to the token count the family's tokenizer gives
        text = document(words, random.Random(tokens))
        n = len(tok.chat_token_ids(messages(text, 0)))
        if abs(n - tokens) <= tokens // 100:
            break
        words = max(1, round(words * tokens / n))
    return text, n


def body(model: str, system: str, i: int, stream: bool = True) -> bytes:
    return json.dumps({"model": model, "stream": stream, "max_tokens": 16, "messages": messages(system, i)}).encode()


async def ttft(session: aiohttp.ClientSession, url: str, data: bytes) -> float:
    """Milliseconds from sending the request to its first body chunk; the rest is read too."""
    t0 = time.perf_counter()
    async with session.post(url, data=data, headers=HEADERS) as resp:
        assert resp.status == 200, (resp.status, await resp.text())
        first = await resp.content.readany()
        t = time.perf_counter() - t0
        assert first.startswith(b"data: "), first[:200]
        await resp.read()
    return t * 1000


async def sizes(urls: dict[str, tuple[str, str]], args: argparse.Namespace) -> dict[int, dict[str, tuple]]:
    """`urls`: path name -> (URL, model). Returns tokens -> path name -> (p50, p99) in ms."""
    results: dict[int, dict[str, tuple[float, float]]] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        small = "You are a careful assistant. " * 8
        for i in range(50):  # warm the pools, the family's tokenizer and template
            for url, model in urls.values():
                await ttft(session, url, body(model, small, i))
        for tokens in args.tokens:
            system, n = system_prompt(tokens)
            print(f"\n{n:,} tokens a chat as `tok` renders it ({len(system):,} characters of system prompt), "
                  f"{args.requests} sequential streaming requests per path, TTFT in ms:")
            times: dict[str, list[float]] = {name: [] for name in urls}
            paths = list(urls.items())
            for i in range(args.requests + 10):
                for name, (url, model) in paths[i % len(paths):] + paths[:i % len(paths)]:
                    t = await ttft(session, url, body(model, system, i))
                    if i >= 10:  # the first rounds warm the new size's buffers
                        times[name].append(t)
            print(f"  {'':28} {'p50':>8} {'p99':>8} {'added p50':>10} {'added p99':>10}")
            d50, d99 = pct(times["direct"], 50), pct(times["direct"], 99)
            for name in urls:
                p50, p99 = pct(times[name], 50), pct(times[name], 99)
                added = "" if name == "direct" else f"{p50 - d50:10.3f} {p99 - d99:10.3f}"
                print(f"  {name:28} {p50:8.3f} {p99:8.3f} {added}")
            results[n] = {name: (pct(times[name], 50), pct(times[name], 99)) for name in urls}
            await loop_check(session, urls, system, max(20, args.requests // 2))
    return results


def plot(path: str, results: dict[int, dict[str, tuple[float, float]]], requests: int) -> None:
    """One panel per prompt size: p50 and p99 TTFT of each path; over each gateway path, what it
    adds to straight-to-the-engine at p50."""
    panels = []
    for tokens, paths in results.items():
        names = list(paths)
        direct = paths["direct"][0]
        panels.append(Panel(f"{tokens:,} tokens", names, {"p50": [paths[n][0] for n in names],
                                                          "p99": [paths[n][1] for n in names]}, "TTFT (ms)",
                            ["" if n == "direct" else f"+{paths[n][0] - direct:.1f} ms" for n in names]))
    save(path, panels, "Gateway time to first token, long chat prompts",
         f"{requests} sequential streaming requests per path and size; fake engines with no delay, so the "
         "gap to 'direct' is the gateway's own time")


async def loop_check(session: aiohttp.ClientSession, urls: dict[str, tuple[str, str]], system: str,
                     longs: int) -> None:
    """Small chats' TTFT alone, then back to back for as long as `longs` long `tok` requests run one
    after another beside them."""
    small = "You are a careful assistant. " * 8
    url, model = urls["gateway, chars (no tokenizer)"]
    long_url, long_model = urls["gateway, tok (engine hashes)"]
    alone = [await ttft(session, url, body(model, small, i)) for i in range(200)]
    running = True

    async def long_loop() -> None:
        nonlocal running
        for i in range(longs):
            await ttft(session, long_url, body(long_model, system, i))
        running = False

    task = asyncio.create_task(long_loop())
    beside = []
    while running:
        beside.append(await ttft(session, url, body(model, small, len(beside))))
    await task
    print(f"  loop check, small chats through the gateway: {len(alone)} alone p50 {pct(alone, 50):.3f} p99 "
          f"{pct(alone, 99):.3f} max {max(alone):.3f} ms; {len(beside)} beside {longs} long `tok` requests p50 "
          f"{pct(beside, 50):.3f} p99 {pct(beside, 99):.3f} max {max(beside):.3f} ms")


def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=200, help="sequential TTFT requests per path and size")
    p.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 32768],
                   help="prompt sizes in tokens, comma-separated")
    p.add_argument("--tree", type=Path, default=ROOT, help="run the quilld of this source tree (default: this "
                   "one), for old-against-new runs")
    add_flag(p)
    args = p.parse_args()
    _install_uvloop()
    tok_port, chars_port, gw_port, port, admin = (free_port() for _ in range(5))
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")}
    env["PYTHONPATH"] = str(args.tree.resolve())
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "bench.toml"
        conf.write_text(f'[[engines]]\nid = "tok"\nurl = "http://127.0.0.1:{tok_port}"\nmodel = "tok-model"\n'
                        f'tokenizer = "{FAMILY}"\nprefix_caching_hash_algo = "sha256"\nblock_size = 16\n\n'
                        f'[[engines]]\nid = "chars"\nurl = "http://127.0.0.1:{chars_port}"\nmodel = "chars-model"\n')
        try:
            for name, eport in (("tok", tok_port), ("chars", chars_port)):
                procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "fake_engine.py"), "--port",
                                               str(eport), "--model", f"{name}-model", "--name", name], env=env))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "quilld", "--bind", "127.0.0.1", "--port", str(port), "--admin-port",
                 str(admin), "--gateway-port", str(gw_port), "--dram", "64MiB", "--config", str(conf),
                 "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL, cwd=args.tree.resolve()))
            for port_, proc in zip((tok_port, chars_port, gw_port), procs):
                wait_port(port_, proc)
            path = "/v1/chat/completions"
            urls = {"direct": (f"http://127.0.0.1:{tok_port}{path}", "tok-model"),
                    "gateway, chars (no tokenizer)": (f"http://127.0.0.1:{gw_port}{path}", "chars-model"),
                    "gateway, tok (engine hashes)": (f"http://127.0.0.1:{gw_port}{path}", "tok-model")}
            print(f"load average {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f} on {os.cpu_count()} cores")
            results = asyncio.run(sizes(urls, args))
            if args.plot:
                plot(args.plot, results, args.requests)
        finally:
            for proc in procs:
                stop(proc)


if __name__ == "__main__":
    main()
