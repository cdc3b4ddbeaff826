"""A request's prompt as prefix-preserving block hashes, as the gateway routes it.

Two ways, chosen per engine:

- the engine's `tokenizer` names a `tokenizer.json` file (the value ends in
  `.json`): the prompt is encoded with it (the `tokenizers` package, loaded
  lazily, one instance per path) and the ids are hashed in blocks of the
  engine's `block_size` with `quilld.index.control.chain_hashes`, exactly as a
  ROUTE with `tokens` would be;
- otherwise the rendered prompt is cut into `chunk_chars`-character pieces and
  the full pieces are chained with xxhash the same way (each hash covers the
  previous one), so two prompts that share their first N characters share
  their first N // chunk_chars blocks.

A completions prompt given as token ids is hashed as ids either way. Chat
messages are rendered deterministically (`<|role|>` line, content, newline;
non-text content parts as canonical JSON), so a shared system prompt is a
shared leading run of blocks. These hashes are quilld's own, not the engine's
internal ones (see quilld/index/control.py): for an engine that names its tokenizer directory
and hash algo the gateway uses the engine's own (quilld/index/engine_prompts.py) and falls back
to these only for what that does not cover.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, NamedTuple

import xxhash

from quilld.config import EngineConfig
from quilld.index.engine_prompts import EngineFamily, engine_family
from quilld.index.control import chain_hashes

INLINE_ENCODE_CHARS = 16_384  # longer prompts are tokenized off the event loop


class TokenizerUnavailable(Exception):
    """An engine names a tokenizer.json that cannot be loaded."""


class Family(NamedTuple):
    """Engines whose prompts hash alike: the same tokenizer and block size (and, for engines that
    name their own hashing, the same hashing and tenant: quilld/index/engine_prompts.py)."""

    tokenizer: str
    block_size: int
    tokenize: bool  # the tokenizer is a tokenizer.json to encode with; else character chunks
    hashing: EngineFamily | None = None  # the engine's own block hashes, tried before these
    tenant: str = ""  # the engines' tenant, with `hashing` (whose requests go without a cache_salt)


def family(engine: EngineConfig) -> Family:
    hashing = engine_family(engine)
    return Family(engine.tokenizer, engine.block_size, is_tokenizer_file(engine.tokenizer), hashing,
                  engine.tenant if hashing is not None else "")


def is_tokenizer_file(tokenizer: str) -> bool:
    return tokenizer.endswith(".json")


def _part_text(part: Any) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    return json.dumps(part, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def render_chat(messages: list[dict[str, Any]]) -> str:
    """The chat prompt as one deterministic string, growing only at its end as messages are added."""
    out = []
    for m in messages:
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            text = "".join(_part_text(p) for p in content)
        else:
            text = _part_text(content)
        name = m.get("name")
        head = f"<|{m.get('role', '')}|>" + (f" {name}" if isinstance(name, str) and name else "")
        out.append(f"{head}\n{text}\n")
        if m.get("tool_calls"):
            out.append(_part_text(m["tool_calls"]) + "\n")
    return "".join(out)


def completion_prompt(prompt: Any) -> str | list[int]:
    """A completions `prompt` (text, token ids, or a batch of either): the one to route by.

    A batch is routed by its first prompt.
    """
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    return [int(t) for t in prompt]


def chunk_hashes(text: str, chunk_chars: int) -> list[int]:
    """Chained xxhash of the full `chunk_chars`-character pieces of `text`."""
    out, prev = [], b""
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        h = xxhash.xxh64(prev)
        h.update(text[start:start + chunk_chars].encode("utf-8", "surrogatepass"))
        value = h.intdigest()
        out.append(value)
        prev = value.to_bytes(8, "big")
    return out


class PromptHasher:
    def __init__(self, chunk_chars: int) -> None:
        self.chunk_chars = chunk_chars
        self._tokenizers: dict[str, Any] = {}

    async def _tokenizer(self, path: str) -> Any:
        tok = self._tokenizers.get(path)
        if tok is None:
            tok = self._tokenizers[path] = await asyncio.to_thread(_load_tokenizer, path)
        return tok

    async def blocks(self, prompt: str | list[int], fam: Family) -> list[int]:
        """The block hashes of `prompt` for engines of family `fam`."""
        if isinstance(prompt, list):
            return chain_hashes(prompt, fam.block_size)
        if not fam.tokenize:
            return chunk_hashes(prompt, self.chunk_chars)
        tok = await self._tokenizer(fam.tokenizer)
        if len(prompt) <= INLINE_ENCODE_CHARS:
            ids = tok.encode(prompt, add_special_tokens=False).ids
        else:
            ids = (await asyncio.to_thread(tok.encode, prompt, add_special_tokens=False)).ids
        return chain_hashes(ids, fam.block_size)

    def tokens_per_block(self, fam: Family) -> float:
        """Tokens one block stands for (about 4 characters a token in character mode)."""
        return fam.block_size if fam.tokenize or fam.hashing is not None else self.chunk_chars / 4


def _load_tokenizer(path: str) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenizerUnavailable(f"tokenizer {path}: the `tokenizers` package is not installed") from None
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the Rust side raises plain Exception for unreadable or invalid files
        raise TokenizerUnavailable(f"tokenizer {path}: {e}") from None
