"""A ROUTE request, typed: its fields, their checks and limits, and routing it in a caller's scope.

RESP (`ROUTE {json}` or `ROUTE key value ...`) and the admin API
(`POST /v1/route`) both turn what they received into a mapping of field name
to value and hand it to `RouteRequest.parse`; the caller's identity (scope and
tag) is theirs to supply. Fields:

- `blocks`: engine block hashes (ints, or decimal or hex strings), or
- `tokens` (+ `block_size`, default 16): token ids, hashed into blocks as `hashing` says;
- `hashing`: how `tokens` (or a `prompt` or chat `messages`) become block hashes:
  - `quilld`: chained with `chain_hashes` in blocks of `block_size`, as quilld's
    clients and gateway hash them;
  - `engine`: as the model's engines hash them themselves (index/engine_prompts.py: a
    tokenizer directory and `prefix_caching_hash_algo`, vLLM's prefix-cache hashes), and
    looked up where their KV events record them, the engines' own scope; a caller of
    another tenant than the engines' is given the `cache_salt` (`EngineRoute.salt`) it
    must send the engine with the request, and its hashes include it, as the gateway's do;
  - `auto` (the default): `engine` when the model's engines name their hashing, else
    `quilld`;
- `messages` (a chat, with `add_generation_prompt`, `continue_final_message`,
  `chat_template_kwargs`) or `prompt` (text, with `add_special_tokens`): rendered and
  tokenized as vLLM's OpenAI server does, for `engine` hashing only;
- `decode_tokens`: the tokens the request may generate (counted in blocks);
- `session`: requests of one session stay on one engine while it is eligible;
- `acquire`: 1/true/yes takes an in-flight lease on the chosen engine (and, for a
  disaggregated pair, a prefill lease on the prefill engine).

When the model's engines have roles, the decision carries the prefill-decode pair
(index/pairing.py); a model whose engines are all prefill engines is an error
(`NoDecodeEngine`).

Errors are `CommandError`s (ERR on RESP, 400 on HTTP) with stable texts.

RESP also takes the hashes alone, with no JSON to decode: as decimal (or hex)
arguments (`hashes_from_args`) or as one bulk of packed little-endian unsigned
64-bit ints (`hashes_from_packed`); the protocol turns its option words into the
other fields and builds the `RouteRequest` itself.
"""

from __future__ import annotations

import asyncio
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from quilld.errors import CommandError
from quilld.index.control import ControlPlane, chain_hashes
from quilld.index.engine_prompts import NotCovered, caller_salt, model_family
from quilld.index.residency import BlockHash
from quilld.index.router import Decision
from quilld.model import IdentityScope

# At most this many blocks per request: 1M tokens in blocks of 16, beyond any context
# window; the score walks every block for every engine.
MAX_BLOCKS = 1 << 16
# At most this many bytes in one argument of a ROUTE (its JSON, a PACKED bulk, a list of key
# value pairs): 65,536 hashes in any form fit, and so do some 200,000 token ids; a longer prompt
# is hashed by the client (ROUTE PACKED). Refused before it is read: nothing larger is decoded.
MAX_REQUEST_BYTES = 2 * 1024 * 1024
# A request with more bytes than this is decoded, checked and hashed in a worker thread, off the
# event loop (the walk is Python: the interpreter lets the loop run every few milliseconds).
LARGE_REQUEST = 64 * 1024
DEFAULT_BLOCK_SIZE = 16
MAX_TOKEN = (1 << 32) - 1  # chain_hashes packs each token id in 4 bytes
PROMPT_FIELDS = ("messages", "prompt", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                 "add_special_tokens")  # what engine_prompts.token_ids reads of a request
FIELDS = frozenset({"blocks", "tokens", "block_size", "decode_tokens", "session", "acquire", "hashing",
                    *PROMPT_FIELDS})
HASHINGS = ("auto", "quilld", "engine")
_YES = ("1", "true", "yes")
_NOT_INTEGERS = "ROUTE: tokens, block_size and decode_tokens must be integers"


def parse_block_hash(v: Any) -> BlockHash:
    """An engine block hash from a request: an int, or a decimal or hex string."""
    if isinstance(v, bool):
        raise CommandError("block hashes are integers or hex strings")
    if isinstance(v, int):
        if -(1 << 63) <= v < 1 << 64:
            return v
        raise CommandError("block hashes that are integers must fit in 64 bits")
    if isinstance(v, str):
        s = v.strip()
        if _DECIMAL.fullmatch(s):  # ASCII digits only ("²" is a digit to str.isdigit), at most 20 of them
            value = int(s)
            if -(1 << 63) <= value < 1 << 64:
                return value
            raise CommandError("block hashes that are integers must fit in 64 bits")
        try:
            return bytes.fromhex(s.removeprefix("0x"))
        except ValueError:
            pass
    shown = repr(v) if len(repr(v)) <= 80 else repr(v)[:77] + "..."
    raise CommandError(f"bad block hash {shown}: an integer or a hex string")


