"""A request's prompt as the engine's own block hashes, for engines that name their hashing.

An engine whose `tokenizer` names a Hugging Face tokenizer directory and whose
`prefix_caching_hash_algo` is set belongs to an `EngineFamily` (directory, algo, seed,
block size): for it the gateway turns the request into the token ids vLLM's OpenAI server
feeds its engine (quilld/index/chat_render.py: a chat rendered with the model's template, a
completions prompt tokenized with its special tokens), hashes their full blocks as vLLM's
prefix cache does (quilld/index/engine_hashes.py) and gives each hash in the form the engine's
`BlockStored` events carry it by default: the digest's low 64 bits as an int
(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1). The residency index keys those events' hashes as
unsigned 64-bit ints (index/residency.py `entry_key`), so a ROUTE over these hashes, in the
engine's scope, finds exactly the blocks the events recorded.

The identity guard reaches into the engine through `cache_salt`: a request of another identity
than the engine's `tenant` is sent with a salt derived from its scope (`salt_for`: an
HMAC-SHA256 under the cluster's secret, so no one outside can guess it and every node of the
cluster derives the same one), and its hashes include that salt on block 0 as vLLM's do, so it
is credited only for blocks cached under its own salt. A request of the engine's own tenant
goes as it came.

Not covered (`NotCovered`: the caller falls back to its own hashing, quilld/http/prompt_blocks.py):
requests with `tools`, `documents` or a request-level `chat_template`, multimodal content, a
chat's `add_special_tokens=true`, requests for a LoRA adapter the engine's `lora_modules` does not
name (vLLM's hash includes the path it loads the adapter from). An engine whose events carry whole
digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) says so with `kv_event_hashes = "bytes"`, and its
hashes are given as digest bytes, as the residency index keys them. Rendering, tokenizing and hashing run off the event loop
(`hashes` is sync: the gateway calls it in a thread); each directory is loaded once (chat_render.load).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from quilld.config import EngineConfig
from quilld.errors import CommandError
from quilld.index.engine_hashes import EngineHashing, Lora
from quilld.model import IdentityScope

SALT_CONTEXT = b"quilld cache_salt v1\0"  # domain separation: the cluster secret keys other MACs too


class NotCovered(CommandError):
    """A request (or an engine) whose engine hashes quilld does not reproduce."""


@dataclass(frozen=True)
class EngineFamily:
    """Engines whose prompts hash alike: one tokenizer directory, algo, seed and block size."""

    directory: str
    algo: str
    hash_seed: str | None = field(repr=False)  # a secret: never in a repr, a log or an answer
    block_size: int
    lora_modules: tuple[tuple[str, str], ...] = ()  # (adapter name, its load path): part of a LoRA block's hash
    int_hashes: bool = True  # the form the engines' events give hashes in: ints (the default) or digest bytes


def engine_family(engine: EngineConfig) -> EngineFamily | None:
    """The engine's hashing family; None when it names no algo or no tokenizer directory."""
    tok = engine.tokenizer
    if not engine.prefix_caching_hash_algo or not tok or tok.endswith(".json"):
        return None
    return EngineFamily(tok, engine.prefix_caching_hash_algo, engine.hash_seed or None, engine.block_size,
                        engine.lora_modules, engine.kv_event_hashes == "int")


def model_family(engines: Sequence[EngineConfig], model: str) -> tuple[EngineFamily | None, str]:
    """The one way the engines of `model` hash their blocks, and their tenant: (None, "") when none
    names its own hashing; CommandError when they hash (or partition their cache) in more than one."""
    found = {(fam, e.tenant): e.id for e in engines if (fam := engine_family(e)) is not None}
    if not found:
        return None, ""
    if len(found) > 1:
        ways = "; ".join(f"{eid}: {fam.directory} {fam.algo} block_size {fam.block_size} tenant {tenant}"
                         f" hash_seed {'set' if fam.hash_seed else 'unset'} lora_modules {len(fam.lora_modules)}"
                         for (fam, tenant), eid in sorted(found.items(), key=lambda kv: kv[1]))
        raise CommandError(f"the engines of model {model!r} hash their blocks in {len(found)} ways ({ways}): "
                           f"register them alike")
    (fam, tenant), = found
    return fam, tenant


