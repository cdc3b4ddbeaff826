"""QuillClient: quilld's commands on top of redis-py, plus zero-copy reads.

Two pools share one `ClientConfig`:

- redis-py's `BlockingConnectionPool` for every command but reads into
  buffers. Each connection is set up by `_setup_connection` (AUTH through
  redis-py, then `SCOPE`), so every pooled connection of a client carries the
  client's scope, including connections opened after a reconnect; two clients
  with different scopes never share a connection. Large arguments go out as
  memoryviews (`CommandPacker`, quillwire's encoder), not copied.
- `zerocopy.RawPool`, raw sockets for `get_into` / `get_many_into`, set up
  with the same AUTH and SCOPE.
- `shm.ShmPool`, unix-socket connections to a quilld on the same host that
  lets this user map its arena: `get_into`, `get_many_into` and `put_blocks`
  then copy blocks straight between the caller's memory and the arena
  (`client.transport` is "shm"), reads finding their blocks in quilld's lookup
  table without asking it at all (`quillclient.lookup`), else they use TCP
  ("tcp", and `client.shm_unavailable_reason` says why). Decided at first use.

Idempotent commands are retried after a lost connection with redis-py's
`Retry` (exponential backoff with jitter); an error the server sent is never
retried. Every failure surfaces as a `quillclient.errors` type.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import Any, Callable, TypeVar

import redis
import redis.exceptions as rx
from redis.backoff import EqualJitterBackoff, NoBackoff
from redis.retry import Retry

from quillwire.encode import pack_command

from quillclient import blocks, segments, shm, zerocopy
from quillclient.config import ClientConfig, Scope
from quillclient.errors import AuthError, NotFound, QuillConnectionError, QuillError, from_redis
from quillclient.segments import as_writable

T = TypeVar("T")


def _setup_connection(scope: Scope | None, conn: redis.Connection) -> None:
    """redis-py's `redis_connect_func`: its own handshake (HELLO/AUTH), then SCOPE."""
    conn.on_connect()
    if scope is not None:
        conn.send_command(*scope.command())
        reply = conn.read_response()
        if reply not in (b"OK", "OK"):
            raise rx.ConnectionError(f"SCOPE answered {reply!r}")


class CommandPacker:
    """redis-py's `command_packer` interface, backed by quillwire's `pack_command`.

    redis-py's hiredis packer copies every argument into one new bytes object
    (twice for a memoryview); this one passes large arguments to the socket as
    the caller's memoryviews, so a 4 MiB PUT2PHASE DATA chunk is not copied.
    """

    def pack(self, *args) -> list[bytes | memoryview]:
        if isinstance(args[0], str) and " " in args[0]:  # "CLIENT LIST", as redis-py's packers do
            args = tuple(args[0].split()) + args[1:]
        return pack_command(*args)


_U64 = (1 << 64) - 1


