"""The second stage of a gateway request: its prompt in each engine family's tokens and block hashes.

A family (prompt_blocks.Family) is what engines that hash a prompt alike share. For a family
that names its engines' own hashing (a tokenizer directory and a `prefix_caching_hash_algo`),
the request is rendered, tokenized and hashed as the engine does it, off the event loop
(quilld/index/engine_prompts.py), with the request's `cache_salt` when its identity is not
the engines' own; what that does not cover (`NotCovered`) falls back, counted and logged once
per family, to quilld's own prompt hashes (prompt_blocks.py), which every other family uses.

`Prompt` is one request's prompt: each family's blocks are computed the first time a stage
asks for them and kept for the request's later stages and attempts (a decode engine of the
prefill's family is never hashed twice). Its scope tag says where those blocks are looked up
and recorded: the engines' own scope for their own hashes (whose events record them there),
else the request's identity scope.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Callable

from quilld.http.gateway_request import CHAT, Parsed
from quilld.http.prompt_blocks import Family, PromptHasher
from quilld.index.engine_prompts import EngineBlocks, EnginePrompts, NotCovered, caller_salt
from quilld.model import IdentityScope
from quilld.scopes import ScopeLimit, ScopeRegistry

log = logging.getLogger("quilld.gateway")


class PromptHashing:
    """How the gateway hashes prompts: one per gateway, its tokenizers and templates loaded once."""

    def __init__(self, chunk_chars: int, engine_prompts: EnginePrompts, scopes: ScopeRegistry,
                 salt_key: Callable[[], bytes], counts: Counter) -> None:
        self.hasher = PromptHasher(chunk_chars)
        self.engine_prompts = engine_prompts  # engines' own block hashes (engine_prompts.py)
        self.scopes = scopes
        self.salt_key = salt_key  # the cluster's secret the cache_salt is derived under
        self.counts = counts  # the gateway's counters (gateway_stats.py)
        self._fallback_said: set = set()  # engine families whose first fallback was logged

    def prompt(self, req: Parsed) -> Prompt:
        return Prompt(self, req)

    def tokens_per_block(self, fam: Family) -> float:
        return self.hasher.tokens_per_block(fam)

    async def family_blocks(self, req: Parsed, fam: Family) -> list[int]:
        """`req`'s prompt as block hashes for engines of `fam`: theirs where covered, else quilld's own."""
        blocks = None
        if fam.hashing is not None:
            blocks = await self._engine_blocks(req, fam)
        if blocks is None:
            blocks = await self.hasher.blocks(req.prompt, fam)
        return blocks

    async def _engine_blocks(self, req: Parsed, fam: Family) -> EngineBlocks | None:
        """The prompt in the engines' own block hashes, computed off the loop; None when not covered."""
        salt = caller_salt(self.salt_key, fam.tenant, IdentityScope(req.tenant, req.model, "", req.adapter),
                           fam.tokenizer)
        try:
            blocks = await asyncio.to_thread(self.engine_prompts.hashes, fam.hashing, req.path == CHAT,
                                             req.fields, salt, req.adapter)
        except NotCovered as e:
            self.counts["engine_hash_fallbacks"] += 1
            if fam.hashing not in self._fallback_said:
                self._fallback_said.add(fam.hashing)
                log.warning("gateway: %s: routing on quilld's own prompt hashes instead of the engine's (%s); "
                            "said once per engine family", fam.tokenizer, e.message)
            return None
        self.counts["engine_hashed"] += 1
        return blocks


class Prompt:
    """One request's prompt, hashed per engine family when a stage first asks (PromptHashing)."""

    __slots__ = ("req", "_hashing", "_blocks")

    def __init__(self, hashing: PromptHashing, req: Parsed) -> None:
        self.req = req
        self._hashing = hashing
        self._blocks: dict[Family, list[int]] = {}

    async def blocks(self, fam: Family) -> list[int]:
        blocks = self._blocks.get(fam)
        if blocks is None:
            blocks = self._blocks[fam] = await self._hashing.family_blocks(self.req, fam)
        return blocks

    def scope_tag(self, fam: Family, blocks: list[int]) -> tuple[IdentityScope, bytes]:
        """The request's identity for engines of family `fam`, and the scope tag its `blocks` are
        looked up and recorded under: the engines' own scope for their own hashes (a request of
        another identity is salted, engine_prompts.py), else the request's."""
        req, scopes = self.req, self._hashing.scopes
        scope = IdentityScope(req.tenant, req.model, fam.tokenizer, req.adapter)
        if isinstance(blocks, EngineBlocks):  # where the engines' KV events record them
            return scope, scopes.tag(IdentityScope(fam.tenant, req.model, fam.tokenizer, req.adapter))
        try:
            return scope, scopes.tag(scope, capped=True)
        except ScopeLimit:  # over the tenant's cap: routed without this scope's cache, nothing recorded
            return scope, scopes.find(scope)

    def tag(self, fam: Family, blocks: list[int]) -> bytes:
        return self.scope_tag(fam, blocks)[1]

    def tokens_per_block(self, fam: Family) -> float:
        return self._hashing.tokens_per_block(fam)

    def body_for(self, blocks: list[int]) -> bytes | None:
        """The body sent to an engine for `blocks`: the request's with their cache_salt; None: as it is."""
        salt = getattr(blocks, "salt", None)
        if salt is None:
            return None
        body = json.loads(self.req.body)
        body["cache_salt"] = salt
        return json.dumps(body).encode()
