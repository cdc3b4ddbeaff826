"""The client's settings: one frozen dataclass, and the identity scope."""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from typing import NamedTuple

MiB = 1024 * 1024
# CPUs that keep loads in order (TSO): there the generation check alone catches a stale
# shared-memory copy; elsewhere (ARM, POWER...) each copy's CRC32C is checked too, by default.
ORDERED_LOADS = ("x86_64", "amd64", "i386", "i686")


def loads_may_reorder() -> bool:
    return platform.machine().lower() not in ORDERED_LOADS


class Scope(NamedTuple):
    """quilld's identity scope for every connection of a client (`SCOPE model tokenizer [adapter]`).

    The tenant is not part of it: the server takes it from the authenticated user.
    """

    model: str
    tokenizer: str
    adapter: str = ""

    def command(self) -> tuple:
        return ("SCOPE", self.model, self.tokenizer, self.adapter) if self.adapter else (
            "SCOPE", self.model, self.tokenizer)


@dataclass(frozen=True)
class ClientConfig:
    host: str = "127.0.0.1"
    port: int = 7379
    username: str | None = None
    password: str | None = None
    scope: Scope | None = None
    # Timeouts in seconds (None waits forever). socket_timeout bounds each read or write.
    socket_timeout: float | None = 30.0
    connect_timeout: float | None = 5.0
    # Pool: at most this many redis-py connections (callers wait up to pool_timeout for one),
    # and at most this many idle sockets kept for get_into.
    max_connections: int = 32
    pool_timeout: float | None = 20.0
    max_idle_raw: int = 8
    # Retries of idempotent commands after a lost connection: exponential backoff with jitter.
    retries: int = 3
    backoff_base: float = 0.02
    backoff_cap: float = 1.0
    retry_on_timeout: bool = False
    # put_blocks: DATA chunk size, parallel connections (threads), bytes reserved per round.
    chunk_size: int = 4 * MiB
    parallelism: int = 4
    put_round_bytes: int = 256 * MiB
    lease_ms: int | None = None
    # get_into / get_many_into: replies in flight per batch window; a too-large reply up to
    # drain_max bytes is read and dropped (the socket is kept), a larger one closes the socket.
    pipeline_window: int = 64
    drain_max: int = 8 * MiB
    # The shared-memory path (quillclient.shm) for a quilld on this host: "auto" uses it when the
    # server offers it to this user and falls back to TCP otherwise (client.transport and
    # client.shm_unavailable_reason say which and why); "require" raises instead of falling back;
    # "off" never tries. verify_crc: check each shared-memory copy's CRC32C too (costs a pass);
    # on by default where the CPU may reorder loads (anything but x86), where the generation
    # check alone could miss a copy that overlapped the reuse of its block.
    shared_memory: str = "auto"
    verify_crc: bool = field(default_factory=loads_may_reorder)

    def __post_init__(self) -> None:
        if self.chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        if self.parallelism <= 0:
            raise ValueError("parallelism must be positive")
        if self.pipeline_window <= 0:
            raise ValueError("pipeline_window must be positive")
        if self.max_connections < self.parallelism:
            raise ValueError("max_connections must be at least parallelism")
        if self.shared_memory not in ("auto", "off", "require"):
            raise ValueError("shared_memory must be 'auto', 'off' or 'require'")
        if self.scope is not None and not isinstance(self.scope, Scope):
            object.__setattr__(self, "scope", Scope(*self.scope))

    def handshake(self) -> list[tuple]:
        """The commands that set a fresh connection up: AUTH, then SCOPE."""
        cmds: list[tuple] = []
        if self.password is not None:
            cmds.append(("AUTH", self.username, self.password) if self.username else ("AUTH", self.password))
        if self.scope is not None:
            cmds.append(self.scope.command())
        return cmds
