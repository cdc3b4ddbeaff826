"""Disaggregated prefill and decode through quilld, DistServe-style: goodput at increasing request rates.

Four fake engines behind quilld's gateway, three ways, each on the same workload:

  (a) aggregated: 4 engines of role `both`, routed as without roles (the router's cost);
  (b) always:     2 `prefill` + 2 `decode` engines, `router.disaggregation = "always"`;
  (c) auto:       the same 4 engines, the per-request decision (`"auto"`, index/pairing.py).

Workload: Poisson arrivals at each rate for `--seconds`; `/v1/completions` with token-id
prompts, streamed. Each prompt opens with one of 8 shared 1024-token prefixes (a system
prompt), then a suffix of its own: 30% are long (1500-2500 more tokens), 70% short
(50-250 more); each generates 16-48 tokens. The same requests, in the same order and at
the same times, for every setup at a given rate.

Engine timing model (one scheduler per engine, like vLLM's without chunked prefill):

- prefill: PREFILL_MS_PER_TOKEN (0.15 ms) per prompt token the engine does not already hold,
  its prefix cache being the leading 64-token blocks of prompts it prefilled or loaded
  (LRU, 8192 blocks); prefills run one at a time, first come first served;
- decode: one step emits one token to every running decode and takes DECODE_STEP_MS
  (20 ms) + DECODE_MS_PER_RUNNING (0.5 ms) x the running decodes;
- a prefill runs before any decode step, and every running decode of that engine waits for
  it: on an aggregated engine a long prefill stalls its decodes (DistServe's interference);
- a disaggregated prefill writes the KV of every block of the prompt into quilld (index/
  handoff.py's keys, PUT2PHASE ... HASH, `--block-bytes` each) and answers one token with
  kv_transfer_params; its decode engine reads every block back (GETBLK, pipelined), and
  prefills itself only what it could not load (and the prompt's last partial block).
  Loading costs only the real reads' time.

quilld is told this model's prices (`router.prefill_us_per_token` = 150,
`router.running_decode_penalty_us` = 500) and its defaults otherwise.

Goodput: the share of requests sent whose time to first token was within `--ttft-slo-ms`
(1000) and whose time per output token after it (mean) within `--tpot-slo-ms` (50). For
each setup: the highest rate keeping 90% goodput (linear between the measured rates). The
handoff's cost: KV bytes written by prefills and read by decodes, and the gateway's
handoff wait p50/p99 (its histogram), per setup at each rate.

Processes: this one (the clients), quilld (with its gateway), and one process running the
four engines, started afresh for each setup and rate, on free loopback ports.

    python bench/disagg_bench.py                          # ~4 min: rates 5 10 ... 30, 10 s each
    python bench/disagg_bench.py --rates 6 12 --seconds 8
    python bench/disagg_bench.py --plot disagg.png       # also the figure (the `bench` extra)
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
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import crc32c
import redis.asyncio as aioredis
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from procs import free_port, stop_process, wait_port  # noqa: E402
from plot import COLORS, Panel, add_flag, ratio, save  # noqa: E402

from quilld.index.control import chain_hashes  # noqa: E402
from quilld.index.handoff import kv_key  # noqa: E402

PREFILL_MS_PER_TOKEN = 0.15
DECODE_STEP_MS = 20.0
DECODE_MS_PER_RUNNING = 0.5
BLOCK_TOKENS = 64
CACHE_BLOCKS = 8192
MODEL = "bench-model"
PREFIXES, PREFIX_TOKENS = 8, 1024
SETUPS = {"aggregated": ("both", "both", "both", "both"), "always": ("prefill", "prefill", "decode", "decode"),
          "auto": ("prefill", "prefill", "decode", "decode")}


# -- the engines (a child process) ------------------------------------------------------------
class Job:
    __slots__ = ("tokens", "done")

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.done = asyncio.get_running_loop().create_future()


class SimEngine:
    """One fake engine following the timing model above, with its KV going through quilld."""

    def __init__(self, name: str, quilld_port: int, block_bytes: int) -> None:
        self.name = name
        self.block_bytes = block_bytes
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.prefills: list[Job] = []
        self.decodes: set[asyncio.Queue] = set()
        self.wake = asyncio.Event()
        # the scope in the user name: every pooled connection logs in to it (README "Identity scopes from a URL")
        self.kv = aioredis.Redis(port=quilld_port, username=f"default~{MODEL}~bench", password="unused")
        self.stats = {"prefills": 0, "decodes": 0, "aggregated": 0, "kv_bytes_written": 0, "kv_bytes_read": 0,
                      "blocks_loaded": 0, "blocks_missing": 0}

    async def run(self) -> None:
        while True:
            if self.prefills:
                job = self.prefills.pop(0)
                await asyncio.sleep(job.tokens * PREFILL_MS_PER_TOKEN / 1000)
                job.done.set_result(None)
            elif self.decodes:
                await asyncio.sleep((DECODE_STEP_MS + DECODE_MS_PER_RUNNING * len(self.decodes)) / 1000)
                for q in list(self.decodes):
                    q.put_nowait(1)
            else:
                self.wake.clear()
                await self.wake.wait()

    async def prefill(self, tokens: int) -> None:
        if tokens <= 0:
            return
        job = Job(tokens)
        self.prefills.append(job)
        self.wake.set()
        await job.done

    def uncached(self, ids: list[int], hashes: list[int]) -> int:
        held = 0
        for h in hashes:
            if h not in self.cache:
                break
            held += 1
        return len(ids) - held * BLOCK_TOKENS

    def remember(self, hashes: list[int]) -> None:
        for h in hashes:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > CACHE_BLOCKS:
            self.cache.popitem(last=False)

    def payload(self, h: int) -> bytes:
        return h.to_bytes(8, "big") * (self.block_bytes // 8)

    async def write_kv(self, hashes: list[int]) -> None:
        pipe = self.kv.pipeline(transaction=False)
        for h in hashes:
            pipe.execute_command("PUT2PHASE", "BEGIN", kv_key(h), self.block_bytes, "HASH", h)
        handles = await pipe.execute()
        pipe = self.kv.pipeline(transaction=False)
        for h, handle in zip(hashes, handles):
            if handle != b"EXISTS":
                data = self.payload(h)
                pipe.execute_command("PUT2PHASE", "DATA", handle, 0, data, "CRC32C", crc32c.crc32c(data))
                self.stats["kv_bytes_written"] += len(data)
        await pipe.execute()

    async def read_kv(self, hashes: list[int]) -> int:
        """Load the prompt's KV from quilld: the leading blocks it could read."""
        pipe = self.kv.pipeline(transaction=False)
        for h in hashes:
            pipe.execute_command("GETBLK", kv_key(h))
        loaded = 0
        for value in await pipe.execute():
            if value is None:
                break
            self.stats["kv_bytes_read"] += len(value)
            loaded += 1
        self.stats["blocks_loaded"] += loaded
        self.stats["blocks_missing"] += len(hashes) - loaded
        return loaded

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        ids = body["prompt"]
        hashes = chain_hashes(ids, BLOCK_TOKENS)
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):  # a prefill: compute, store the KV, answer one token
            self.stats["prefills"] += 1
            await self.prefill(self.uncached(ids, hashes))
            self.remember(hashes)
            await self.write_kv(hashes)
            return web.json_response({"id": "p", "object": "text_completion", "model": MODEL, "choices": [
                {"index": 0, "text": "x", "finish_reason": "length"}],
                "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                       "remote_engine_id": self.name, "remote_block_ids": list(range(len(hashes)))}})
        if params.get("do_remote_prefill"):
            self.stats["decodes"] += 1
            loaded = await self.read_kv(hashes)
            await self.prefill(len(ids) - loaded * BLOCK_TOKENS)
        else:
            self.stats["aggregated"] += 1
            await self.prefill(self.uncached(ids, hashes))
        self.remember(hashes)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        q: asyncio.Queue = asyncio.Queue()
        event = b'data: {"object":"text_completion","model":"' + MODEL.encode() + \
            b'","choices":[{"index":0,"text":"t","finish_reason":null}]}\n\n'
        await resp.write(event)  # the first token comes with the prefill
        self.decodes.add(q)
        self.wake.set()
        try:
            for _ in range(int(body.get("max_tokens", 16)) - 1):
                await q.get()
                await resp.write(event)
        finally:
            self.decodes.discard(q)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def engine_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats)


async def serve_engines(spec: dict) -> None:
    runners = []
    for name, port in spec["engines"].items():
        engine = SimEngine(name, spec["quilld_port"], spec["block_bytes"])
        app = web.Application()
        app.router.add_post("/v1/completions", engine.completion)
        app.router.add_get("/stats", engine.engine_stats)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        asyncio.ensure_future(engine.run())
    await asyncio.Event().wait()


# -- the workload and the clients ---------------------------------------------------------------
@dataclass
class Request:
    at: float  # seconds after the start
    prompt: list[int]
    max_tokens: int


@dataclass
class Outcome:
    ok: bool = False
    ttft: float = float("inf")
    tpot: float = float("inf")
    disaggregated: bool = False


def workload(rate: float, seconds: float, seed: int) -> list[Request]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 50_000) for _ in range(PREFIX_TOKENS)] for _ in range(PREFIXES)]
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        long = rng.random() < 0.3
        suffix = rng.randint(1500, 2500) if long else rng.randint(50, 250)
        prompt = prefixes[rng.randrange(PREFIXES)] + [rng.randrange(1, 50_000) for _ in range(suffix)]
        out.append(Request(t, prompt, rng.randint(16, 48)))


