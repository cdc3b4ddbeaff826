"""The first stage of a gateway request: reading it, with its errors in OpenAI's shape.

`RequestReader.parse` turns the client's request into a `Parsed`: the API key gives the
tenant (the user whose password it is, when quilld has users; `default` otherwise), the
model picks the engines (`base:adapter`, where no engine serves a model of that exact name,
is LoRA `adapter` on the engines of `base`, sent to them as `"model": "adapter"`), the body is
checked, the TTFT budget (`x-quillcache-ttft-slo-ms`) and the session
(`x-quillcache-session`, at most 256 bytes) are read, and the request gets its id.

Errors answer `{"error": {"message", "type", "param", "code"}}` with the status
OpenAI uses: 400 malformed, 401 bad API key, 404 unknown model, 503 no engine.
The fields the gateway owns (OWNED_FIELDS) are taken out of a client's body here.
"""

from __future__ import annotations

import itertools
import json
import secrets
from typing import Any, NamedTuple

from aiohttp import web

from quilld.config import GatewayConfig
from quilld.http.gateway_stats import GatewayStats
from quilld.http.perimeter import parse_json
from quilld.http.prompt_blocks import completion_prompt, render_chat
from quilld.index.affinity import SessionIdTooLong, check_session_id

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# Fields of a request body the gateway owns: a client's are dropped before any engine sees them.
# `kv_transfer_params` tells a KV connector which host, port, engine and blocks to read KV from
# (vLLM's NixlConnector would read from wherever a client pointed it); `cache_salt` partitions an
# engine's prefix cache, and only the gateway knows whose request it is (it sets its own for
# requests of another identity than the engine's, quilld/index/engine_prompts.py).
OWNED_FIELDS = ("kv_transfer_params", "cache_salt")
SLO_HEADER = "x-quillcache-ttft-slo-ms"
SESSION_HEADER = "x-quillcache-session"


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
        if (not isinstance(messages, list) or not messages
                or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
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


class RequestReader:
    """Reads each request of the gateway: who asks, for which engines, what (see the module docstring)."""

    def __init__(self, node: Any, cfg: GatewayConfig, stats: GatewayStats) -> None:
        self.node = node  # its users, its engines (the control plane's) and its node-wide counters
        self.cfg = cfg
        self.stats = stats
        self._rid_prefix = secrets.token_hex(4)  # request ids: this run's prefix + a counter
        self._rid = itertools.count(1)

    def tenant(self, request: web.Request) -> str:
        users = self.node.users
        if not users.required:
            return "default"
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "You didn't provide an API key: send `Authorization: Bearer <key>`.",
                           "invalid_request_error", "invalid_api_key", counter="unauthorized")
        user = users.user_for_token(key)
        if user is None:
            self.node.stats["auth_failures"] += 1
            raise ApiError(401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key",
                           counter="unauthorized")
        return user

    def resolve_model(self, model: str) -> tuple[str, str]:
        """(engines' model, adapter) for a requested model name; 404 when no engine serves it."""
        engines = self.node.control.engines
        if engines.for_model(model):
            return model, ""
        base, sep, adapter = model.rpartition(":")
        if sep and base and adapter and engines.for_model(base):
            return base, adapter
        raise ApiError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model_not_found",
                       "model", "unknown_model")

    async def read_request(self, request: web.Request, path: str, t0: float) -> Parsed:
        tenant = self.tenant(request)
        slo_ms = float(self.cfg.ttft_slo_ms)
        if SLO_HEADER in request.headers:
            try:
                slo_ms = float(request.headers[SLO_HEADER])
            except ValueError:
                slo_ms = -1.0
            if not 0 < slo_ms < float("inf"):
                raise bad_request(f"{SLO_HEADER} must be a positive number of milliseconds")
        raw = await request.read()
        body = read_body(raw)
        base, adapter = self.resolve_model(body["model"])
        prompt = prompt_of(path, body)
        dropped = drop_owned(body)  # every engine request is built from this body: none carries them
        if dropped:
            self.stats.dropped(dropped, tenant)
        if adapter or dropped:
            raw = json.dumps(dict(body, model=adapter or body["model"])).encode()
        session = request.headers.get(SESSION_HEADER) or None
        if session is not None:  # kept per tenant by the control plane: tenants' sessions never meet
            try:
                check_session_id(session)
            except SessionIdTooLong as e:
                raise bad_request(f"{SESSION_HEADER}: {e.message}", SESSION_HEADER, "session_id_too_long") from None
        return Parsed(path, raw, base, adapter, tenant, prompt, decode_tokens(body), slo_ms, t0,
                      f"{self._rid_prefix}{next(self._rid) & 0xFFFFFFFF:08x}", session, body)
