"""A small OpenAI-compatible inference server, for the gateway's tests and benchmark.

    python tests/fake_engine.py --port P --model M [--lora NAME ...] [--delay-ms D]
        [--chunk-delay-ms C] [--chunks N] [--status S] [--name N] [--api-key K]

Like vLLM's server it sends its headers at once and the first chunk after a
"prefill" of `--delay-ms`, then `--chunks` content chunks `--chunk-delay-ms`
apart (SSE `data: {...}` events and `data: [DONE]` when `stream` is true, one
JSON body otherwise). Every answer names the engine (`--name`), so a test can
tell who served it. `--status` other than 200 answers every completion with
that status and an OpenAI-style error. Unknown models get a 404 as vLLM gives.

`GET /stats` tells what it saw: requests, open (being answered now), completed,
cancelled (the client went away mid-answer) and the last request's body.
`POST /control` changes delay_ms, chunk_delay_ms, chunks or status at run time.
With `--api-key`, as vLLM's, every /v1 request needs `Authorization: Bearer <key>`:
without it the answer is 401 and it is counted (`unauthorized` in /stats).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter

from aiohttp import web


class FakeEngine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.name = args.name
        self.models = [args.model, *args.lora]
        self.settings = {"delay_ms": args.delay_ms, "chunk_delay_ms": args.chunk_delay_ms, "chunks": args.chunks,
                         "status": args.status}
        self.counts: Counter[str] = Counter()
        self.api_key = getattr(args, "api_key", "")
        self.open = 0
        self.last: dict = {}

    def _words(self) -> list[str]:
        return [f"served by {self.name}"] + [f" chunk {i}" for i in range(1, self.settings["chunks"])]

    async def models_list(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": self.name} for m in self.models]})

    async def completion(self, request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        body = request["body"] if "body" in request else await request.json()  # a subclass may have read it
        self.counts["requests"] += 1
        self.last = body
        s = dict(self.settings)
        if s["status"] != 200:
            return web.json_response({"error": {"message": f"{self.name} fails on purpose", "type": "server_error",
                                                "param": None, "code": None}}, status=s["status"])
        if body.get("model") not in self.models:
            return web.json_response({"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                                "type": "NotFoundError", "param": None, "code": 404}}, status=404)
        self.open += 1
        done = False
        try:
            if body.get("stream"):
                resp = await self._stream(request, body, chat, s)
            else:
                await asyncio.sleep(s["delay_ms"] / 1000)
                text = "".join(self._words())
                resp = web.json_response(self._whole(body, chat, text))
            done = True
            self.counts["completed"] += 1
            return resp
        finally:
            self.open -= 1
            if not done:
                self.counts["cancelled"] += 1

    async def _stream(self, request: web.Request, body: dict, chat: bool, s: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)  # headers now, the first chunk after the "prefill"
        cid, created = f"cmpl-{self.name}-{self.counts['requests']}", int(time.time())
        for i, word in enumerate(self._words()):
            await asyncio.sleep((s["delay_ms"] if i == 0 else s["chunk_delay_ms"]) / 1000)
            if chat:
                delta = {"role": "assistant", "content": word} if i == 0 else {"content": word}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": word, "logprobs": None, "finish_reason": None}
                obj = "text_completion"
            event = {"id": cid, "object": obj, "created": created, "model": body["model"], "choices": [choice]}
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _whole(self, body: dict, chat: bool, text: str) -> dict:
        usage = {"prompt_tokens": 1, "completion_tokens": self.settings["chunks"],
                 "total_tokens": 1 + self.settings["chunks"]}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": "stop"}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}
            obj = "text_completion"
        return {"id": f"cmpl-{self.name}-{self.counts['requests']}", "object": obj, "created": int(time.time()),
                "model": body["model"], "choices": [choice], "usage": usage}

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"name": self.name, "requests": self.counts["requests"], "open": self.open,
                                  "completed": self.counts["completed"], "cancelled": self.counts["cancelled"],
                                  "unauthorized": self.counts["unauthorized"], "last": self.last})

    async def control(self, request: web.Request) -> web.Response:
        changes = await request.json()
        unknown = set(changes) - set(self.settings)
        if unknown:
            return web.json_response({"error": f"unknown settings {sorted(unknown)}"}, status=400)
        self.settings.update({k: int(v) for k, v in changes.items()})
        return web.json_response(self.settings)


def build_app(engine: FakeEngine) -> web.Application:
    @web.middleware
    async def bearer(request: web.Request, handler):
        if engine.api_key and request.path.startswith("/v1") and \
                request.headers.get("Authorization") != f"Bearer {engine.api_key}":  # as vLLM's --api-key
            engine.counts["unauthorized"] += 1
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    app = web.Application(middlewares=[bearer])
    app.router.add_get("/v1/models", engine.models_list)
    app.router.add_post("/v1/chat/completions", engine.completion)
    app.router.add_post("/v1/completions", engine.completion)
    app.router.add_get("/stats", engine.stats)
    app.router.add_post("/control", engine.control)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--lora", action="append", default=[], help="a LoRA adapter name it also serves")
    p.add_argument("--delay-ms", type=int, default=0, help="delay before the first chunk")
    p.add_argument("--chunk-delay-ms", type=int, default=0, help="delay between chunks")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--status", type=int, default=200)
    p.add_argument("--name", default="fake")
    p.add_argument("--api-key", default="", help="require Authorization: Bearer KEY on /v1 (vLLM's --api-key)")
    args = p.parse_args()
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    web.run_app(build_app(FakeEngine(args)), host=args.host, port=args.port, access_log=None, print=None,
                handler_cancellation=True, shutdown_timeout=0.5)


if __name__ == "__main__":
    main()
