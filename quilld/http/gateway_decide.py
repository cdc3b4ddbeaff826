"""The third stage of a gateway request: the decision, which engine (or pair of engines) serves it.

For each family of the model's engines, the prompt's blocks (gateway_prompt.py) are scored by
the control plane's router (in a cluster, over the residencies the directory's owners give),
and the attempt goes to the best engine: healthy before cooling, the router's pick, then by
cost. Prefill engines (role prefill) never answer a request themselves, and a model with only
those is a 503 (`no_decode_engine`). An engine taken instead of the router's pick (it failed
or cools down) gets its own cost and plan, and the request is served by it alone.

A decision that pairs a prefill engine with a decode engine is carried out by a relay strategy
(kv_handoff.py); the decisions it needs on the way are made here too: the decode engine's own
decision for each decode attempt (`decode_decision`), and the decision for the decode engine
alone when no prefill engine answered (`alone`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace
from typing import Any

from quilld.config import EngineConfig
from quilld.http.gateway_engines import EngineBook
from quilld.http.gateway_prompt import Prompt
from quilld.http.gateway_request import ApiError, Parsed
from quilld.http.gateway_upstream import Choice
from quilld.http.prompt_blocks import Family, family
from quilld.index.control import ControlPlane
from quilld.index.pairing import NoDecodeEngine
from quilld.index.router import Candidate, Decision


class Decider:
    def __init__(self, control: ControlPlane, node: Any, book: EngineBook) -> None:
        self.control = control
        self.node = node  # its `cluster`, once the node has joined one
        self.book = book

    async def choose(self, req: Parsed, prompt: Prompt, tried: set[str]) -> Choice | None:
        """The next engine to try (None when none is left): healthy before cooling, the router's pick,
        then by cost. Only the first attempt (nothing `tried`) keeps a session or splits a pair."""
        groups: dict[Family, set[str]] = defaultdict(set)
        served = self.control.engines.for_model(req.model)
        for e in served:
            if e.id not in tried and e.role != "prefill":
                groups[family(e)].add(e.id)
        if served and all(e.role == "prefill" for e in served):
            raise ApiError(503, NoDecodeEngine(req.model).message, "service_unavailable", "no_decode_engine",
                           counter="unavailable")
        now = time.monotonic()
        best: tuple | None = None
        for fam, ids in groups.items():
            blocks = await prompt.blocks(fam)
            scope, tag = prompt.scope_tag(fam, blocks)
            per_block = prompt.tokens_per_block(fam)
            cluster = self.node.cluster  # in a cluster, the blocks' residencies from the directory's owners
            view = None if cluster is None else await cluster.route_view(tag, blocks)
            d = self.control.route(scope, tag, blocks, req.decode_tokens / per_block,
                                   session=None if tried else req.session,  # a retry may leave it
                                   block_tokens=per_block, view=view)
            split = not tried and is_split(d)  # the relay strategy orders the pair's engines itself
            for c in d.candidates:
                if c.engine not in ids:
                    continue
                cooling = self.book.is_cooling(c.engine, now) and not (split and c.engine == d.engine)
                key = (cooling, c.engine != d.engine, c.cost, c.engine)
                if best is None or key < best[0]:
                    best = (key, c, d, tag, blocks, per_block, view)
        if best is None:
            return None
        _, c, d, tag, blocks, per_block, view = best
        engine = self.control.engines.get(c.engine)
        if c.engine != d.engine:  # not the router's pick (it failed or cools down)
            d = self.decision_for(engine, c, d, tag, blocks, view)
        uncached = int(round(max(0.0, len(blocks) - c.credit) * per_block))
        return Choice(engine, d, tag, blocks, uncached, prompt.body_for(blocks))

    def decision_for(self, engine: EngineConfig, c: Candidate, d: Decision, tag: bytes,
                     blocks: list[int], view=None) -> Decision:
        """Decision `d` with `engine` (its candidate `c`) chosen instead: `c`'s cost and the engine's own plan
        (and, with roles, the engine alone: it prefills and decodes)."""
        pair = None if d.pair is None else replace(d.pair, decode=engine.id, prefill=None, prefill_url=None,
                                                   prefill_lease=None)
        return Decision(engine.id, c.cost, d.candidates, self.control.plan_for(engine.id, tag, blocks, view),
                        engine.url, None, pair)

    def alone(self, choice: Choice, fallback: str) -> Choice:
        """A split `choice` served by its decode engine alone (no prefill engine answered): its own plan,
        the pair without a prefill, `fallback` saying why."""
        d = choice.decision
        alone = replace(d.pair, prefill=None, prefill_url=None, prefill_lease=None)
        plan = self.control.plan_for(choice.engine.id, choice.tag, choice.blocks)
        return replace(choice, decision=Decision(d.engine, d.cost, d.candidates, plan, d.url, None, alone),
                       fallback=fallback)


def is_split(d: Decision) -> bool:
    """Whether decision `d` pairs a prefill engine with another that decodes."""
    return d.pair is not None and d.pair.prefill is not None


def decode_decision(d: Decision, engine: EngineConfig, prefill: EngineConfig, decode_node: str) -> Decision:
    """A split decision `d` as one decode attempt carries it out: `engine` decodes (at its own cost),
    on node `decode_node`, what `prefill` prefilled; the plan stays the prefill engine's."""
    cost = next((c.cost for c in d.candidates if c.engine == engine.id), d.cost)
    return Decision(engine.id, cost, d.candidates, d.plan, engine.url, None,
                    replace(d.pair, decode=engine.id, prefill=prefill.id, prefill_url=prefill.url,
                            prefill_lease=None, decode_node=decode_node))


def uncached_tokens(d: Decision, engine_id: str, blocks: int, block_tokens: float) -> int:
    """The prompt's tokens `engine_id` cannot reuse, by its candidate's credit in `d`."""
    for c in d.candidates:
        if c.engine == engine_id:
            return int(round(max(0.0, blocks - c.credit) * block_tokens))
    return int(blocks * block_tokens)
