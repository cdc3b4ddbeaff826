"""Reading an OpenAI request: its errors, in OpenAI's shape, and the body's checks.

Errors answer `{"error": {"message", "type", "param", "code"}}` with the status
OpenAI uses: 400 malformed, 401 bad API key, 404 unknown model, 503 no engine.
The fields the gateway owns (OWNED_FIELDS) are taken out of a client's body here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from aiohttp import web

from quilld.http.perimeter import parse_json
from quilld.http.prompt_blocks import completion_prompt, render_chat

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# Fields of a request body the gateway owns: a client's are dropped before any engine sees them.
# `kv_transfer_params` tells a KV connector which host, port, engine and blocks to read KV from
# (vLLM's NixlConnector would read from wherever a client pointed it); `cache_salt` partitions an
# engine's prefix cache, and only the gateway knows whose request it is (it sets its own for
# requests of another identity than the engine's, quilld/index/engine_prompts.py).
OWNED_FIELDS = ("kv_transfer_params", "cache_salt")


class ApiError(Exception):
    """An OpenAI-style error answer: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, kind: str, code: str | None, param: str | None = None,
                 counter: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.counter = counter

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param, "bad_requests")


def read_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request, with a model name; 400 otherwise (not JSON, nested too deeply, ...)."""
    try:
        body = parse_json(raw)
    except ValueError as e:
        raise bad_request(f"The request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("You must provide a model parameter.", "model", "missing_model")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise bad_request("`stream` must be a boolean.", "stream")
    return body


def drop_owned(body: dict[str, Any]) -> tuple[str, ...]:
    """Remove the gateway's own fields (OWNED_FIELDS) from a client's body; the names it held."""
    return tuple(name for name in OWNED_FIELDS if body.pop(name, _ABSENT) is not _ABSENT)


_ABSENT = object()


def prompt_of(path: str, body: dict[str, Any]) -> str | list[int]:
    """The prompt to route by: rendered chat messages, or the completions prompt; 400 when missing."""
    if path == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages \
                or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise bad_request("`messages` must be a non-empty array of objects with a `role`.", "messages",
                              "missing_messages")
        return render_chat(messages)
    if not valid_prompt(body.get("prompt")):
        raise bad_request("`prompt` must be a string, an array of strings, an array of token ids or "
                          "an array of token-id arrays.", "prompt", "missing_prompt")
    return completion_prompt(body["prompt"])


def decode_tokens(body: dict[str, Any]) -> int:
    """The tokens the request may generate, as far as it says."""
    n = body.get("max_completion_tokens", body.get("max_tokens"))
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def valid_prompt(prompt: Any) -> bool:
    def ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                       for t in x)

    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    if all(isinstance(p, str) for p in prompt):
        return True
    return ids(prompt) or all(ids(p) for p in prompt)


class Parsed(NamedTuple):
    """A completion request, read and checked: what is routed and what is sent upstream."""

    path: str
    body: bytes  # what is sent upstream
    model: str  # the engines' model
    adapter: str  # LoRA name, "" for the base model
    tenant: str
    prompt: str | list[int]
    decode_tokens: int
    slo_ms: float
    t0: float  # perf_counter when the request arrived
    request_id: str
    session: str | None = None  # x-quillcache-session: requests of one session stay on one engine
    fields: dict[str, Any] | None = None  # the request's JSON object (engine_prompts.py reads its prompt)
