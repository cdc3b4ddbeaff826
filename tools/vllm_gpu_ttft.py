"""Time to first token of real `vllm serve` engines sharing a prefix through quilld (needs GPUs).

Run by hand on a machine with NVIDIA GPUs, vLLM 0.33 and quillclient installed in this Python
(`pip install -e clients/python`) and a quilld reachable at `--quilld` (or started here with
`--start-quilld`, from this tree). Two engines of one small model (`--model`), engine A and
engine B, each on its own GPU (`--gpus 0,1`; one GPU holds both with `--gpus 0,0` and a lower
`--gpu-memory-utilization`), both with prefix caching on and the same PYTHONHASHSEED:

1. without the pool: B answers `--requests` prompts that share one long prefix (`--prefix-tokens`)
   but never saw it; each first request of a new prefix pays its whole prefill;
2. with the pool: A and B both run `OffloadingConnector` with `QuillTier` (docs/connectors.md,
   section 4), or with `--via connector` the `QuillConnector` (section 5). A answers each prompt
   first (its blocks go to the pool), then B answers the same prompt with a new suffix: B loads
   the prefix from the pool instead of computing it.

It prints B's TTFT p50/p99 in both runs and their ratio, and how many of B's prompt tokens vLLM
reported as cached. Every process it starts is stopped (by PID) when it ends or fails.

    python tools/vllm_gpu_ttft.py --model Qwen/Qwen2.5-0.5B-Instruct --gpus 0,1 --start-quilld
    python tools/vllm_gpu_ttft.py --quilld quill://:secret@10.0.0.5:7379 --prefix-tokens 8000
    python tools/vllm_gpu_ttft.py --via connector --start-quilld
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fail(msg: str) -> None:
    print(f"vllm_gpu_ttft: {msg}", file=sys.stderr)
    sys.exit(1)


def gpus_present() -> str:
    """'' when NVIDIA GPUs are visible, else why not."""
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi is not installed: no NVIDIA GPU here"
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    if out.returncode != 0 or "GPU" not in out.stdout:
        return f"nvidia-smi lists no GPU ({out.stderr.strip() or out.stdout.strip()})"
    return ""


def wait_http(url: str, proc: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            fail(f"{what} exited with {proc.returncode} before it answered {url}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    fail(f"{what} did not answer {url} within {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def serve(args, gpu: str, port: int, tier_url: str | None, log: Path) -> subprocess.Popen:
    cmd = ["vllm", "serve", args.model, "--port", str(port), "--enable-prefix-caching",
           "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--max-model-len", str(args.max_model_len)]
    if tier_url is not None and args.via == "connector":
        cmd += ["--kv-transfer-config", json.dumps({
            "kv_connector": "QuillConnector", "kv_connector_module_path": "quillclient.vllm", "kv_role": "kv_both",
            "kv_connector_extra_config": {"url": tier_url}})]
    elif tier_url is not None:
        cmd += ["--kv-transfer-config", json.dumps({
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": args.cpu_bytes,
                                          "secondary_tiers": [{"type": "QuillTier", "module_path": "quillclient.vllm",
                                                               "url": tier_url}]}})]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu, "PYTHONHASHSEED": args.hash_seed}
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def ttft(port: int, model: str, prompt: str) -> tuple[float, int]:
    """(seconds to the first streamed token, prompt tokens the engine reported as cached)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, cached = None, 0
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event.get("choices"):
                first = time.perf_counter() - t0
            usage = event.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or cached
    if first is None:
        fail(f"engine on port {port} streamed no token")
    return first, cached


