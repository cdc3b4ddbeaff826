"""Core data model shared by every layer: identities, tiers, block states, read results."""

from __future__ import annotations

import enum
from typing import Any, Awaitable, Callable, NamedTuple


class IdentityScope(NamedTuple):
    """Who may see a block: two equal keys in different scopes are different objects.

    The tenant is the connection's authenticated user, never a claim of the
    client; model, tokenizer and adapter come from `SCOPE`.
    """

    tenant: str = "default"
    model: str = ""
    tokenizer: str = ""
    adapter: str = ""


class CacheTier(str, enum.Enum):
    """Where a copy of a block lives. The residency index sizes its bit layout from this enum."""

    HBM = "hbm"  # an engine's GPU memory (from its KV events)
    CPU = "cpu"  # an engine's host memory
    DRAM = "dram"  # this pool's DRAM arena
    SSD = "ssd"  # this pool's SSD segments
    STORAGE = "storage"  # an engine's own offload storage below its host memory (vLLM's medium STORAGE)


class Pinned:
    """A stored value's bytes as a view of pinned memory (an arena block).

    Storage hands these out so a reader can send or copy the bytes without a
    copy; `release()` must be called exactly once when the view is no longer
    used. The protocol writes one as a bulk reply and releases it once the
    transport has sent it.
    """

    __slots__ = ("view", "release")

    def __init__(self, view: memoryview, release: Callable[[], None]) -> None:
        self.view = view
        self.release = release

    def __len__(self) -> int:
        return len(self.view)


class Pending:
    """A read result that is not ready yet (SSD read, peer fetch, a wait).

    `awaitable` resolves to the value itself (bytes, Pinned, None, ...). The
    protocol answers in order: nothing after it on the connection runs before
    it resolves.

    `on_purpose`: the wait is a deliberate delay (the AUTH throttle's), not one for the
    disk or a peer, so an EXEC never holds the node for it. `due`, when not None, says the
    value is known already (`answer`, an error or a reply) and only sent late, at that
    monotonic time: an EXEC takes the answer at once and sends its own reply no earlier.
    """

    __slots__ = ("awaitable", "on_purpose", "answer", "due")

    def __init__(self, awaitable: Awaitable[Any], on_purpose: bool = False, answer: Any = None,
                 due: float | None = None) -> None:
        self.awaitable = awaitable
        self.on_purpose = on_purpose
        self.answer = answer
        self.due = due

