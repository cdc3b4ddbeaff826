"""Core data model shared by every layer: identities, tiers, block states."""

from __future__ import annotations

import enum
from typing import NamedTuple


class IdentityScope(NamedTuple):
    """Who may see a block: two equal keys in different scopes are different objects.

    The tenant is the connection's authenticated user, never a claim of the
    client; model, tokenizer and adapter come from `SCOPE`.
    """

    tenant: str = "default"
    model: str = ""
    tokenizer: str = ""
    adapter: str = ""

    def describe(self) -> str:
        return f"tenant={self.tenant} model={self.model} tokenizer={self.tokenizer} adapter={self.adapter}"


class CacheTier(str, enum.Enum):
    HBM = "hbm"  # an engine's GPU memory (from its KV events)
    CPU = "cpu"  # an engine's host memory
    DRAM = "dram"  # this pool's DRAM arena
    SSD = "ssd"  # this pool's SSD segments


class BlockState(enum.IntEnum):
    """A block's life: reserved -> writing -> resident -> evicting -> gone."""

    RESERVED = 0  # space held, nothing received, invisible
    WRITING = 1  # bytes arriving (a large SET or PUT2PHASE DATA), invisible
    RESIDENT = 2  # published, readable
    EVICTING = 3  # unlinked from the keyspace, space freed when the last reader unpins
    GONE = 4  # space returned to the allocator
