"""quilld/index/token_segments.py: a long chat's token ids from its pieces, as `encode` gives them whole."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer

from quilld.index import chat_render, token_segments
from quilld.index.token_segments import SegmentCache

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "chat_render"
WORDS = ("block cache tier engine prefill décodé token route 東京 residency pool node émoji 🙂 e\u0301 "
         "<|eot_id tier's 12345 ,.;!? \n\n  tabs\there").split(" ")


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.mark.parametrize("family", ["llama31", "qwen25", "qwen25_jinja"])
def test_a_long_conversation_growing_turn_by_turn_gives_the_ids_of_the_whole_text(family):
    tok = chat_render.load(str(FIXTURES / family))
    cache = SegmentCache(tok.tokenizer)
    assert cache.cut is not None
    rng = random.Random(family)
    chat = [{"role": "system", "content": text(rng, 3000)}]
    for turn in range(4):
        chat.append({"role": "user", "content": text(rng, 800 + 300 * turn)})
        rendered = tok.render(chat)
        assert len(rendered) > token_segments.LONG_TEXT
        assert cache.ids(rendered) == tok.tokenizer.encode(rendered, add_special_tokens=False).ids
        assert tok.chat_token_ids(chat) == tok.tokenizer.encode(rendered, add_special_tokens=False).ids
        chat.append({"role": "assistant", "content": text(rng, 200)})
    assert cache.hits >= 6  # the system prompt and the earlier turns came from the cache


def test_an_added_token_that_strips_its_neighbours_turns_the_cut_off():
    tok = Tokenizer.from_file(str(FIXTURES / "llama31" / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|strip|>", lstrip=True, rstrip=True)])
    cache = SegmentCache(tok)
    assert cache.cut is None
    long = "words around   <|strip|>   it " * 600
    assert cache.ids(long) == tok.encode(long, add_special_tokens=False).ids


def test_the_cache_is_bounded_by_tokens(monkeypatch):
    monkeypatch.setattr(token_segments, "CACHE_TOKENS", 20_000)
    tok = chat_render.load(str(FIXTURES / "llama31"))
    cache = SegmentCache(tok.tokenizer)
    rng = random.Random(3)
    for _ in range(6):
        rendered = tok.render([{"role": "system", "content": text(rng, 2000)}, {"role": "user", "content": "hi"}])
        assert cache.ids(rendered) == tok.tokenizer.encode(rendered, add_special_tokens=False).ids
    assert cache.misses == 6 and 0 < cache._tokens <= 20_000 and 0 < len(cache._ids) < 6
