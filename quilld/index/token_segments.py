"""A long chat's token ids, reusing those of the segments an earlier chat shared with it.

`tokenizers` splits its input on the added tokens (`<|eot_id|>`, `<|im_start|>`, ...) before
anything else, then normalizes, pre-tokenizes and encodes each piece between them on its own, so
the token ids of a text are those of its pieces one after another. A chat rendered by its
template is such pieces: one or two per message. A conversation sent again with a new turn, or a
long system prompt shared by many requests, repeats its earlier pieces exactly; tokenizing a
32k-token chat is ~25 ms, nearly all of the gateway's added time to first token
(bench/gateway_ttft_bench.py). So a long text is cut at the added tokens, each long piece looked
up by its sha256 in a bounded cache, and only the pieces not seen before are encoded.

Only where the cut is exactly what `tokenizers` does: every added token with `lstrip`,
`rstrip` and `single_word` off (they would eat or test the text around it) and not
`normalized` (matched before normalizing), and no post-processing (`add_special_tokens=False`,
as a chat is tokenized). Otherwise, and for short texts, the text is encoded whole.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from typing import Any

LONG_TEXT = 8192  # characters: a shorter text is encoded whole (a cut costs more than it saves)
LONG_PIECE = 1024  # characters: a piece at least this long is cached
CACHE_TOKENS = 4_000_000  # token ids kept per tokenizer (~32 MB of Python ints at worst)


class SegmentCache:
    """One tokenizer's cache of long pieces' token ids (thread-safe: the gateway tokenizes in threads)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        added = list(tokenizer.get_added_tokens_decoder().values())
        plain = all(not (a.lstrip or a.rstrip or a.single_word or a.normalized) for a in added)
        # leftmost-longest, as tokenizers' Aho-Corasick matching of added tokens
        contents = sorted({a.content for a in added if a.content}, key=len, reverse=True)
        self.cut = re.compile("(" + "|".join(map(re.escape, contents)) + ")") if plain and contents else None
        self._ids: OrderedDict[bytes, list[int]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def ids(self, text: str) -> list[int]:
        """`text`'s token ids without special tokens added, as `encode(text, add_special_tokens=False)`."""
        if self.cut is None or len(text) < LONG_TEXT:
            return _encode(self.tokenizer, [text])[0]
        pieces = [p for p in self.cut.split(text) if p]
        keys = [hashlib.sha256(p.encode("utf-8", "surrogatepass")).digest() if len(p) >= LONG_PIECE else None
                for p in pieces]
        found: list[list[int] | None] = [None] * len(pieces)
        with self._lock:
            for i, k in enumerate(keys):
                if k is not None and (hit := self._ids.get(k)) is not None:
                    self._ids.move_to_end(k)
                    found[i] = hit
                    self.hits += 1
        missing = [i for i, f in enumerate(found) if f is None]
        for i, got in zip(missing, _encode(self.tokenizer, [pieces[i] for i in missing]) if missing else ()):
            found[i] = got
        with self._lock:
            for i in missing:
                if (k := keys[i]) is not None and k not in self._ids:
                    self.misses += 1
                    self._ids[k] = found[i]  # type: ignore[assignment]
                    self._tokens += len(found[i])  # type: ignore[arg-type]
            while self._tokens > CACHE_TOKENS and self._ids:
                self._tokens -= len(self._ids.popitem(last=False)[1])
        return [t for f in found for t in f]  # type: ignore[union-attr]


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Through `encode_batch`, which releases the GIL while Rust works (`encode` holds it)."""
    return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


__all__ = ["CACHE_TOKENS", "LONG_PIECE", "LONG_TEXT", "SegmentCache"]
