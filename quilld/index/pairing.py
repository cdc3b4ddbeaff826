"""The prefill-decode pair of a request, and whether to disaggregate it at all.

An engine is `prefill`, `decode` or `both` (EngineConfig.role). When a model's engines
have roles, ROUTE answers a pair: the engine that prefills the prompt, the engine that
decodes it, and whether the two are different engines (disaggregated: the prefill's KV
goes through this pool to the decode engine) or one engine does both, as without roles.
DistServe's case for splitting them is that a prefill stalls the decodes batched with it;
Dynamo's "conditional disaggregation" adds that a short uncached prompt, or a long prefill
queue, is better prefilled on the decode engine itself. Both are weighed here.

Estimates are in microseconds, from the seed's cost model (`router.*`):

- prefilling on engine e costs its wait and its harm: `prefill_us_per_token` x (tokens
  queued ahead of it on e + the prompt's tokens e cannot reuse) + `running_decode_penalty_us`
  x the decodes running on e (they share its steps), plus `decode_stall_weight` x those
  decodes x the prefill's own time (each running decode waits while it runs). The tokens e
  cannot reuse are (blocks - e's credit) x tokens per block, the credit being the router's
  (a prefix block in e's HBM is worth 1, in host memory 0.75, ...).
- moving the KV to decode engine d: the prefill's KV lands on the node the prefill
  engine stores through (its `locality`), in DRAM. On d's own node it costs nothing;
  otherwise the blocks d cannot reuse move: `transfer_us_per_mib` per MiB (the DRAM
  tier's price) + `cross_node_us` once.

The choice, given every candidate's router score and load:

- the prefill engine P: of the prefill-capable engines (prefill, both), the cheapest to
  prefill on: the most reusable prefix, then the shortest queue (ties: the engine id);
- the decode engine D: of the decode-capable engines (decode, both) other than P, the
  one with the fewest running decodes plus the KV's move to it (ties: the engine id);
- the aggregated engine A: of the decode-capable engines, the router's pick (its cost:
  the least recompute, then the fewest requests in flight), as without roles.

Then `local_us` = prefilling on A, `remote_us` = prefilling on P + the move to D +
`handoff_us` (a second request and the handoff check). The answer is one engine (A) when
the prompt's uncached tokens on A are fewer than `disagg_min_uncached_tokens` ("short"),
when no other engine can prefill ("no_prefill_engine"), or when `remote_us` is not below
`local_us` ("local_cheaper": the prefill side's queue, or the handoff, costs more than
the decodes a local prefill stalls); otherwise the pair (P, D) ("remote_cheaper").
`router.disaggregation` "always" answers the pair whenever there is one ("always"),
"never" always A ("never"). A model with no decode-capable engine has no answer (the
caller's error, NoDecodeEngine).

Pure: the control plane gathers the candidates (router scores, leases, roles, nodes), so
the decision works unchanged whatever the residencies come from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from quilld.errors import CommandError
from quilld.index.engines import Load

MiB = 1 << 20
REASONS = ("short", "local_cheaper", "remote_cheaper", "always", "never", "no_prefill_engine")


class PairCandidate(NamedTuple):
    """One engine of the request's model, as the decision sees it."""

    engine: str
    role: str  # prefill, decode or both
    node: str  # the pool node its KV is stored through
    overlap_blocks: int  # leading blocks it can reuse (the router's)
    credit: float  # those blocks' credit (the router's)
    cost: float  # the router's cost
    load: Load
    kv_bytes_per_token: int = 131_072


@dataclass(frozen=True)
class PairCosts:
    """`router.*`'s prices (config.py documents each)."""

    mode: str = "auto"
    min_uncached_tokens: int = 512
    prefill_us_per_token: float = 45.0
    running_decode_penalty_us: float = 1500.0
    decode_stall_weight: float = 1.0
    transfer_us_per_mib: float = 55.0
    cross_node_us: float = 350.0
    handoff_us: float = 2000.0


@dataclass(frozen=True, slots=True)
class Pair:
    """Which engine prefills, which decodes, whether they differ, and why."""

    decode: str  # the engine that answers (and, aggregated, prefills too)
    prefill: str | None  # the engine that prefills when disaggregated; None otherwise
    reason: str  # one of REASONS
    local_us: float  # the cost of prefilling on the aggregated engine (its wait and the decodes it stalls)
    remote_us: float | None  # ... disaggregated (prefill, KV move, handoff); None without a prefill engine
    transfer_us: float  # the KV's move from the prefill's node to the decode engine's node
    transfer_bytes: int  # what moves
    uncached_tokens: int  # the prompt's tokens the aggregated engine cannot reuse
    prefill_node: str = ""  # where the prefill's KV lands
    decode_node: str = ""  # the decode engine's node
    prefill_order: tuple[str, ...] = ()  # prefill engines, best first (retries), the chosen one first
    decode_order: tuple[str, ...] = ()  # decode engines, best first (retries), the chosen one first
    prefill_url: str | None = field(default=None, compare=False)  # the control plane's
    prefill_lease: str | None = field(default=None, compare=False)

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None

    def why(self) -> str:
        """The costs compared, in a line (for headers and logs)."""
        remote = "none" if self.remote_us is None else f"{self.remote_us / 1000:.3f}ms"
        return (f"{self.reason}: local {self.local_us / 1000:.3f}ms, disaggregated {remote} "
                f"(transfer {self.transfer_us / 1000:.3f}ms, {self.transfer_bytes} bytes), "
                f"uncached {self.uncached_tokens} tokens")