_DECIMAL = re.compile(r"-?[0-9]{1,20}")
_U64 = (1 << 64) - 1
_INTS = {int}


def hashes_from_args(args: list[bytes]) -> list[BlockHash]:
    """Block hashes given one per argument: unsigned decimals (the fast path, checked in C),
    else each as `parse_block_hash` takes a string (signed decimal or hex)."""
    if not args:
        return []
    joined = b"".join(args)
    if joined.isdigit() and min(map(len, args)) >= 1 and max(map(len, args)) <= 20:  # ASCII digits only
        values = list(map(int, args))
        if max(values) <= _U64:
            return values
    out = []
    for i, raw in enumerate(args):
        try:
            s = bytes(raw).decode("ascii")
        except UnicodeDecodeError:
            s = None
        if not s or not s.strip():
            raise CommandError(f"ROUTE: hash {i + 1} is not an integer or a hex string")
        try:
            out.append(parse_block_hash(s))
        except CommandError as e:
            raise CommandError(f"ROUTE: hash {i + 1}: {e.message}") from None
    return out


def hashes_from_packed(data: bytes) -> list[int]:
    """Block hashes packed as little-endian unsigned 64-bit ints, 8 bytes each."""
    n, rest = divmod(len(data), 8)
    if rest:
        raise CommandError(f"ROUTE PACKED: {len(data)} bytes is not a whole number of 8-byte hashes")
    if n > MAX_BLOCKS:
        raise CommandError(f"ROUTE: at most {MAX_BLOCKS} blocks")
    return list(struct.unpack(f"<{n}Q", data))


@dataclass(frozen=True, slots=True)
class RouteRequest:
    blocks: list[BlockHash]  # never mutated once parsed
    block_size: int = DEFAULT_BLOCK_SIZE
    decode_tokens: int = 0
    session: str | None = None
    acquire: bool = False
    # the prompt still to be hashed by the model's engines' own hashing (`engine_route`): the
    # request's prompt fields, `tokens` as a `prompt` of ids; None when `blocks` are final
    prompt: dict[str, Any] | None = None
    block_size_given: bool = False  # `block_size` was in the request (it must then be the engines')
    hashing: str = "quilld"  # with a prompt: "engine" or "auto" (quilld's chain when the engines name none)

    @property
    def decode_blocks(self) -> float:
        """The decode tokens in blocks, as the cost function counts them."""
        return self.decode_tokens / max(self.block_size, 1)

    @classmethod
    def parse(cls, req: Mapping[str, Any]) -> RouteRequest:
        """Check a request's fields (from JSON, or RESP key value pairs as strings)."""
        unknown = set(req) - FIELDS
        if unknown:
            raise CommandError(f"ROUTE: unknown field(s) {', '.join(sorted(unknown))}")
        hashing = str(req.get("hashing", "auto")).lower()
        if hashing not in HASHINGS:
            raise CommandError(f"ROUTE: hashing must be one of {', '.join(HASHINGS)}, got {req['hashing']!r:.40}")
        if "messages" in req or "prompt" in req:
            return cls._text(req, hashing)
        if hashing == "engine" and "tokens" not in req:
            raise CommandError("ROUTE: with hashing engine, one of tokens, messages or prompt"
                               + (" (blocks are hashes already)" if "blocks" in req else ""))
        try:
            block_size = int(req.get("block_size", DEFAULT_BLOCK_SIZE))
            if "tokens" in req:
                if block_size <= 0:
                    raise ValueError("block_size")
                if _count(req["tokens"]) // block_size > MAX_BLOCKS:  # checked before walking them
                    raise CommandError(f"ROUTE: at most {MAX_BLOCKS} blocks")
                tokens = [int(t) for t in req["tokens"]]
                blocks = None
            else:
                tokens = None
                raw = req.get("blocks", [])
                if _count(raw) > MAX_BLOCKS:
                    raise CommandError(f"ROUTE: at most {MAX_BLOCKS} blocks")
                if type(raw) is list and raw and set(map(type, raw)) == _INTS and \
                        min(raw) >= -(1 << 63) and max(raw) <= _U64:  # JSON's ints, checked in C
                    blocks = list(raw)
                else:
                    blocks = [parse_block_hash(h) for h in raw]
            decode = int(req.get("decode_tokens", 0))
        except (TypeError, ValueError):
            raise CommandError(_NOT_INTEGERS) from None
        if tokens is not None:
            if not all(0 <= t <= MAX_TOKEN for t in tokens):
                raise CommandError(f"ROUTE: tokens must be integers from 0 to {MAX_TOKEN}")
            if hashing != "quilld":  # hashed once the model's engines are known (engine_route)
                return cls([], block_size, decode, *_session_acquire(req), prompt={"prompt": tokens},
                           block_size_given="block_size" in req, hashing=hashing)
            blocks = chain_hashes(tokens, block_size)
        if len(blocks) > MAX_BLOCKS:
            raise CommandError(f"ROUTE: at most {MAX_BLOCKS} blocks")
        return cls(blocks, block_size, decode, *_session_acquire(req))

    @classmethod
    def _text(cls, req: Mapping[str, Any], hashing: str) -> RouteRequest:
        """A chat's `messages` or a `prompt`: rendered and tokenized as the model's engines do, then
        hashed their way (`engine_route`)."""
        if hashing == "quilld":
            raise CommandError("ROUTE: messages and prompt are hashed only as the engines hash them "
                               "(hashing engine or auto); with hashing quilld, send tokens")
        given = [k for k in ("blocks", "tokens", "messages", "prompt") if k in req]
        if len(given) != 1:
            raise CommandError(f"ROUTE: one of tokens, messages or prompt ({', '.join(given)} given)")
        if "messages" in req and not (isinstance(req["messages"], list) and req["messages"]):
            raise CommandError("ROUTE: messages must be a non-empty list of chat messages")
        if "prompt" in req and not isinstance(req["prompt"], str):
            raise CommandError("ROUTE: prompt must be a string (send token ids as tokens)")
        try:
            block_size = int(req.get("block_size", DEFAULT_BLOCK_SIZE))
            decode = int(req.get("decode_tokens", 0))
        except (TypeError, ValueError):
            raise CommandError(_NOT_INTEGERS) from None
        prompt = {k: req[k] for k in PROMPT_FIELDS if k in req}
        return cls([], block_size, decode, *_session_acquire(req), prompt=prompt, block_size_given="block_size" in req,
                   hashing=hashing)


