"""One gateway attempt's pure parts: what is sent to the engine, how its answer's status is judged,
and the `x-quillcache-*` decision headers that go to the client with it.

No sockets here: quilld/http/gateway.py does the I/O and calls these.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from quilld.config import EngineConfig
from quilld.index.router import Decision

ENGINE_HEADER = "x-quillcache-engine"
OVERLAP_HEADER = "x-quillcache-overlap-blocks"
COST_HEADER = "x-quillcache-cost"
PLAN_HEADER = "x-quillcache-plan"
REQUEST_ID_HEADER = "x-quillcache-request-id"
# with engine roles (index/pairing.py): which engine prefilled, which decodes, whether they differ and why
PREFILL_HEADER = "x-quillcache-prefill-engine"
DECODE_HEADER = "x-quillcache-decode-engine"
DISAGGREGATED_HEADER = "x-quillcache-disaggregated"
PAIR_HEADER = "x-quillcache-pair"
HANDOFF_HEADER = "x-quillcache-handoff"  # a disaggregated request's handoff: blocks, resident, waited, prefetched


class UpstreamFailed(Exception):
    """One attempt failed before any body byte reached the client; `cool` marks the engine."""

    def __init__(self, reason: str, cool: bool = True) -> None:
        super().__init__(reason)
        self.reason, self.cool = reason, cool


def upstream_url(base: str, path: str) -> str:
    """The engine URL for `path`: its base may or may not end in /v1."""
    base = base.rstrip("/")
    return base + path[3:] if base.endswith("/v1") else base + path


def describe(e: BaseException) -> str:
    """An attempt's failure in a few words, for logs and the client's error message."""
    if isinstance(e, UpstreamFailed):
        return e.reason
    if isinstance(e, TimeoutError):
        return "timed out"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def upstream_headers(asked: Mapping[str, str], request_id: str) -> dict[str, str]:
    """The headers sent to the engine: JSON, the client's Accept and Accept-Encoding, the request id."""
    return {"Content-Type": "application/json", "Accept": asked.get("Accept", "*/*"),
            "Accept-Encoding": asked.get("Accept-Encoding", "identity"), "X-Request-Id": request_id}


def engine_headers(headers: dict[str, str], engine: EngineConfig) -> dict[str, str]:
    """`headers` for one request to `engine`: with its api_key as a bearer token when it has one."""
    return headers | {"Authorization": f"Bearer {engine.api_key}"} if engine.api_key else headers


def answer_ok(status: int, headers_sent: bool) -> bool:
    """Whether the engine's answer is a success (2xx) to relay as such.

    Raises UpstreamFailed, so the next engine is tried, for 5xx and 429, and for
    any other non-2xx once an earlier attempt's headers went out (the client
    already has a status; the engine is not cooled for refusing the request).
    Before that, a 4xx is relayed as is: the request itself was refused.
    """
    if status >= 500 or status == 429:
        raise UpstreamFailed(f"HTTP {status}")
    ok = status < 300
    if headers_sent and not ok:
        raise UpstreamFailed(f"HTTP {status} after the headers went out", cool=False)
    return ok


def decision_headers(d: Decision, request_id: str, fallback: str = "") -> dict[str, str]:
    """A decision as the gateway's response headers (the decision must name an engine). With a pair:
    the prefill and decode engines, whether they differ and the costs compared; `fallback` says
    why a disaggregated decision was served by the decode engine alone."""
    hits, fetches, recomputes = d.tally()
    out = {ENGINE_HEADER: d.engine, OVERLAP_HEADER: str(d.overlap_blocks), COST_HEADER: f"{d.cost:.6g}",
           PLAN_HEADER: f"hits={hits} fetches={fetches} recomputes={recomputes}",
           REQUEST_ID_HEADER: request_id}
    p = d.pair
    if p is not None:
        out[PREFILL_HEADER] = p.prefill or d.engine
        out[DECODE_HEADER] = d.engine
        out[DISAGGREGATED_HEADER] = "true" if p.prefill else "false"
        out[PAIR_HEADER] = header_text(f"{fallback}; decided {p.why()}" if fallback else p.why())
    return out


def header_text(text: str, limit: int = 1024) -> str:
    """`text` as a header value: printable ASCII on one line, at most `limit` characters."""
    clean = "".join(ch if " " <= ch <= "~" else "?" for ch in text)
    return clean if len(clean) <= limit else clean[:limit - 3] + "..."


# vLLM's disaggregated-serving proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py, 0.33):
# the prefill request asks for one token, not streamed, with do_remote_decode; the decode request is
# the original one with the kv_transfer_params the prefill answered
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_body(body: dict, kv_params: dict | None = None) -> bytes:
    """The prefill engine's request, from the client's (as vLLM's proxy builds it), its
    kv_transfer_params with `kv_params` added (Mooncake's transfer_id)."""
    out = dict(body, kv_transfer_params=dict(PREFILL_KV_PARAMS, **(kv_params or {})), stream=False, max_tokens=1)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for name in ("stream_options", "min_tokens", "min_completion_tokens"):  # not for the prefill (vLLM's proxy)
        out.pop(name, None)
    return json.dumps(out).encode()


def decode_body(body: dict, kv_params: dict | None) -> bytes:
    """The decode engine's request: the client's, with the prefill's kv_transfer_params (and
    do_remote_prefill), or unchanged when the prefill answered none."""
    if not kv_params:
        return json.dumps(body).encode()
    return json.dumps(dict(body, kv_transfer_params=dict(kv_params, do_remote_prefill=True))).encode()


@dataclass(frozen=True, slots=True)
class Choice:
    """The engine one attempt goes to, the decision naming it (its headers), and the prompt's blocks."""

    engine: EngineConfig
    decision: Decision  # decision.engine == engine.id
    tag: bytes  # the request's scope tag for this engine's family
    blocks: list[int]  # the prompt's block hashes for this engine's family, recorded when it answers
    uncached_tokens: int = 0  # what this engine prefills of the prompt (its lease's prefill load)
    body: bytes | None = None  # what is sent instead of the request's body (a disaggregated decode)
    headers: dict[str, str] | None = None  # headers the client gets besides the decision's
    fallback: str = ""  # why a disaggregated decision is served by this engine alone
