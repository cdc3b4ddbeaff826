"""The gateway's counters, time-to-first-token samples and goodput.

Goodput is the share of *counted* requests whose first body byte reached the
client within their TTFT budget (`gateway.ttft_slo_ms`, or the request's
`x-quillcache-ttft-slo-ms` header). A request is counted when its outcome
against the budget is known:

- its first body byte of a 2xx answer is written: counted, within the SLO when
  the time since the request arrived is at most the budget;
- the gateway gives up without having written one (no healthy engine, every
  attempt failed, a stream broken before its first byte): counted, missed;
- the client leaves before the first byte: counted (missed) only when the
  budget had already run out, since an earlier departure says nothing;
- requests the gateway or the engine refuses as malformed, unauthorized or for
  an unknown model (4xx) are not counted: they are the client's errors.

TTFT percentiles are over the most recent `TTFT_SAMPLES` first bytes.
"""

from __future__ import annotations

from collections import Counter, deque

TTFT_SAMPLES = 4096


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    rank = max(1, -(-len(sorted_values) * q // 100))  # ceil(n * q / 100)
    return sorted_values[int(rank) - 1]


class GatewayStats:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.ttft_ms: deque[float] = deque(maxlen=TTFT_SAMPLES)
        self.in_flight = 0

    def first_byte(self, ttft_ms: float, slo_ms: float) -> None:
        self.counts["slo_counted"] += 1
        if ttft_ms <= slo_ms:
            self.counts["within_slo"] += 1
        self.ttft_ms.append(ttft_ms)

    def missed(self) -> None:
        self.counts["slo_counted"] += 1

    @property
    def goodput(self) -> float:
        """within / counted; 1.0 before any request was counted (nothing was missed)."""
        counted = self.counts["slo_counted"]
        return self.counts["within_slo"] / counted if counted else 1.0

    def info(self, slo_ms: int, cooling: int) -> list[tuple[str, int | float | str]]:
        c = self.counts
        samples = sorted(self.ttft_ms)
        return [
            ("gateway_requests", c["requests"]),  # completion requests received
            ("gateway_in_flight", self.in_flight),
            ("gateway_completed", c["completed"]),  # 2xx answers relayed to their end
            ("gateway_bad_requests", c["bad_requests"]),  # 400 from the gateway
            ("gateway_unauthorized", c["unauthorized"]),  # 401
            ("gateway_unknown_model", c["unknown_model"]),  # 404
            ("gateway_unavailable", c["unavailable"]),  # 503: no engine answered
            ("gateway_upstream_client_errors", c["upstream_client_errors"]),  # engine 4xx relayed as is
            ("gateway_retries", c["retries"]),  # attempts after the first
            ("gateway_upstream_errors", c["upstream_errors"]),  # refused, reset, 5xx or timeout before a byte
            ("gateway_stream_errors", c["stream_errors"]),  # engine failed after bytes reached the client
            ("gateway_client_disconnects", c["client_disconnects"]),
            ("gateway_residencies_recorded", c["residencies_recorded"]),
            ("gateway_residencies_forgotten", c["residencies_forgotten"]),  # past gateway.recorded_blocks
            ("gateway_engines_cooling", cooling),
            ("gateway_ttft_slo_ms", slo_ms),
            ("gateway_slo_counted", c["slo_counted"]),
            ("gateway_within_slo", c["within_slo"]),
            ("gateway_goodput", round(self.goodput, 6)),
            ("gateway_ttft_p50_ms", round(percentile(samples, 50), 3)),
            ("gateway_ttft_p99_ms", round(percentile(samples, 99), 3)),
        ]
