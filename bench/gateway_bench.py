"""The gateway's cost: TTFT and requests/s through quilld's gateway against straight to the engine.

Starts a fake OpenAI-compatible engine (tests/fake_engine.py, no delays) and a
quilld with its gateway in front of it, on free loopback ports, then in the
same run:

- TTFT: one streaming chat request at a time, alternating direct and through
  the gateway, timed from sending the request to the first SSE chunk read;
  p50 and p99 of each and the TTFT the gateway adds at p50 (target <= 1 ms);
- throughput: `--concurrency` clients streaming whole answers for `--seconds`,
  direct and through the gateway alternately, `--rounds` times (median), and
  the ratio gateway / direct.

With `--floor`, the same is also measured through a bare aiohttp pass-through
relay (no parsing, routing or headers: the floor of any aiohttp proxy hop on
this machine), started by this script as a child. A third process taking turns
makes every path a little slower (colder caches), so it is off by default.

The client is aiohttp on uvloop in this process; the three processes share the
machine's cores, so the throughput ratio is that of this machine, not of a
gateway host in front of GPU engines.

    python bench/gateway_bench.py                     # ~40 s
    python bench/gateway_bench.py --floor             # and a bare aiohttp relay beside them
    python bench/gateway_bench.py --requests 300 --seconds 2 --rounds 1
    python bench/gateway_bench.py --plot gateway.png  # also the figure (the `bench` extra)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from procs import free_port, stop_process as stop, wait_port  # noqa: E402
from plot import COLORS, Panel, add_flag, ratio, save  # noqa: E402

SYSTEM = "You are a careful assistant for QuillCache's benchmark. " * 40








def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))]


def body(i: int) -> bytes:
    return json.dumps({"model": "bench-model", "stream": True, "max_tokens": 16,
                       "messages": [{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": f"question number {i}"}]}).encode()


HEADERS = {"Content-Type": "application/json"}
SESSION = web.AppKey("session", aiohttp.ClientSession)


async def ttft(session: aiohttp.ClientSession, url: str, i: int) -> float:
    """Seconds from sending the request to its first body chunk; the rest is read too."""
    t0 = time.perf_counter()
    async with session.post(url, data=body(i), headers=HEADERS) as resp:
        assert resp.status == 200, resp.status
        first = await resp.content.readany()
        t = time.perf_counter() - t0
        assert first.startswith(b"data: ")
        await resp.read()
    return t


async def whole(session: aiohttp.ClientSession, url: str, i: int) -> None:
    async with session.post(url, data=body(i), headers=HEADERS) as resp:
        assert resp.status == 200, resp.status
        data = await resp.read()
        assert data.endswith(b"data: [DONE]\n\n")


async def throughput(session: aiohttp.ClientSession, url: str, concurrency: int, seconds: float) -> float:
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        nonlocal done
        i = w
        while time.perf_counter() < deadline:
            await whole(session, url, i)
            done += 1
            i += concurrency

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return done / (time.perf_counter() - t0)


async def measure(urls: dict[str, str], args: argparse.Namespace) -> None:
    """`urls`: path name -> URL (direct, gateway, and the bare relay)."""
    paths = list(urls.items())
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for i in range(200):  # warm every path, its pools and quilld's routing state
            for _, url in paths:
                await whole(session, url, i)
        times: dict[str, list[float]] = {name: [] for name in urls}
        for i in range(args.requests):
            for name, url in paths[i % len(paths):] + paths[:i % len(paths)]:  # rotate the order
                times[name].append(await ttft(session, url, i) * 1000)
        rates: dict[str, list[float]] = {name: [] for name in urls}
        for r in range(args.rounds):
            for name, url in paths[r % len(paths):] + paths[:r % len(paths)]:
                rates[name].append(await throughput(session, url, args.concurrency, args.seconds))

    print(f"TTFT over {args.requests} sequential streaming requests each (ms):")
    print(f"  {'':10} {'p50':>8} {'p99':>8}")
    for name in urls:
        print(f"  {name:10} {pct(times[name], 50):8.3f} {pct(times[name], 99):8.3f}")
    added = pct(times["gateway"], 50) - pct(times["direct"], 50)
    print(f"  added by the gateway at p50: {added:.3f} ms (target <= 1 ms)")
    if "bare relay" in urls:
        floor = pct(times["bare relay"], 50) - pct(times["direct"], 50)
        print(f"  added by a bare aiohttp relay at p50: {floor:.3f} ms; the gateway's own work: {added - floor:.3f} ms")
    print(f"throughput, {args.concurrency} concurrent streams, median of {args.rounds} x {args.seconds:g} s:")
    for name in urls:
        print(f"  {name:10} {statistics.median(rates[name]):8.0f} req/s")
    d, g = statistics.median(rates["direct"]), statistics.median(rates["gateway"])
    print(f"  ratio gateway/direct: {g / d:.2f}")
    if args.plot:
        plot(args.plot, times, rates, args)


def plot(path: str, times: dict[str, list[float]], rates: dict[str, list[float]], args: argparse.Namespace) -> None:
    names = list(times)
    d = statistics.median(rates["direct"])
    panels = [Panel("time to first token, sequential streaming requests", names,
                    {"p50": [pct(times[n], 50) for n in names], "p99": [pct(times[n], 99) for n in names]}, "ms",
                    bar_colors=[COLORS[1], COLORS[3]]),
              Panel(f"throughput, {args.concurrency} concurrent streams (vs direct)", names,
                    {"req/s": [statistics.median(rates[n]) for n in names]}, "requests/s (median)",
                    [ratio(statistics.median(rates[n]), d) for n in names])]
    save(path, panels, "quilld's OpenAI-compatible gateway in front of one engine vs straight to it",
         f"tests/fake_engine.py with no delay; {os.cpu_count()} cores shared by the client, quilld, the engine and "
         f"other work (noisy); {args.requests} requests per path, {args.rounds} x {args.seconds:g} s throughput runs")


def relay_child(port: int, upstream: str) -> None:
    """A bare aiohttp pass-through relay: the floor of one proxy hop."""

    async def relay(request: web.Request) -> web.StreamResponse:
        up = await request.app[SESSION].post(upstream + request.path, data=await request.read(), headers=HEADERS)
        resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers["Content-Type"]})
        await resp.prepare(request)
        while chunk := await up.content.readany():
            await resp.write(chunk)
        await resp.write_eof()
        up.release()
        return resp

    async def session_ctx(app: web.Application):
        app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        yield
        await app[SESSION].close()

    app = web.Application()
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/chat/completions", relay)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)



def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000, help="sequential TTFT requests per path")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seconds", type=float, default=5.0, help="length of one throughput run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--floor", action="store_true", help="also measure a bare aiohttp relay")
    p.add_argument("--relay-child", nargs=2, metavar=("PORT", "UPSTREAM"), help=argparse.SUPPRESS)
    add_flag(p)
    args = p.parse_args()
    _install_uvloop()
    if args.relay_child:
        relay_child(int(args.relay_child[0]), args.relay_child[1])
        return

    engine_port, gw_port, port, admin, relay_port = (free_port() for _ in range(5))
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")}
    env["PYTHONPATH"] = str(ROOT)
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "bench.toml"
        conf.write_text(f'[[engines]]\nid = "e1"\nurl = "http://127.0.0.1:{engine_port}"\nmodel = "bench-model"\n')
        try:
            procs.append(subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "fake_engine.py"), "--port", str(engine_port), "--model",
                 "bench-model", "--name", "e1"], env=env))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "quilld", "--bind", "127.0.0.1", "--port", str(port), "--admin-port",
                 str(admin), "--gateway-port", str(gw_port), "--dram", "64MiB", "--config", str(conf),
                 "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL))
            if args.floor:
                procs.append(subprocess.Popen([sys.executable, __file__, "--relay-child", str(relay_port),
                                               f"http://127.0.0.1:{engine_port}"], env=env))
            for port_, proc in zip((engine_port, gw_port, relay_port), procs):
                wait_port(port_, proc)
            path = "/v1/chat/completions"
            urls = {"direct": f"http://127.0.0.1:{engine_port}{path}", "gateway": f"http://127.0.0.1:{gw_port}{path}"}
            if args.floor:
                urls["bare relay"] = f"http://127.0.0.1:{relay_port}{path}"
            asyncio.run(measure(urls, args))
        finally:
            for proc in procs:
                stop(proc)


if __name__ == "__main__":
    main()