async def one(session: aiohttp.ClientSession, url: str, req: Request, t0: float) -> Outcome:
    await asyncio.sleep(max(0.0, t0 + req.at - time.perf_counter()))
    start = time.perf_counter()
    out = Outcome()
    try:
        async with session.post(url, json={"model": MODEL, "prompt": req.prompt, "max_tokens": req.max_tokens,
                                           "stream": True}) as resp:
            if resp.status != 200:
                return out
            out.disaggregated = resp.headers.get("x-quillcache-disaggregated") == "true"
            first = last = None
            tokens = 0
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if event.startswith(b"data: {"):
                        now = time.perf_counter()
                        first = first or now
                        last = now
                        tokens += 1
        if first is None:
            return out
        out.ttft = first - start
        out.tpot = (last - first) / (tokens - 1) if tokens > 1 else 0.0
        out.ok = tokens == req.max_tokens
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
        pass
    return out


@dataclass
class Run:
    setup: str
    rate: float
    outcomes: list[Outcome] = field(default_factory=list)
    gateway: dict = field(default_factory=dict)
    engines: dict = field(default_factory=dict)

    def goodput(self, ttft: float, tpot: float) -> float:
        good = sum(1 for o in self.outcomes if o.ok and o.ttft <= ttft and o.tpot <= tpot)
        return good / max(1, len(self.outcomes))