def prompts(args) -> list[tuple[str, str]]:
    """(prefix, suffix) pairs: each prefix about --prefix-tokens tokens (about 4 characters a token)."""
    words = "the pool keeps every block an engine computed so the next engine never computes it again".split()
    out = []
    for i in range(args.requests):
        prefix = f"[document {i}] " + " ".join(words[(i + j) % len(words)] for j in range(args.prefix_tokens))
        out.append((prefix, f"\nQuestion {i}: what is the {i}th word?"))
    return out


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    p.add_argument("--gpus", default="0,1", help="CUDA devices of engine A and engine B (default 0,1)")
    p.add_argument("--quilld", default="quill://127.0.0.1:7379", help="the pool's URL (QuillTier's url option)")
    p.add_argument("--via", choices=("tier", "connector"), default="tier",
                   help="QuillTier behind OffloadingConnector (default) or QuillConnector")
    p.add_argument("--start-quilld", action="store_true", help="start a quilld of this tree on 127.0.0.1:7379")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--prefix-tokens", type=int, default=4000)
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    p.add_argument("--cpu-bytes", type=int, default=4 << 30, help="vLLM's CPU region for the offloading tier")
    p.add_argument("--hash-seed", default="0", help="PYTHONHASHSEED of both engines (they must share it)")
    p.add_argument("--port-base", type=int, default=8100)
    args = p.parse_args()
    if args.requests < 1 or args.prefix_tokens < 16:
        p.error("--requests must be at least 1 and --prefix-tokens at least 16")
    why = gpus_present()
    if why:
        fail(f"{why}; run this where vLLM has GPUs")
    if shutil.which("vllm") is None:
        fail("the `vllm` command is not on PATH: install vLLM 0.33 in this environment")
    gpu_a, _, gpu_b = args.gpus.partition(",")
    work = Path(tempfile.mkdtemp(prefix="vllm-ttft-"))
    procs: list[subprocess.Popen] = []
    try:
        if args.start_quilld:
            with open(work / "quilld.log", "wb") as qlog:
                q = subprocess.Popen([sys.executable, "-m", "quilld", "--dram", "16GiB"], cwd=ROOT,
                                     start_new_session=True, stdout=qlog, stderr=subprocess.STDOUT)
            procs.append(q)
            wait_http("http://127.0.0.1:7380/readyz", q, 60, "quilld")  # ready: recovered and serving
        pairs = prompts(args)
        port_a, port_b = args.port_base, args.port_base + 1

        print(f"1/2: engine B alone ({args.model}, GPU {gpu_b}), {args.requests} prompts of ~{args.prefix_tokens} "
              "tokens it never saw", flush=True)
        b = serve(args, gpu_b, port_b, None, work / "b-alone.log")
        procs.append(b)
        wait_http(f"http://127.0.0.1:{port_b}/health", b, 900, "engine B")
        alone = [ttft(port_b, args.model, pre + suf) for pre, suf in pairs]
        stop(b)

        via = "QuillTier" if args.via == "tier" else "QuillConnector"
        print(f"2/2: engines A (GPU {gpu_a}) and B with {via} at {args.quilld}", flush=True)
        a = serve(args, gpu_a, port_a, args.quilld, work / "a.log")
        b = serve(args, gpu_b, port_b, args.quilld, work / "b-pool.log")
        procs += [a, b]
        wait_http(f"http://127.0.0.1:{port_a}/health", a, 900, "engine A")
        wait_http(f"http://127.0.0.1:{port_b}/health", b, 900, "engine B")
        pooled = []
        for pre, suf in pairs:
            ttft(port_a, args.model, pre + suf)  # A computes the prefix; its chunks go to the pool
            time.sleep(0.5)  # the store job finishes on A's tier threads
            pooled.append(ttft(port_b, args.model, pre + suf + " (again)"))
        ta, tp = [t for t, _ in alone], [t for t, _ in pooled]
        print(f"\nengine B TTFT over {args.requests} prompts of ~{args.prefix_tokens} tokens:")
        print(f"  without the pool: p50 {statistics.median(ta) * 1e3:.0f} ms, p99 {pct(ta, 0.99) * 1e3:.0f} ms, "
              f"cached tokens median {statistics.median(c for _, c in alone):.0f}")
        print(f"  with the pool:    p50 {statistics.median(tp) * 1e3:.0f} ms, p99 {pct(tp, 0.99) * 1e3:.0f} ms, "
              f"cached tokens median {statistics.median(c for _, c in pooled):.0f}")
        print(f"  p50 ratio (without / with): {statistics.median(ta) / statistics.median(tp):.2f}x")
        print(f"logs in {work}")
    finally:
        for proc in reversed(procs):
            stop(proc)


if __name__ == "__main__":
    main()
