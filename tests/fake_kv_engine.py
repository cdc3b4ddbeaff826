"""A fake engine that does a disaggregated engine's data work against quilld: tests/fake_engine.py plus KV.

    python tests/fake_kv_engine.py --port P --model M --name N --role prefill|decode|both
        --quilld HOST:PORT [--tokenizer T] [--chunk-chars 256] [--block-bytes 65536] [--local-reads]
        [--hash-only]
        [fake_engine.py's options]

As vLLM with a KV connector pointed at quilld, it answers vLLM's disaggregated-serving
proxy protocol (what the gateway sends, quilld/http/gateway_strategy.py):

- a request with `kv_transfer_params.do_remote_decode` true is a prefill: the engine
  hashes the prompt as quilld's gateway does (quilld/http/prompt_blocks.py: character
  chunks of `--chunk-chars`, or token ids by `--block-size`), writes every block's KV into
  quilld through `quillclient` under index/handoff.py's key scheme (`kv:<hash>` in the
  engine's scope, `PUT2PHASE BEGIN key n HASH h PARENT p`, DATA with its CRC32C; with
  `--hash-only` no PARENT, as a connector that knows only each block's hash), and answers one
  token, not streamed, with `kv_transfer_params` as vLLM's NIXL connector does
  (do_remote_prefill, remote_engine_id, remote_block_ids, remote_host, remote_port);
- a request with `kv_transfer_params.do_remote_prefill` true is a decode: the engine reads
  every block of the prompt back (`GETBLK key`, or `GETBLK key LOCAL` with
  `--local-reads`: only what its own quilld node holds), checks every byte against what
  the prefill must have written, counts each block loaded, recomputed (missing) or
  corrupt, and answers as fake_engine.py does, the counts in the answer (`quillcache_kv`);
- any other request is an aggregated one (prefill and decode here): answered as
  fake_engine.py does; a prefill-only engine refuses it (400) and counts it `misrouted`.

A block's KV is `kv_bytes(hash, n)`: deterministic, different for every hash. `GET /stats`
adds prefills, decodes, aggregated, misrouted, blocks_written, loaded, recomputed,
corrupt and the last kv_transfer_params received; `POST /control` also takes write_kv (0:
a prefill answers without writing its KV), write_delay_ms (it writes that long after
answering, as a connector storing asynchronously would) and answer_kv (0: a prefill answers
no kv_transfer_params, as an engine whose connector names none).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
from pathlib import Path

import crc32c
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_engine import FakeEngine, build_app  # noqa: E402
from quillclient import QuillClient  # noqa: E402

from quilld.http.prompt_blocks import chunk_hashes, completion_prompt, render_chat  # noqa: E402
from quilld.index.control import chain_hashes  # noqa: E402
from quilld.index.handoff import kv_key  # noqa: E402


def kv_bytes(block_hash: int, n: int) -> bytes:
    """The KV a prefill writes for a block: n bytes, a function of the block's hash alone."""
    seed = hashlib.blake2b((block_hash & ((1 << 64) - 1)).to_bytes(8, "big"), digest_size=64).digest()
    return (seed * (n // 64 + 1))[:n]


class KvEngine(FakeEngine):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.role = args.role
        self.port = args.port
        host, _, port = args.quilld.rpartition(":")
        self.client = QuillClient(host, int(port)).scope(model=args.model, tokenizer=args.tokenizer)
        self.chunk_chars, self.block_size, self.block_bytes = args.chunk_chars, args.block_size, args.block_bytes
        self.local_reads = args.local_reads
        self.hash_only = args.hash_only
        self.kv = {"prefills": 0, "decodes": 0, "aggregated": 0, "misrouted": 0, "blocks_written": 0, "loaded": 0,
                   "recomputed": 0, "corrupt": 0}
        self.last_kv_params: dict | None = None
        # POST /control: write_kv 0 answers a prefill without writing its KV; write_delay_ms writes it that
        # long after answering (a connector that stores asynchronously); answer_kv 0 answers no kv_transfer_params
        self.settings.update(write_kv=1, write_delay_ms=0, answer_kv=1)
        self._late: set[asyncio.Task] = set()

    def hashes(self, body: dict, chat: bool) -> list[int]:
        """The prompt's block hashes, as quilld's gateway derives them."""
        prompt = render_chat(body["messages"]) if chat else completion_prompt(body["prompt"])
        if isinstance(prompt, list):
            return chain_hashes(prompt, self.block_size)
        return chunk_hashes(prompt, self.chunk_chars)

    def write_blocks(self, hashes: list[int]) -> None:
        parent = None
        for h in hashes:
            data = kv_bytes(h, self.block_bytes)
            # the block's place in its prompt's chain (none with --hash-only, as index/handoff.py documents it)
            chain = () if parent is None or self.hash_only else ("PARENT", parent)
            handle = self.client.execute("PUT2PHASE", "BEGIN", kv_key(h), len(data), "HASH", h & ((1 << 64) - 1),
                                         *chain)
            parent = h & ((1 << 64) - 1)
            if handle in (b"EXISTS", "EXISTS"):
                continue
            self.client.execute("PUT2PHASE", "DATA", handle, 0, data, "CRC32C", crc32c.crc32c(data))
            self.kv["blocks_written"] += 1

    def read_blocks(self, hashes: list[int]) -> dict[str, int]:
        got = {"loaded": 0, "recomputed": 0, "corrupt": 0}
        for h in hashes:
            args = ("GETBLK", kv_key(h), "LOCAL") if self.local_reads else ("GETBLK", kv_key(h))
            value = self.client.execute(*args)
            if value is None:
                got["recomputed"] += 1
            elif bytes(value) == kv_bytes(h, self.block_bytes):
                got["loaded"] += 1
            else:
                got["corrupt"] += 1
        for k, v in got.items():
            self.kv[k] += v
        return got

    async def completion(self, request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        body = await request.json()
        params = body.get("kv_transfer_params") or {}
        self.last_kv_params = params or None
        if self.settings["status"] != 200 or body.get("model") not in self.models:
            request["body"] = body
            return await super().completion(request)  # fails as fake_engine.py does
        if params.get("do_remote_decode"):
            return await self._prefill(body, chat)
        if self.role == "prefill":
            self.kv["misrouted"] += 1
            return web.json_response({"error": {"message": f"{self.name} is a prefill engine", "type": "bad",
                                                "param": None, "code": None}}, status=400)
        if params.get("do_remote_prefill"):
            self.kv["decodes"] += 1
            report = await asyncio.to_thread(self.read_blocks, self.hashes(body, chat))
        else:
            self.kv["aggregated"] += 1
            report = None
        request["body"] = dict(body, _kv_report=report)
        return await super().completion(request)

    async def _prefill(self, body: dict, chat: bool) -> web.Response:
        self.counts["requests"] += 1
        self.kv["prefills"] += 1
        self.last = body
        if body.get("stream") or body.get("max_tokens") != 1:
            return web.json_response({"error": {"message": "a prefill request is one token, not streamed",
                                                "type": "bad", "param": None, "code": None}}, status=400)
        await asyncio.sleep(self.settings["delay_ms"] / 1000)
        hashes = self.hashes(body, chat)
        if self.settings["write_kv"] and self.settings["write_delay_ms"]:
            task = asyncio.create_task(self._write_later(hashes, self.settings["write_delay_ms"] / 1000))
            self._late.add(task)
            task.add_done_callback(self._late.discard)
        elif self.settings["write_kv"]:
            await asyncio.to_thread(self.write_blocks, hashes)
        answer = self._whole(body, chat, "x")
        if not self.settings["answer_kv"]:
            self.counts["completed"] += 1
            return web.json_response(answer)
        answer["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                        "remote_engine_id": self.name, "remote_block_ids": list(range(len(hashes))),
                                        "remote_host": "127.0.0.1", "remote_port": self.port,
                                        "remote_request_id": f"cmpl-{self.name}-{self.counts['requests']}"}
        self.counts["completed"] += 1
        return web.json_response(answer)

    async def _write_later(self, hashes: list[int], delay: float) -> None:
        await asyncio.sleep(delay)
        await asyncio.to_thread(self.write_blocks, hashes)

    def _whole(self, body: dict, chat: bool, text: str) -> dict:
        out = super()._whole(body, chat, text)
        if body.get("_kv_report") is not None:  # a decode's: blocks loaded, recomputed, corrupt
            out["quillcache_kv"] = body["_kv_report"]
        return out

    async def stats(self, request: web.Request) -> web.Response:
        base = await super().stats(request)
        out = json.loads(base.body) | {"kv": self.kv, "role": self.role, "last_kv_params": self.last_kv_params}
        return web.json_response(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--lora", action="append", default=[])
    p.add_argument("--delay-ms", type=int, default=0)
    p.add_argument("--chunk-delay-ms", type=int, default=0)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--status", type=int, default=200)
    p.add_argument("--name", default="fake")
    p.add_argument("--role", choices=("prefill", "decode", "both"), default="both")
    p.add_argument("--quilld", required=True, help="HOST:PORT of the quilld node it stores its KV through")
    p.add_argument("--tokenizer", default="")
    p.add_argument("--chunk-chars", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--block-bytes", type=int, default=64 * 1024)
    p.add_argument("--local-reads", action="store_true", help="read with GETBLK ... LOCAL: its node's copies only")
    p.add_argument("--hash-only", action="store_true", help="store blocks with HASH and no PARENT")
    p.add_argument("--api-key", default="", help="require Authorization: Bearer KEY on /v1 (vLLM's --api-key)")
    args = p.parse_args()
    web.run_app(build_app(KvEngine(args)), host=args.host, port=args.port, access_log=None, print=None,
                handler_cancellation=True, shutdown_timeout=0.5)


if __name__ == "__main__":
    main()