def _get(port: int, path: str) -> dict:
    async def fetch() -> dict:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}{path}") as r:
            return await r.json()
    return asyncio.run(fetch())


def _post(port: int, path: str, body: dict) -> None:
    async def send() -> None:
        async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}{path}", json=body) as r:
            assert r.status in (200, 201), await r.text()
    asyncio.run(send())


def run_one(setup: str, rate: float, args: argparse.Namespace, tmp: Path) -> Run:
    port, admin, gw = free_port(), free_port(), free_port()
    names = [f"e{i}" for i in range(4)]
    engine_ports = {n: free_port() for n in names}
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")}
    env.update(PYTHONPATH=str(ROOT), QUILLD_ROUTER_PREFILL_US_PER_TOKEN=str(PREFILL_MS_PER_TOKEN * 1000),
               QUILLD_ROUTER_RUNNING_DECODE_PENALTY_US=str(DECODE_MS_PER_RUNNING * 1000),
               QUILLD_ROUTER_DISAGGREGATION="always" if setup == "always" else "auto",
               QUILLD_GATEWAY_TTFT_SLO_MS=str(int(args.ttft_slo_ms)))
    procs = []
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "quilld", "--bind", "127.0.0.1", "--port", str(port),
                                       "--admin-port", str(admin), "--gateway-port", str(gw), "--dram", "512MiB",
                                       "--log-level", "warning"], env=env, cwd=ROOT,
                                      stdout=open(tmp / f"quilld-{setup}-{rate}.log", "wb"), stderr=subprocess.STDOUT))
        try:
            wait_port(gw, procs[0])
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"quilld: {e}\n" + (tmp / f"quilld-{setup}-{rate}.log").read_text()) from None
        spec = json.dumps({"engines": engine_ports, "quilld_port": port, "block_bytes": args.block_bytes})
        procs.append(subprocess.Popen([sys.executable, __file__, "--serve-engines", spec], env=env,
                                      stdout=open(tmp / f"engines-{setup}-{rate}.log", "wb"), stderr=subprocess.STDOUT))
        for p in engine_ports.values():
            wait_port(p, procs[1])
        for name, role in zip(names, SETUPS[setup]):
            _post(admin, "/v1/engines", {"id": name, "url": f"http://127.0.0.1:{engine_ports[name]}", "model": MODEL,
                                         "tokenizer": "bench", "block_size": BLOCK_TOKENS, "role": role})
        requests = workload(rate, args.seconds, args.seed)
        run = Run(setup, rate)

        async def drive() -> None:
            timeout = aiohttp.ClientTimeout(total=60)
            async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
                t0 = time.perf_counter() + 0.2
                url = f"http://127.0.0.1:{gw}/v1/completions"
                run.outcomes = list(await asyncio.gather(*(one(session, url, r, t0) for r in requests)))

        asyncio.run(drive())
        run.gateway = _get(gw, "/v1/quillcache/stats")
        run.engines = {n: _get(p, "/stats") for n, p in engine_ports.items()}
        return run
    finally:
        for proc in procs:
            stop_process(proc)