def _text(value: Any) -> Any:
    """A RESP3 reply with its byte strings decoded (map keys included)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    if isinstance(value, dict):
        return {_text(k): _text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_text(v) for v in value]
    return value


class QuillClient:
    """A thread-safe client for one quilld. Options are `ClientConfig` fields; with `config`,
    a host, port or option also given overrides that field of it.

    >>> c = QuillClient("127.0.0.1", 7379, password="...", scope=("llama-3-8b", "llama3-tok"))
    >>> c.put_blocks({"blk:0": data0, "blk:1": data1})
    >>> n = c.get_into("blk:0", buffer)
    """

    def __init__(self, host: str | None = None, port: int | None = None, *, config: ClientConfig | None = None,
                 **options: Any) -> None:
        given = {**({"host": host} if host is not None else {}), **({"port": port} if port is not None else {}),
                 **options}
        cfg = replace(config, **given) if config is not None else ClientConfig(**given)
        self.config = cfg
        self._pool = redis.BlockingConnectionPool(
            max_connections=cfg.max_connections, timeout=cfg.pool_timeout,
            host=cfg.host, port=cfg.port, username=cfg.username, password=cfg.password,
            socket_timeout=cfg.socket_timeout, socket_connect_timeout=cfg.connect_timeout,
            socket_keepalive=True, protocol=3, retry=Retry(NoBackoff(), 0),
            redis_connect_func=partial(_setup_connection, cfg.scope), command_packer=CommandPacker())
        self._redis = redis.Redis(connection_pool=self._pool, protocol=3)
        errors: tuple = (rx.ConnectionError, rx.TimeoutError) if cfg.retry_on_timeout else (rx.ConnectionError,)
        self._retry = Retry(EqualJitterBackoff(cap=cfg.backoff_cap, base=cfg.backoff_base), cfg.retries, errors)
        self._raw = zerocopy.RawPool(cfg)
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._shm: shm.ShmPool | None = None
        self._shm_decided = False
        self._shm_lock = threading.Lock()
        self.shm_unavailable_reason = ""  # why transport is "tcp" (empty while undecided or on "shm")

    # -- life cycle --------------------------------------------------------

    def scope(self, model: str, tokenizer: str, adapter: str = "") -> QuillClient:
        """A new client (own pools) whose connections all run in this identity scope."""
        return QuillClient(config=replace(self.config, scope=Scope(model, tokenizer, adapter)))

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self._raw.close()
        if self._shm is not None:
            self._shm.close()
        self._pool.disconnect()

    def __enter__(self) -> QuillClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        scope = f" scope={tuple(self.config.scope)}" if self.config.scope else ""
        return f"<QuillClient {self.config.host}:{self.config.port}{scope}>"

    @property
    def raw_sockets_opened(self) -> int:
        """Sockets the get_into pool has opened so far (reconnects and discarded ones included)."""
        return self._raw.created

    # -- the shared-memory path ---------------------------------------------

    @property
    def transport(self) -> str:
        """"shm" when blocks move through shared memory, else "tcp" (decided at first use)."""
        return "shm" if self._shm_pool() is not None else "tcp"

    @property
    def shm_direct_reads(self) -> int:
        """Blocks read from quilld's lookup table in shared memory, quilld not asked at all."""
        return self._shm.direct_reads if self._shm is not None else 0

    @property
    def shm_direct_retries(self) -> int:
        """Copies out of the lookup table thrown away because their entry changed meanwhile."""
        return self._shm.direct_retries if self._shm is not None else 0

    @property
    def shm_stale_reads(self) -> int:
        """Shared-memory copies whose lease ended while copying, read again over TCP."""
        return self._shm.stale_reads if self._shm is not None else 0

    @property
    def shm_busy_rereads(self) -> int:
        """Keys read over TCP because quilld had no shared-memory lease to give (-BUSY)."""
        return self._shm.busy_rereads if self._shm is not None else 0

    @property
    def shm_crc_rereads(self) -> int:
        """Shared-memory copies whose CRC32C did not match (verify_crc), read again over TCP."""
        return self._shm.crc_rereads if self._shm is not None else 0

    def _shm_pool(self) -> shm.ShmPool | None:
        if not self._shm_decided:
            with self._shm_lock:
                if not self._shm_decided:
                    self._shm, self.shm_unavailable_reason = self._open_shm()
                    self._shm_decided = True
        return self._shm

    def _open_shm(self) -> tuple[shm.ShmPool | None, str]:
        """The shared-memory pool, or None and why not. A server that cannot be reached raises
        (nothing is decided then); "require" raises instead of returning a reason."""
        cfg = self.config
        if cfg.shared_memory == "off":
            return None, "shared_memory is 'off'"
        try:
            hello = _text(self._call(lambda: self._redis.execute_command("SHM", "HELLO")))
        except (QuillConnectionError, AuthError):
            raise  # the call that needed the answer fails the same way: nothing is decided yet
        except QuillError as e:
            reason = f"the server offers no shared memory (SHM HELLO: {e})"
        else:
            if isinstance(hello, list):  # RESP2's flat list
                hello = dict(zip(hello[::2], hello[1::2]))
            path = hello.get("unixsocket") or ""
            if not path:
                reason = "the server has no unix socket (server.unixsocket)"
            elif hello.get("boot_id", "").encode() != shm.local_boot_id():
                reason = "the server is on another host (its boot id differs from this host's)"
            elif not hello.get("may_map"):
                reason = f"user '{cfg.username or 'default'}' may not map the arena (security.map_users)"
            elif not os.path.exists(path):
                reason = f"the server's unix socket {path} is not visible from here"
            else:
                pool = shm.ShmPool(cfg, path, table=bool(hello.get("lookup_slots")))
                try:
                    pool.release(pool.acquire())  # connect and attach once: any refusal shows now
                except QuillError as e:
                    pool.close()
                    reason = f"attaching over {path} failed: {e}"
                else:
                    return pool, ""
        if cfg.shared_memory == "require":
            raise QuillError(f"shared_memory='require' but the shared-memory path is unavailable: {reason}")
        return None, reason

    # -- plumbing ----------------------------------------------------------

    def _call(self, fn: Callable[[], T], idempotent: bool = True) -> T:
        """Run a redis-py call with this client's retries; raise quillclient errors."""

        def attempt() -> T:
            try:
                return fn()
            except rx.AuthenticationError as e:  # a ConnectionError to redis-py; never retried here
                raise from_redis(e) from e

        try:
            if idempotent:
                return self._retry.call_with_retry(attempt, lambda error: None)
            return attempt()
        except rx.RedisError as e:
            raise from_redis(e) from e

    def _pipeline(self, commands: Sequence[tuple], idempotent: bool = True) -> list:
        """Replies of a non-transactional pipeline, errors as exception objects in the list."""

        def run() -> list:
            pipe = self._redis.pipeline(transaction=False)
            for cmd in commands:
                pipe.execute_command(*cmd)
            return pipe.execute(raise_on_error=False)

        return [from_redis(r) if isinstance(r, Exception) else r for r in self._call(run, idempotent)]

    def _executor_for_puts(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.config.parallelism, thread_name_prefix="quill-put")
            return self._executor

    def execute(self, *args: Any, idempotent: bool = False) -> Any:
        """Any command, raw reply; errors typed. Retried after a lost connection only if idempotent."""
        return self._call(lambda: self._redis.execute_command(*args), idempotent)

    # -- values ------------------------------------------------------------

    def ping(self) -> bool:
        return self._call(lambda: self._redis.ping())

    def put(self, key: str | bytes, data: Any, *, ttl: float | None = None) -> None:
        """Store `data` (any buffer: bytes, bytearray, numpy array, mmap) under `key`, replacing it."""
        zerocopy.put(self._raw, key, data, None if ttl is None else max(1, int(ttl * 1000)))

    def get(self, key: str | bytes) -> bytes | None:
        """The block as a new bytes object, None on a miss. `get_into` avoids the copies."""
        return self._call(lambda: self._redis.execute_command("GETBLK", key))

    def get_into(self, key: str | bytes, buffer: Any) -> int:
        """Read the block straight into `buffer` (writable: bytearray, numpy array, mmap, memoryview).

        Returns the block's length (the rest of the buffer is untouched). Raises
        NotFound on a miss and BufferTooSmall, with nothing written, if the
        block does not fit; the client stays usable after either.
        """
        view = as_writable(buffer)
        pool = self._shm if self._shm_decided else self._shm_pool()
        if pool is None:
            n = zerocopy.get_into(self._raw, key, view)
        else:
            mapping = pool.mappings.current
            lookup = mapping.lookup if mapping is not None else None
            if lookup is not None:  # the hot path: a hash, a probe, a copy, no system call
                n = lookup.read_key(key, view, self.config.verify_crc)
                if n >= 0:
                    pool.direct_reads += 1
                    return n
            n = shm.get_one(pool, key, view, self.config.verify_crc,
                            lambda i: zerocopy.get_into(self._raw, key, view), lookup_tried=lookup is not None)
        if n == zerocopy.MISS:
            raise NotFound(key)
        return n

    def get_many_into(self, keys: Sequence[str | bytes], buffers: Sequence[Any]) -> list[int]:
        """Batched get_into on one connection, pipelined. Per key its length, or -1 for a miss.

        A block too large for its buffer is skipped, the others are read, then
        BufferTooSmall is raised (its `results` holds every key's outcome). A buffer may be a
        list of buffers: the block is scattered over them, in order (`quillclient.segments`).
        """
        views = [segments.writable(b) for b in buffers]
        if len(keys) != len(views):
            raise ValueError(f"{len(keys)} keys but {len(views)} buffers")
        pool = self._shm_pool()
        if pool is None:
            return zerocopy.get_many_into(self._raw, keys, views)
        return shm.get_many(pool, keys, views, self.config.verify_crc,
                            lambda i: zerocopy.get_many_into(self._raw, [keys[i]], [views[i]])[0])

    def delete(self, *keys: str | bytes) -> int:
        """Delete keys; the number that existed."""
        return self._call(lambda: self._redis.execute_command("DEL", *keys))

    def exists(self, key: str | bytes) -> bool:
        return bool(self._call(lambda: self._redis.execute_command("EXISTS", key)))

    def exists_many(self, keys: Sequence[str | bytes]) -> list[bool]:
        """Whether each key exists, in one pipelined round trip."""
        return [r == 1 for r in self._pipeline([("EXISTS", k) for k in keys])]

    def put_blocks(self, items: Mapping | Iterable[tuple[Any, Any]], *, chunk_size: int | None = None,
                   parallelism: int | None = None, lease_ms: int | None = None,
                   hashes: Sequence[tuple[int | str, int | str | None]] | None = None) -> list[bool]:
        """Store many blocks with PUT2PHASE: chunked DATA in parallel, COMMIT with CRC32C.

        `items` is a mapping or (key, data) pairs; a data that is a list of buffers is one
        block, their concatenation (`quillclient.segments`). `hashes`, parallel to the items:
        each block's engine hash and the hash of the block before it in its chain (None: none),
        sent as BEGIN's HASH and PARENT so ROUTE credits the copies. Returns, per item, True if it
        was stored and False if the key was already complete (`+EXISTS`; its
        value is kept). See `quillclient.blocks` for the failure rules.
        """
        cfg = self.config
        pairs = [(key, segments.readable(data)) for key, data in (items.items() if isinstance(items, Mapping)
                                                                   else items)]
        chain = None if hashes is None else list(hashes)
        if chain is not None and len(chain) != len(pairs):
            raise ValueError(f"{len(pairs)} blocks but {len(chain)} hashes")
        pool = self._shm_pool()
        if pool is not None:  # written in place through the mapping, committed with their CRC32C
            return shm.put_blocks(pool, pairs, cfg.lease_ms if lease_ms is None else lease_ms, cfg.put_round_bytes,
                                  chain)
        pairs = [(key, data.joined() if isinstance(data, segments.Segments) else data) for key, data in pairs]
        return blocks.put_blocks(self, pairs, chunk_size or cfg.chunk_size, parallelism or cfg.parallelism,
                                 cfg.put_round_bytes, cfg.lease_ms if lease_ms is None else lease_ms, chain)

    # -- placement and routing ----------------------------------------------

    def locate(self, *keys: str | bytes) -> list[list[dict[str, Any]]]:
        """Per key, its residencies: {"node", "tier", "bytes", "last_access_ms"}."""
        return _text(self._call(lambda: self._redis.execute_command("LOCATE", *keys)))

    def route(self, *, blocks: Iterable[int | str] | None = None, tokens: Iterable[int] | None = None,
              block_size: int | None = None, decode_tokens: int | None = None, session: str | None = None,
              acquire: bool = False, candidates: bool = True, messages: list[dict] | None = None,
              prompt: str | None = None, hashing: str | None = None) -> dict[str, Any]:
        """The engine that recomputes the least for these blocks (or tokens, a chat's messages, a
        prompt), as quilld's ROUTE map.

        Blocks go as ROUTE PACKED (64-bit ints, no JSON on either side) or ROUTE HASHES (hex
        strings); the rest as JSON, hashed as `hashing` says ("auto", quilld's default: as the
        model's engines hash them when they name their hashing, else "quilld"'s own chain; or
        "engine"); a caller of another tenant than the engines' finds the "cache_salt" to send
        the engine in the map. With candidates=False (blocks only) quilld answers the COMPACT
        form and the map has no "candidates": engine, url, cost, lease and plan (one step per block)."""
        if blocks is None or tokens is not None or messages is not None or prompt is not None or hashing:
            req: dict[str, Any] = {}
            if blocks is not None:
                req["blocks"] = [b if isinstance(b, (int, str)) else bytes(b).hex() for b in blocks]
            if tokens is not None:
                req["tokens"] = list(tokens)
            for name, value in (("messages", messages), ("prompt", prompt), ("hashing", hashing),
                                ("block_size", block_size), ("decode_tokens", decode_tokens), ("session", session)):
                if value is not None:
                    req[name] = value
            if acquire:
                req["acquire"] = True
            args: list[Any] = ["ROUTE", json.dumps(req, separators=(",", ":"))]
            candidates = True
        else:
            hashes = [b if isinstance(b, (int, str)) else bytes(b).hex() for b in blocks]
            if all(type(b) is int and -(1 << 63) <= b < 1 << 64 for b in hashes):
                args = ["ROUTE", "PACKED", struct.pack(f"<{len(hashes)}Q", *(b & _U64 for b in hashes))]
            else:  # hex strings, or an int quilld should refuse with its own error
                args = ["ROUTE", "HASHES", len(hashes), *hashes]
            for name, value in (("BLOCK_SIZE", block_size), ("DECODE_TOKENS", decode_tokens), ("SESSION", session)):
                if value is not None:
                    args += [name, value]
            if acquire:
                args.append("ACQUIRE")
            if not candidates:
                args.append("COMPACT")
        reply = _text(self._call(lambda: self._redis.execute_command(*args), idempotent=not acquire))
        if candidates:
            return reply
        engine, url, cost, lease, runs, *pair = reply
        plan = [step for step, n in zip(runs[::2], runs[1::2]) for _ in range(n)]
        out = {"engine": engine, "url": url, "cost": None if cost is None else float(cost), "lease": lease,
               "plan": plan}
        if pair:  # the model's engines have roles: which prefills, which decodes (a map)
            out["pair"] = pair[0] if isinstance(pair[0], dict) else dict(zip(pair[0][::2], pair[0][1::2]))
        return out

    def release(self, lease: str) -> bool:
        """End a request taken with route(acquire=True); False for an unknown or expired lease."""
        return bool(self._call(lambda: self._redis.execute_command("RELEASE", lease)))


__all__ = ["QuillClient", "QuillError"]
