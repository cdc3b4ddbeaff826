"""One gateway attempt's pure parts: what is sent to the engine, how its answer's status is judged,
and the `x-quillcache-*` decision headers that go to the client with it.

No sockets here: quilld/http/gateway.py does the I/O and calls these.
"""

from __future__ import annotations

from collections.abc import Mapping

from quilld.index.router import Decision

ENGINE_HEADER = "x-quillcache-engine"
OVERLAP_HEADER = "x-quillcache-overlap-blocks"
COST_HEADER = "x-quillcache-cost"
PLAN_HEADER = "x-quillcache-plan"
REQUEST_ID_HEADER = "x-quillcache-request-id"


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


def decision_headers(d: Decision, request_id: str) -> dict[str, str]:
    """A decision as the gateway's response headers (the decision must name an engine)."""
    hits, fetches, recomputes = d.tally()
    return {ENGINE_HEADER: d.engine, OVERLAP_HEADER: str(d.overlap_blocks), COST_HEADER: f"{d.cost:.6g}",
            PLAN_HEADER: f"hits={hits} fetches={fetches} recomputes={recomputes}",
            REQUEST_ID_HEADER: request_id}