def rate_at(points: list[tuple[float, float]], target: float = 0.9) -> float:
    """The highest rate keeping `target` goodput: linear between the last rate at or above it and the next."""
    best = 0.0
    for (r0, g0), (r1, g1) in zip(points, points[1:] + [(None, None)]):
        if g0 < target:
            break
        best = r0
        if r1 is not None and g1 < target:
            best = r0 + (r1 - r0) * (g0 - target) / (g0 - g1)
            break
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=float, nargs="+", default=[5, 10, 15, 20, 25, 30], help="requests per second")
    p.add_argument("--seconds", type=float, default=10.0, help="arrivals per rate and setup")
    p.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    p.add_argument("--tpot-slo-ms", type=float, default=50.0)
    p.add_argument("--block-bytes", type=int, default=8192, help="KV bytes of one 64-token block")
    p.add_argument("--seed", type=int, default=21)
    p.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    p.add_argument("--serve-engines", help=argparse.SUPPRESS)
    add_flag(p)
    args = p.parse_args()
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    if args.serve_engines:
        asyncio.run(serve_engines(json.loads(args.serve_engines)))
        return
    ttft, tpot = args.ttft_slo_ms / 1000, args.tpot_slo_ms / 1000
    print(f"4 engines; prefill {PREFILL_MS_PER_TOKEN} ms/token, decode step {DECODE_STEP_MS} ms + "
          f"{DECODE_MS_PER_RUNNING} ms/running decode; SLOs: TTFT {args.ttft_slo_ms:g} ms, TPOT {args.tpot_slo_ms:g} ms; "
          f"{args.seconds:g} s of arrivals per point; load: {os.getloadavg()[0]:.1f}")
    results: dict[str, list[Run]] = {s: [] for s in args.setups}
    with tempfile.TemporaryDirectory() as tmp:
        for rate in args.rates:
            for setup in args.setups:
                run = run_one(setup, rate, args, Path(tmp))
                results[setup].append(run)
                g, eng = run.gateway, run.engines.values()
                ttfts = sorted(o.ttft for o in run.outcomes if o.ok)
                tpots = sorted(o.tpot for o in run.outcomes if o.ok)
                written = sum(e["kv_bytes_written"] for e in eng)
                read = sum(e["kv_bytes_read"] for e in eng)
                split = sum(o.disaggregated for o in run.outcomes)
                print(f"rate {rate:5.1f}/s {setup:10s} goodput {run.goodput(ttft, tpot):6.1%}  "
                      f"TTFT p50 {_ms(ttfts, 0.5)} p99 {_ms(ttfts, 0.99)}  TPOT p50 {_ms(tpots, 0.5)} "
                      f"p99 {_ms(tpots, 0.99)}  disaggregated {split}/{len(run.outcomes)}  "
                      f"KV written {written / 2**20:.1f} MiB read {read / 2**20:.1f} MiB  handoff wait p50 "
                      f"{g.get('gateway_handoff_wait_p50_ms', 0):.2f} ms p99 {g.get('gateway_handoff_wait_p99_ms', 0):.2f} ms"
                      f"  (handoffs late {g.get('gateway_handoff_late', 0)}, missing {g.get('gateway_handoff_missing', 0)})",
                      flush=True)
    print("\nrate sustained at 90% goodput:")
    sustained = {}
    for setup, runs in results.items():
        points = [(r.rate, r.goodput(ttft, tpot)) for r in runs]
        sustained[setup] = rate_at(points)
        beyond = " or more (still at 90% at the highest rate measured)" if points and points[-1][1] >= 0.9 else ""
        print(f"  {setup:10s} {sustained[setup]:5.1f} requests/s{beyond}")
    if "auto" in sustained:
        for other in ("aggregated", "always"):
            if other in sustained and sustained[other]:
                print(f"  auto / {other}: {sustained['auto'] / sustained[other]:.2f}x")
    if args.plot:
        plot(args.plot, {setup: [(r.rate, r.goodput(ttft, tpot)) for r in runs] for setup, runs in results.items()},
             sustained, args)