def salt_for(secret: bytes, scope: IdentityScope) -> str:
    """The `cache_salt` of requests of `scope`: keyed by the cluster's secret, stable across its nodes."""
    msg = SALT_CONTEXT + json.dumps(list(scope), ensure_ascii=False).encode("utf-8", "surrogatepass")
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def caller_salt(salt_key: Callable[[], bytes], engines_tenant: str, scope: IdentityScope,
                directory: str) -> str | None:
    """The cache_salt a request of `scope` carries to engines of `engines_tenant` whose tokenizer
    is `directory` (the gateway's and ROUTE's alike): None for the engines' own tenant (it goes as
    it came), else its scope's own partition of their prefix cache."""
    if scope.tenant == engines_tenant:
        return None
    return salt_for(salt_key(), IdentityScope(scope.tenant, scope.model, directory, scope.adapter))


_CHAT_UNCOVERED = ("tools", "documents", "chat_template")


def token_ids(directory: str, path_is_chat: bool, body: Mapping[str, Any]) -> list[int]:
    """The request's token ids as vLLM's OpenAI server computes them (sync: call it off the loop)."""
    from quilld.index import chat_render  # the gateway extra (jinja2): only for engines that need it

    try:
        tok = chat_render.load(directory)
    except chat_render.TemplateUnavailable as e:
        if path_is_chat or not os.path.isfile(os.path.join(directory, "tokenizer.json")):
            raise NotCovered(e.message) from None
        tok = None  # a completions-only directory: its tokenizer.json alone
    if path_is_chat:
        if bad := [k for k in _CHAT_UNCOVERED if body.get(k)]:
            raise NotCovered(f"chat requests with {', '.join(bad)} are not rendered by quilld yet")
        if body.get("add_special_tokens") is True:
            raise NotCovered("a chat's add_special_tokens=true is not reproduced yet")
        kwargs = body.get("chat_template_kwargs")
        try:
            return tok.chat_token_ids(body["messages"], add_generation_prompt=body.get("add_generation_prompt", True)
                                      is not False, continue_final_message=body.get("continue_final_message") is True,
                                      chat_template_kwargs=kwargs if isinstance(kwargs, Mapping) else None)
        except (chat_render.NotCovered, chat_render.TemplateRejected) as e:
            raise NotCovered(e.message) from None
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch is routed by its first prompt
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    special = body.get("add_special_tokens", True) is not False
    if tok is None:
        from tokenizers import Tokenizer
        return chat_render.encode(_plain_tokenizer(directory, Tokenizer), prompt, special)
    return tok.prompt_token_ids(prompt, add_special_tokens=special)


_PLAIN: dict[str, Any] = {}


def _plain_tokenizer(directory: str, cls: Any) -> Any:
    tok = _PLAIN.get(directory)
    if tok is None:
        try:
            tok = _PLAIN[directory] = cls.from_file(os.path.join(directory, "tokenizer.json"))
        except Exception as e:  # the Rust side raises plain Exception for an invalid file
            raise NotCovered(f"{directory}/tokenizer.json: {e}") from None
    return tok


class EngineBlocks(list):
    """A prompt's blocks in an engine's own hashes (scored in the engine's scope), with the
    `cache_salt` they were computed with (None: the request goes as it came)."""

    salt: str | None = None


class EnginePrompts:
    """Engine block hashes per family; the hashing of each family is set up once."""

    def __init__(self) -> None:
        self._hashing: dict[EngineFamily, EngineHashing] = {}

    def hashing(self, fam: EngineFamily) -> EngineHashing:
        h = self._hashing.get(fam)
        if h is None:
            try:
                h = EngineHashing(fam.algo, fam.hash_seed, fam.block_size)
            except Exception as e:  # SeedUnknown, a bad algo: the engine's config, said by the caller once
                raise NotCovered(str(e)) from None
            self._hashing[fam] = h
        return h

    def hashes(self, fam: EngineFamily, path_is_chat: bool, body: Mapping[str, Any],
               cache_salt: str | None, adapter: str = "") -> EngineBlocks:
        """The request's full blocks as the engine's events name them, for LoRA `adapter` ("" for the
        base model), sync: call it off the loop."""
        hashing = self.hashing(fam)
        lora = None
        if adapter:
            path = dict(fam.lora_modules).get(adapter)
            if path is None:
                raise NotCovered(f"LoRA adapter {adapter!r}: vLLM's hash of its blocks includes the path the engine "
                                 f"loads it from; name it in the engine's lora_modules")
            lora = Lora(adapter, path)
        ids = token_ids(fam.directory, path_is_chat, body)
        form = fam.int_hashes
        out = EngineBlocks(h.event_form(form) for h in hashing.block_hashes(ids, lora=lora, cache_salt=cache_salt))
        out.salt = cache_salt
        return out