def prefill_us(c: PairCandidate, blocks: int, block_tokens: float, costs: PairCosts) -> float:
    """The cost of prefilling the request on `c`: its queue, the tokens it cannot reuse, its running
    decodes' share of its steps, and those decodes' stall while it prefills."""
    own = costs.prefill_us_per_token * max(0.0, blocks - c.credit) * block_tokens
    return (costs.prefill_us_per_token * c.load.prefill_tokens + own
            + c.load.decodes * (costs.running_decode_penalty_us + costs.decode_stall_weight * own))


def transfer(src: PairCandidate, dst: PairCandidate, blocks: int, block_tokens: float,
             costs: PairCosts) -> tuple[float, int]:
    """(microseconds, bytes) of moving the KV `dst` cannot reuse from `src`'s node to `dst`'s."""
    if src.node == dst.node:
        return 0.0, 0
    nbytes = int(max(0, blocks - dst.overlap_blocks) * block_tokens * src.kv_bytes_per_token)
    return costs.transfer_us_per_mib * nbytes / MiB + costs.cross_node_us, nbytes


def _decodes(c: PairCandidate) -> bool:
    return c.role != "prefill"


def _prefills(c: PairCandidate) -> bool:
    return c.role != "decode"


def decide(candidates: Sequence[PairCandidate], blocks: int, block_tokens: float, costs: PairCosts) -> Pair | None:
    """The pair for a request of `blocks` blocks of `block_tokens` tokens; None when no candidate
    can decode."""
    decoders = [c for c in candidates if _decodes(c)]
    if not decoders:
        return None
    agg = min(decoders, key=lambda c: (c.cost, c.engine))
    local = prefill_us(agg, blocks, block_tokens, costs)
    uncached = int(round(max(0.0, blocks - agg.credit) * block_tokens))
    ranked = sorted(((prefill_us(c, blocks, block_tokens, costs), c.engine, c) for c in candidates if _prefills(c)),
                    key=lambda t: (t[0], t[1]))
    # the best prefill engine that leaves a decode engine other than itself
    best = next(((us, c) for us, _, c in ranked if any(d.engine != c.engine for d in decoders)), None)
    agg_order = tuple(c.engine for c in sorted(decoders, key=lambda c: (c.cost, c.engine)))
    if best is None:
        return Pair(agg.engine, None, "no_prefill_engine", local, None, 0.0, 0, uncached, agg.node, agg.node,
                    (), agg_order)
    p_us, p = best
    moves = []
    for d in decoders:
        if d.engine == p.engine:
            continue
        us, nbytes = transfer(p, d, blocks, block_tokens, costs)
        moves.append((costs.running_decode_penalty_us * d.load.decodes + us, d.engine, d, us, nbytes))
    moves.sort(key=lambda t: (t[0], t[1]))
    _, _, d, move_us, move_bytes = moves[0]
    remote = p_us + move_us + costs.handoff_us
    if costs.mode == "never":
        reason = "never"
    elif costs.mode == "always":
        reason = "always"
    elif uncached < costs.min_uncached_tokens:
        reason = "short"
    elif remote >= local:
        reason = "local_cheaper"
    else:
        reason = "remote_cheaper"
    if reason in ("never", "short", "local_cheaper"):
        return Pair(agg.engine, None, reason, local, remote, move_us, move_bytes, uncached, agg.node, agg.node,
                    tuple(c.engine for _, _, c in ranked), agg_order)
    prefill_order = (p.engine, *(c.engine for _, _, c in ranked if c.engine != p.engine))
    return Pair(d.engine, p.engine, reason, local, remote, move_us, move_bytes, uncached, p.node, d.node,
                prefill_order, tuple(m[1] for m in moves))


class NoDecodeEngine(CommandError):
    """A request whose model has engines, none of which can decode (all prefill-only)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"no decode-capable engine serves model {model!r}: its engines are all prefill engines "
                         "(role = \"prefill\"); register one with role \"decode\" or \"both\"")
        self.model = model