def plot(path: str, points: dict[str, list[tuple[float, float]]], sustained: dict[str, float],
         args: argparse.Namespace) -> None:
    """Goodput at each rate per setup, and the rate each keeps at 90% (as a multiple of aggregated's)."""
    setups = list(points)
    rates = [f"{r:g}/s" for r, _ in points[setups[0]]]
    base = sustained.get("aggregated") or 0.0
    panels = [Panel("goodput (TTFT and TPOT within their SLOs)", rates,
                    {s: [g * 100 for _, g in points[s]] for s in setups}, "% of requests",
                    bar_colors=list(COLORS[:len(setups)])),
              Panel("rate kept at 90% goodput (vs aggregated)", setups, {"requests/s": [sustained[s] for s in setups]},
                    "requests/s", [ratio(sustained[s], base) if base else "" for s in setups])]
    save(path, panels, "4 engines: aggregated, 2 prefill + 2 decode always disaggregated, and decided per request",
         f"fake engines (bench/disagg_bench.py's timing model); SLOs TTFT {args.ttft_slo_ms:g} ms, TPOT "
         f"{args.tpot_slo_ms:g} ms; {args.seconds:g} s of arrivals per point; 2 shared cores (noisy)")


def _ms(values: list[float], q: float) -> str:
    if not values:
        return "    -"
    return f"{values[min(len(values) - 1, int(q * len(values)))] * 1000:5.0f}"


if __name__ == "__main__":
    main()