def _session_acquire(req: Mapping[str, Any]) -> tuple[str | None, bool]:
    session = req.get("session") or None
    return str(session) if session else None, str(req.get("acquire", "")).lower() in _YES


def _count(items: Any) -> int:
    """How many items a request's list holds (0 for what is not a list: its walk refuses it)."""
    return len(items) if isinstance(items, (list, tuple)) else 0


@dataclass(frozen=True, slots=True)
class EngineRoute:
    """A request hashed by its engines' own hashing: the scope tag their KV events record blocks
    under, the request with its blocks, and the cache_salt the caller must send the engine (None:
    the caller is of the engines' tenant and sends the request as it is)."""

    tag: bytes
    req: RouteRequest
    salt: str | None


def needs_engine_hashing(req: RouteRequest) -> bool:
    return req.prompt is not None


INLINE_TOKENS = 4096  # a longer `tokens` list is chained off the event loop


async def engine_route(control: ControlPlane, scope: IdentityScope, tag: bytes, req: RouteRequest,
                       salt_key: Callable[[], bytes]) -> EngineRoute:
    """`req`'s prompt hashed as the engines of `scope.model` hash it: their family and the scope
    tag on the loop, the rendering, tokenizing and hashing in a worker thread. A `tokens` request
    of `hashing auto` whose model's engines name no hashing of their own is chained with quilld's
    `chain_hashes` instead, in the caller's scope (`tag`)."""
    fam, tenant = model_family(control.engines.for_model(scope.model), scope.model)
    prompt = req.prompt
    if fam is None:
        if req.hashing == "engine" or "messages" in prompt or isinstance(prompt.get("prompt"), str):
            raise NotCovered(f"ROUTE: no engine of model {scope.model!r} names its own hashing (a tokenizer "
                             f"directory and prefix_caching_hash_algo): send tokens, hashed with hashing quilld")
        tokens = prompt["prompt"]
        blocks = (chain_hashes(tokens, req.block_size) if len(tokens) <= INLINE_TOKENS
                  else await asyncio.to_thread(chain_hashes, tokens, req.block_size))
        if len(blocks) > MAX_BLOCKS:
            raise CommandError(f"ROUTE: at most {MAX_BLOCKS} blocks")
        return EngineRoute(tag, replace(req, blocks=blocks, prompt=None), None)
    if req.block_size_given and req.block_size != fam.block_size:
        raise CommandError(f"ROUTE: block_size {req.block_size}: the engines of model {scope.model!r} hash blocks "
                           f"of {fam.block_size} tokens (leave block_size out)")
    salt = caller_salt(salt_key, tenant, scope, fam.directory)
    blocks = await asyncio.to_thread(control.engine_prompts.hashes, fam, "messages" in prompt, prompt, salt,
                                     scope.adapter)
    if len(blocks) > MAX_BLOCKS:
        raise CommandError(f"ROUTE: at most {MAX_BLOCKS} blocks")
    engines_tag = control.scopes.tag(IdentityScope(tenant, scope.model, fam.directory, scope.adapter))
    return EngineRoute(engines_tag, replace(req, blocks=list(blocks), block_size=fam.block_size, prompt=None), salt)


def route(control: ControlPlane, scope: IdentityScope, tag: bytes, req: RouteRequest) -> Decision:
    """Route `req` for a caller of `scope` (whose scope tag is `tag`)."""
    return control.route(scope, tag, req.blocks, req.decode_blocks, req.session, req.acquire,
                         float(max(req.block_size, 1)))
