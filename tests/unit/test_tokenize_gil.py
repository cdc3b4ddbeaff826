"""A long prompt's tokenizing leaves the GIL to other threads (quilld/index/chat_render.encode).

The gateway tokenizes in a worker thread so that its event loop keeps serving; `tokenizers`'
`Tokenizer.encode` holds the GIL for the whole call, which stopped the loop for as long (~30 ms
for a 32k-token chat). Measured here as a user of the loop would feel it: the longest gap between
a second thread's 1 ms sleeps while a long chat is tokenized.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from quilld.index import chat_render

FAMILY = Path(__file__).resolve().parent.parent / "fixtures" / "chat_render" / "llama31"
WORDS = "block cache tier engine prefill decode token route residency pool node (1234).".split()


def test_a_long_chat_is_tokenized_without_holding_the_gil():
    tok = chat_render.load(str(FAMILY))
    text = " ".join(WORDS[i * 7 % len(WORDS)] for i in range(60_000))  # ~100k tokens of the fixture's BPE
    messages = [{"role": "system", "content": text}, {"role": "user", "content": "which tier?"}]
    took, done = [], threading.Event()

    def work() -> None:
        t0 = time.perf_counter()
        took.append(len(tok.chat_token_ids(messages)))
        took.append(time.perf_counter() - t0)
        done.set()

    worker = threading.Thread(target=work)
    gaps, last = [], time.perf_counter()
    worker.start()
    deadline = time.monotonic() + 30
    while not done.is_set() and time.monotonic() < deadline:
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    worker.join(30)
    tokens, seconds = took
    assert tokens > 50_000 and seconds > 0.02, (tokens, seconds)  # long enough to tell
    assert max(gaps) < seconds / 2, f"the loop's thread waited {max(gaps) * 1000:.1f} ms of {seconds * 1000:.1f}"


def test_encode_gives_the_ids_of_tokenizer_encode():
    tok = chat_render.load(str(FAMILY))
    for text, special in (("<|begin_of_text|>Hello, tier 2 blocks!", True), ("plain words here", False)):
        assert chat_render.encode(tok.tokenizer, text, special) == tok.tokenizer.encode(
            text, add_special_tokens=special).ids
