"""One typed, frozen config tree.

Precedence, lowest first: the defaults written here, then a TOML file
(`--config`, same layout as `conf/quilld.toml`), then `QUILLD_<SECTION>_<KEY>`
environment variables, then command-line flags. Every key is declared here;
unknown keys are errors, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import os
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

from quilld.errors import ConfigError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(?:i?b)?|b)?\s*$", re.IGNORECASE)
_SIZE_MULT = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1024 * GiB}


def parse_mode(value: str | int) -> int:
    """A file mode: a string of octal digits ("700", "0o770", as redis's unixsocketperm), or an int
    already in range (a TOML 0o700). A bare TOML 700 is refused: it would be read as decimal."""
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, int):
        if not 0 <= value <= 0o777:
            raise ValueError(value)
        return value
    text = str(value).strip().lower().removeprefix("0o")
    if not text or any(ch not in "01234567" for ch in text):
        raise ValueError(value)
    return int(text, 8)


def parse_size(text: str | int) -> int:
    """Parse `1GiB`, `512MiB`, `64k`, `4096` into bytes (binary multiples)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ConfigError(f"invalid size {text!r} (expected e.g. 4096, 64KiB, 512MiB, 1GiB)")
    value = float(m.group(1)) * _SIZE_MULT[(m.group(2) or "").lower()]
    return int(value)


@dataclass(frozen=True)
class ServerConfig:
    bind: str = "127.0.0.1"
    port: int = 7379
    node_id: str = ""  # empty: derived from host name and port
    max_clients: int = 10000
    proto_max_bulk_len: int = 512 * MiB
    client_output_high_water: int = 64 * MiB
    payload_timeout_ms: int = 4_000  # a large payload that stops arriving this long closes its client
    space_wait_ms: int = 5_000  # a write short of arena room held by readers or puts waits this long, then -OOM
    exec_hold_ms: int = 1_000  # an EXEC whose commands wait (SSD, peers) holds the node's other clients this long at most
    exec_hold_budget_ms: int = 100  # ... and one tenant's EXECs this long a second (saved up to exec_hold_ms)
    client_query_buffer_limit: int = 1 * GiB  # a client's unfinished input beyond this closes it (redis's)
    protected_mode: bool = True  # no password set: only loopback clients, on every listener (redis's protected-mode)
    allowed_hosts: str = ""  # comma-separated host names the HTTP ports answer to besides IPs, localhost, hostname
    timeout: int = 0  # seconds a client may stay idle before it is closed; 0: never (redis's timeout)
    slowlog_log_slower_than: int = 10_000  # microseconds: commands this slow go to SLOWLOG; < 0: none; 0: all
    slowlog_max_len: int = 128  # entries SLOWLOG keeps
    latency_monitor_threshold: int = 0  # milliseconds: events this slow go to LATENCY; 0: the monitor is off
    tracking_table_max_keys: int = 1_000_000  # keys CLIENT TRACKING's table remembers at most; 0: no bound (redis's)
    unixsocket: str = ""  # path of a unix socket to listen on beside TCP (redis's unixsocket); empty: none
    unixsocketperm: int = 0o700  # the socket file's mode (octal, as redis's unixsocketperm)
    shm_lease_ms: int = 5_000  # a shared-memory read's lease (SHM GET) ends after this unless released first
    shm_max_leases: int = 4096  # leases one connection may hold at once (the table has SHM_SLOTS in all)
    shm_max_leases_per_user: int = 0  # leases one user's connections may hold together; 0: SHM_SLOTS / map users
    shm_lookup_slots: int = 0  # entries of the same-host lookup table; 0: two per 64 KiB of arena; < 0: no table


@dataclass(frozen=True)
class AdminConfig:
    port: int = 7380  # 0 disables the admin HTTP API
    token: str = ""  # when set, every admin request needs `Authorization: Bearer <token>`
    max_connections: int = 64  # open at once; more are answered 503 (also capped by the descriptor limit)
    header_timeout_ms: int = 10_000  # a request's head (or the next one on an idle connection) within this
    body_timeout_ms: int = 10_000  # a request's body within this once its head has arrived


@dataclass(frozen=True)
class DramConfig:
    size: int = 1 * GiB
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    inline_max: int = 4 * KiB  # values up to this size live in the index entry, not in arena pages
    max_unfilled_share: float = 0.5  # of the arena, held at most by reservations still waiting for clients' bytes
    maxmemory: int = 0  # DRAM filled before eviction (the watermarks are fractions of it); 0: the whole arena
    maxmemory_policy: str = "allkeys-lru"  # what goes when DRAM is full with no SSD tier (tiers/eviction.py)
    memory_file: str = ""  # the arena's memory file (on /dev/shm, say); empty: an anonymous memfd


@dataclass(frozen=True)
class BlocksConfig:
    default_lease_ms: int = 30_000
    max_lease_ms: int = 600_000


@dataclass(frozen=True)
class SecurityConfig:
    requirepass: str = ""
    users_file: str = ""  # lines of `user password [model=M] [tokenizer=T] [adapter=A]`; `#` starts a comment
    require_scope: bool = False  # data commands of a connection that chose no identity scope are refused (NOSCOPE)
    auth_throttle_after: int = 10  # failed AUTHs for one user, or from one address, before its attempts wait; 0: never
    auth_throttle_window_ms: int = 60_000  # a user or address with no failure for this long starts afresh
    auth_delay_max_ms: int = 5_000  # longest wait of a slowed attempt (right or wrong: none is refused)
    max_scopes_per_tenant: int = 1024  # identity scopes one tenant may use at once (SCOPE, gateway adapters)
    max_unfilled_bytes_per_tenant: int = 0  # arena bytes one tenant's unfilled payloads/puts may hold; 0: size/4
    max_open_puts_per_tenant: int = 16384  # PUT2PHASE BEGINs one tenant may have open (not committed or aborted)
    map_users: str = ""  # comma-separated users allowed to map the whole DRAM arena (SHM ATTACH); empty: nobody
    enable_debug_command: str = "no"  # DEBUG: no, yes, or local (unix socket and 127.0.0.1/::1 only), as redis 7


@dataclass(frozen=True)
class RouterConfig:
    prefill_load_scale: float = 1.0
    active_request_weight: float = 1.0
    temperature: float = 0.0  # 0: always the cheapest engine; > 0: softmax draw
    lease_timeout_ms: int = 60_000  # an ACQUIREd request not RELEASEd by then stops counting
    storage_credit: float = 0.25  # credit of a block in an engine's own offload storage (vLLM medium STORAGE)
    kv_idle_warning_s: float = 60.0  # warn when an engine's KV-event subscription got nothing this long; 0: never
    # prefill-decode pairs (engines with roles; index/pairing.py): auto decides per request, always and never don't
    disaggregation: str = "auto"
    disagg_min_uncached_tokens: int = 512  # fewer uncached prompt tokens than this: prefilled on the decode engine
    prefill_us_per_token: float = 45.0  # an engine's prefill time per uncached token (and per token queued ahead)
    running_decode_penalty_us: float = 1500.0  # what each running decode adds to an engine's prefill step
    decode_stall_weight: float = 1.0  # a running decode's stall by a prefill on its engine, against the request's wait
    transfer_us_per_mib: float = 55.0  # moving KV between nodes, per MiB (DRAM tier, where a prefill's KV lands)
    cross_node_us: float = 350.0  # once per transfer between two nodes
    handoff_us: float = 2000.0  # a disaggregated request's own overhead: a second request and the handoff check


@dataclass(frozen=True)
class SsdConfig:
    dir: str = ""  # empty: no SSD tier
    size: int = 16 * GiB
    segment_size: int = 1 * GiB
    promote_on_read: bool = True
    group_commit_bytes: int = 64 * MiB
    checkpoint_wal_bytes: int = 64 * MiB
    flush_progress_s: float = 1.0  # seconds between progress lines while a clean stop flushes DRAM to SSD
    direct_io: bool = False  # block writes with O_DIRECT where the file system allows it (docs/tiers/ssd.md)
    io_threads: int = 4  # threads writing a demotion batch's blocks in parallel


@dataclass(frozen=True)
class IndexConfig:
    backend: str = "memory"  # memory, lmdb or rocksdb (docs/residency-index.md)
    path: str = ""  # a persistent backend's directory (required for lmdb and rocksdb)
    commit_ms: int = 100  # a persistent backend commits what changed this often (a kill -9 loses at most this)
    fsync: bool = True  # each commit is synced to disk (off: a kill -9 still loses nothing committed)


INDEX_BACKENDS = ("memory", "lmdb", "rocksdb")


SHM_SLOTS = 65536  # lease slots of the shared-memory lease table, for all connections together (512 KiB)


TRANSFERS = ("auto", "tcp", "rdma")
REGISTRIES = ("gossip", "etcd")  # ClusterConfig.registry
DEBUG_COMMAND_MODES = ("no", "yes", "local")  # redis 7's enable-debug-command
# redis's maxmemory-policy names quilld implements (tiers/eviction.py); the first is the default
MAXMEMORY_POLICIES = ("allkeys-lru", "allkeys-lfu", "volatile-lru", "volatile-lfu", "volatile-ttl", "noeviction")


@dataclass(frozen=True)
class ClusterConfig:
    registry: str = "gossip"  # how members find each other: gossip (SWIM, no dependency) or etcd
    gossip_port: int = 0  # 0: single node, no gossip
    seeds: str = ""  # comma-separated host:port gossip addresses
    secret: str = ""  # gossip packets carry an HMAC-SHA256 under it; peers PEERAUTH with it (else the host's)
    probe_interval_ms: int = 500
    probe_timeout_ms: int = 200
    indirect_probes: int = 3
    suspicion_mult: int = 4
    push_pull_interval_ms: int = 10_000
    seed_warning_ms: int = 10_000  # alone this long with seeds configured: warn that none answers
    transfer: str = "auto"  # auto, tcp or rdma
    keep_fetched: bool = True  # keep a local copy of blocks fetched from peers
    peer_sendfile: bool = False  # a peer's reply block leaves the arena by sendfile (else a plain write)
    pool_reads: bool = True  # GET, MGET and EXISTS see the whole pool (a local miss asks the peers); false: local only
    directory_replicas: int = 3  # owners each directory entry has (every node when fewer)
    directory_buckets: int = 16384  # virtual buckets the directory is sharded into (a power of two)
    directory_group_blocks: int = 32  # blocks of a prompt whose entries share owners (one lookup)
    directory_weighted: bool = False  # members own buckets in proportion to their DRAM capacity
    directory_anti_entropy_ms: int = 30_000  # how often a holder compares digests with each owner
    # how long a deleted key's tombstone is kept: a node away longer than this that comes back with
    # an older copy of the key (its SSD tier) brings it back
    tombstone_s: int = 86_400
    lookup_timeout_ms: int = 1000  # a directory lookup's call to one owner fails after this (its breaker opens)
    hedge_floor_ms: int = 30  # a lookup asks the next owner too after at least this (else the owner's p99 estimate)
    hedge_max_ms: int = 1000  # ... and at most this
    breaker_open_ms: int = 1000  # an owner that failed is skipped this long, then one probe call
    etcd_endpoints: str = ""  # registry = "etcd": comma-separated URLs of the etcd members (http://host:port)
    etcd_prefix: str = "/quilld"  # every key quilld writes in etcd is under it: two prefixes, two clusters
    etcd_lease_ttl_s: int = 5  # a node whose lease is not renewed this long is dead in every view
    etcd_user: str = ""  # etcd's user name, when its authentication is on
    etcd_password: str = ""  # that user's password (a secret: QUILLD_CLUSTER_ETCD_PASSWORD, shown ***)

    @property
    def enabled(self) -> bool:
        """In a cluster: a gossip port, or membership from etcd."""
        return bool(self.gossip_port) or self.registry == "etcd"


@dataclass(frozen=True)
class GatewayConfig:
    port: int = 0  # 0: no OpenAI-compatible gateway
    ttft_slo_ms: int = 800
    connect_timeout_ms: int = 2_000
    first_byte_timeout_ms: int = 30_000
    chunk_chars: int = 256  # prompt characters per block when no tokenizer is configured
    max_attempts: int = 3
    recorded_blocks: int = 1_000_000  # per engine without KV events: the gateway's own record of its cache
    session_max: int = 100_000  # session-affinity entries (gateway and ROUTE sessions); the least recently used go
    session_idle_s: float = 1800.0  # a session unused this long forgets its engine
    max_connections: int = 512  # client connections open at once; more are answered 503 (and see admin's)
    header_timeout_ms: int = 10_000  # a request's head (or the next one on an idle connection) within this
    body_timeout_ms: int = 60_000  # a request's body (up to 64 MiB) within this once its head has arrived
    handoff_wait_ms: int = 2_000  # a disaggregated request waits this long for the prefill's KV to be in the pool


ENGINE_KINDS = ("vllm", "sglang", "other")
ENGINE_ROLES = ("both", "prefill", "decode")  # what an engine does of a request (index/pairing.py)
DISAGGREGATION_MODES = ("auto", "always", "never")
# The attention kinds of a hybrid model's KV-cache groups, as ROUTE credits them (index/groups.py).
GROUP_KINDS = ("full", "sliding_window", "mamba")
MAX_KV_GROUPS = 64  # vLLM numbers a model's KV-cache groups from 0; a hybrid model has a handful


@dataclass(frozen=True)
class GroupConfig:
    """One KV-cache group of a hybrid model, in vLLM's group order (its events' `group_idx`)."""

    kind: str = "full"  # full, sliding_window or mamba
    window_tokens: int = 0  # sliding_window: the window, in tokens (vLLM's sliding_window); 0 otherwise


@dataclass(frozen=True)
class EngineConfig:
    id: str = ""
    kind: str = "vllm"
    url: str = ""
    model: str = ""
    tokenizer: str = ""
    tenant: str = "default"  # the identity its cached blocks belong to (KV events carry none)
    # the quilld node id it stores its KV through; empty: the node it is registered on. Its key is
    # `kv_node` in the config file and the API (`locality`, its older name, is still accepted)
    locality: str = ""
    role: str = "both"  # prefill, decode or both (index/pairing.py)
    kv_bytes_per_token: int = 131_072  # the KV one token takes (Llama-3.1-8B in 16 bits), to price moving it
    kv_events: str = ""  # vLLM's ZMQ publisher, e.g. tcp://10.0.0.5:5557; empty: no subscription
    replay: str = ""  # vLLM's ZMQ replay (ROUTER) endpoint; empty: a gap clears the engine
    block_size: int = 16
    # the engine's KV-cache groups by kind, in vLLM's order; empty: a block counts while every group
    # its events name holds it (index/groups.py)
    groups: tuple[GroupConfig, ...] = ()
    # sent as `Authorization: Bearer <api_key>` with every request the gateway forwards to it (vLLM's
    # --api-key); a secret: never logged, never shown by /v1/engines, INFO or the redacted config
    api_key: str = field(default="", repr=False)
    # vLLM's prefix-cache hashing as the engine runs it (its --prefix-caching-hash-algo; quilld then
    # computes the engine's own block hashes, index/engine_hashes.py); empty: quilld does not hash
    # for this engine the way it does (the gateway's own chunks, as before)
    prefix_caching_hash_algo: str = ""
    # the engine's PYTHONHASHSEED (vLLM's NONE_HASH seed); empty: unset on the engine (then only the
    # sha256 algos can be reproduced). A secret: never logged or shown, like api_key. The config file
    # and the API may give it as `hash_seed_file = "path"` or `hash_seed = "env:NAME"` (engine_from)
    hash_seed: str = field(default="", repr=False)
    # how KV moves when it prefills for another engine (gateway_strategy.py): "pool", its connector
    # writes the pool under the engine's block hashes and the gateway waits for what is missing;
    # "nixl", engine to engine (vLLM's NixlConnector, P2P): the decode leg goes at once, no pool wait;
    # "mooncake", engine to engine (vLLM's MooncakeConnector): both legs at once, the decode engine
    # pulling the prefill's KV through its bootstrap server
    kv_transfer: str = "pool"
    # with kv_transfer = "mooncake": the engine_id of the prefill engine's --kv-transfer-config (the
    # decode engine finds its KV by it: give vLLM a fixed one) and its Mooncake bootstrap server,
    # host:port (empty: the url's host, port 8998, VLLM_MOONCAKE_BOOTSTRAP_PORT's default)
    kv_engine_id: str = ""
    kv_bootstrap: str = ""
    # the LoRA adapters the engine loads, (name, path) as vLLM's --lora-modules name=path: vLLM's
    # block hash of a LoRA request includes the adapter's path, so quilld hashes such a request the
    # engine's way only for the adapters named here (a table `{name = "path"}` in the config file)
    lora_modules: tuple[tuple[str, str], ...] = ()
    # how its KV events carry block hashes: "int" (vLLM's default, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1:
    # a digest's low 64 bits) or "bytes" (=0: the whole digest); quilld's engine hashes take the same form
    kv_event_hashes: str = "int"


# how a prefill engine hands its KV to the decode engine (EngineConfig.kv_transfer)
KV_TRANSFERS = ("pool", "nixl", "mooncake")
KV_TRANSFERS_NOT_YET = {"lmcache": "LMCache's PD mode (disagg_spec, the prefill pushing to the decode engine)"}
MOONCAKE_BOOTSTRAP_PORT = 8998  # vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT default

KV_EVENT_HASHES = ("int", "bytes")  # EngineConfig.kv_event_hashes

# vLLM 0.33's --prefix-caching-hash-algo values (index/engine_hashes.py computes each)
PREFIX_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

# an engine's keys as the config file and the API name them, where they differ from its field's
ENGINE_KEY_ALIASES = {"kv_node": "locality"}


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    dram: DramConfig = field(default_factory=DramConfig)
    blocks: BlocksConfig = field(default_factory=BlocksConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    ssd: SsdConfig = field(default_factory=SsdConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    engines: tuple[EngineConfig, ...] = ()

    def validate(self) -> "Config":
        s, d = self.server, self.dram
        taken: dict[int, str] = {}
        for name, port in (("server.port", s.port), ("admin.port", self.admin.port),
                           ("cluster.gossip_port", self.cluster.gossip_port), ("gateway.port", self.gateway.port)):
            if not 0 <= port <= 65535:
                raise ConfigError(f"{name} must be within 0..65535, got {port}")
            if port and port in taken:  # 0 is "off" (or, for server.port, any free port)
                raise ConfigError(f"{taken[port]} and {name} are both {port}: each listener needs its own port")
            taken[port] = name
        if d.size < 4 * KiB:
            raise ConfigError(f"dram.size must be at least 4KiB, got {d.size}")
        if not 0.0 < d.low_watermark <= d.high_watermark <= 1.0:
            raise ConfigError("dram watermarks must satisfy 0 < low_watermark <= high_watermark <= 1")
        if s.proto_max_bulk_len < 1:
            raise ConfigError("server.proto_max_bulk_len must be positive")
        if s.client_query_buffer_limit < 1 * MiB:
            raise ConfigError("server.client_query_buffer_limit must be at least 1MiB (as redis's), "
                              f"got {s.client_query_buffer_limit}")
        sec = self.security
        if sec.auth_throttle_after < 0 or sec.auth_throttle_window_ms <= 0 or sec.auth_delay_max_ms <= 0:
            raise ConfigError("security: auth_throttle_after must be >= 0, auth_throttle_window_ms and "
                              "auth_delay_max_ms positive")
        if sec.enable_debug_command not in DEBUG_COMMAND_MODES:
            raise ConfigError(f"security.enable_debug_command must be one of {', '.join(DEBUG_COMMAND_MODES)}, "
                              f"got {sec.enable_debug_command!r}")
        if not 0 <= d.maxmemory <= d.size:
            raise ConfigError(f"dram.maxmemory must be within 0..dram.size ({d.size}), got {d.maxmemory}")
        if d.maxmemory_policy not in MAXMEMORY_POLICIES:
            raise ConfigError(f"dram.maxmemory_policy must be one of {', '.join(MAXMEMORY_POLICIES)}, "
                              f"got {d.maxmemory_policy!r}")
        if not 0 <= d.inline_max <= 64 * KiB:
            raise ConfigError("dram.inline_max must be within 0..64KiB")
        if self.blocks.default_lease_ms <= 0 or self.blocks.max_lease_ms < self.blocks.default_lease_ms:
            raise ConfigError("blocks leases must satisfy 0 < default_lease_ms <= max_lease_ms")
        if s.tracking_table_max_keys < 0:
            raise ConfigError(f"server.tracking_table_max_keys must be 0 (no bound) or more, got {s.tracking_table_max_keys}")
        if s.timeout < 0 or s.slowlog_max_len < 0 or s.latency_monitor_threshold < 0:
            raise ConfigError("server.timeout, server.slowlog_max_len and server.latency_monitor_threshold "
                              "must be at least 0")
        if not 0 <= s.unixsocketperm <= 0o777:
            raise ConfigError(f"server.unixsocketperm must be an octal mode within 0..777, got {s.unixsocketperm:o}")
        if s.shm_lookup_slots > 1 << 24:
            raise ConfigError("server.shm_lookup_slots must be at most 16777216 (0: sized from the arena)")
        if s.shm_lease_ms < 1 or not 1 <= s.shm_max_leases <= SHM_SLOTS or \
                not 0 <= s.shm_max_leases_per_user <= SHM_SLOTS:
            raise ConfigError(f"server.shm_lease_ms must be positive, server.shm_max_leases within 1..{SHM_SLOTS} "
                              f"and server.shm_max_leases_per_user within 0..{SHM_SLOTS}")
        if d.memory_file and map_user_names(self.security.map_users):
            raise ConfigError("dram.memory_file cannot be shared with security.map_users: a named file cannot be "
                              "sealed against resizing, and a client that truncated it would kill quilld (SIGBUS). "
                              "Leave dram.memory_file empty (an anonymous, sealed arena) to map it")
        if s.payload_timeout_ms < 1:
            raise ConfigError("server.payload_timeout_ms must be positive")
        if s.space_wait_ms < 0:
            raise ConfigError("server.space_wait_ms must be 0 or more")
        if s.exec_hold_ms < 0 or s.exec_hold_budget_ms < 0:
            raise ConfigError("server.exec_hold_ms and server.exec_hold_budget_ms must be 0 or more")
        if self.security.max_scopes_per_tenant < 1 or self.security.max_open_puts_per_tenant < 1:
            raise ConfigError("security.max_scopes_per_tenant and max_open_puts_per_tenant must be at least 1")
        if not 0.0 < d.max_unfilled_share <= 1.0 or self.security.max_unfilled_bytes_per_tenant < 0:
            raise ConfigError("dram.max_unfilled_share must be within (0, 1] and "
                              "security.max_unfilled_bytes_per_tenant at least 0")
        seen = set()
        for e in self.engines:
            validate_engine(e)
            if e.id in seen:
                raise ConfigError(f"engines: duplicate id {e.id!r}")
            seen.add(e.id)
        if self.router.temperature < 0 or self.router.lease_timeout_ms <= 0:
            raise ConfigError("router: temperature must be >= 0 and lease_timeout_ms > 0")
        if not 0 <= self.router.storage_credit <= 1 or self.router.kv_idle_warning_s < 0:
            raise ConfigError("router: storage_credit must be within 0..1 and kv_idle_warning_s >= 0")
        r = self.router
        if r.disaggregation not in DISAGGREGATION_MODES:
            raise ConfigError(f"router.disaggregation must be one of {', '.join(DISAGGREGATION_MODES)}, "
                              f"got {r.disaggregation!r}")
        if r.disagg_min_uncached_tokens < 0 or min(r.prefill_us_per_token, r.running_decode_penalty_us,
                                                   r.decode_stall_weight, r.transfer_us_per_mib, r.cross_node_us,
                                                   r.handoff_us) < 0:
            raise ConfigError("router: disagg_min_uncached_tokens and the prefill, decode, transfer and handoff "
                              "costs must be at least 0")
        ssd = self.ssd
        if ssd.dir and (ssd.size < 1 * MiB or ssd.segment_size < 1 * MiB or ssd.segment_size % (4 * KiB)):
            raise ConfigError("ssd: size and segment_size must be at least 1MiB, segment_size a multiple of 4KiB")
        if ssd.group_commit_bytes < 1 * MiB or ssd.checkpoint_wal_bytes < 1 * MiB:
            raise ConfigError("ssd: group_commit_bytes and checkpoint_wal_bytes must be at least 1MiB")
        if ssd.flush_progress_s <= 0:
            raise ConfigError("ssd.flush_progress_s must be positive")
        if not 1 <= ssd.io_threads <= 64:
            raise ConfigError("ssd.io_threads must be within 1..64")
        c = self.cluster
        passwords = bool(self.security.requirepass or self.security.users_file)
        if c.transfer not in TRANSFERS:
            raise ConfigError(f"cluster.transfer must be one of {', '.join(TRANSFERS)}, got {c.transfer!r}")
        for name in ("lookup_timeout_ms", "hedge_floor_ms", "hedge_max_ms", "breaker_open_ms"):
            if getattr(c, name) < 1:
                raise ConfigError(f"cluster.{name} must be at least 1, got {getattr(c, name)}")
        if c.directory_replicas < 1:
            raise ConfigError(f"cluster.directory_replicas must be at least 1, got {c.directory_replicas}")
        b = c.directory_buckets
        if b < 256 or b > 1 << 20 or b & (b - 1):
            raise ConfigError(f"cluster.directory_buckets must be a power of two from 256 to 1048576, got {b}")
        if not 1 <= c.directory_group_blocks <= 255:
            raise ConfigError(f"cluster.directory_group_blocks must be 1..255, got {c.directory_group_blocks}")
        if c.tombstone_s < 1:
            raise ConfigError(f"cluster.tombstone_s must be at least 1, got {c.tombstone_s}")
        if c.directory_anti_entropy_ms < 100:
            raise ConfigError(f"cluster.directory_anti_entropy_ms must be at least 100, got "
                              f"{c.directory_anti_entropy_ms}")
        if min(c.probe_interval_ms, c.probe_timeout_ms, c.push_pull_interval_ms, c.seed_warning_ms) <= 0 \
                or c.indirect_probes < 0 \
                or c.suspicion_mult < 1 or c.probe_timeout_ms >= c.probe_interval_ms:
            raise ConfigError("cluster: intervals must be positive, probe_timeout_ms < probe_interval_ms, "
                              "indirect_probes >= 0, suspicion_mult >= 1")
        if c.registry not in REGISTRIES:
            raise ConfigError(f"cluster.registry must be one of {', '.join(REGISTRIES)}, got {c.registry!r}")
        if c.registry == "etcd":
            if not [u for u in c.etcd_endpoints.split(",") if u.strip()]:
                raise ConfigError("cluster.registry = \"etcd\" needs cluster.etcd_endpoints, e.g. "
                                  "\"http://10.0.0.5:2379,http://10.0.0.6:2379,http://10.0.0.7:2379\"")
            if c.gossip_port or c.seeds.strip():
                raise ConfigError("cluster.registry = \"etcd\" does not gossip: leave cluster.gossip_port and "
                                  "cluster.seeds unset (members find each other through etcd)")
            if not c.etcd_prefix.startswith("/") or c.etcd_prefix.rstrip("/") == "":
                raise ConfigError(f"cluster.etcd_prefix must start with / and name something, got {c.etcd_prefix!r}")
            if not 2 <= c.etcd_lease_ttl_s <= 3600:
                raise ConfigError(f"cluster.etcd_lease_ttl_s must be 2 to 3600 seconds, got {c.etcd_lease_ttl_s}")
            if c.etcd_password and not c.etcd_user:
                raise ConfigError("cluster.etcd_password needs cluster.etcd_user")
        if c.enabled and not c.secret and (self.security.requirepass or self.security.users_file):
            raise ConfigError("cluster.secret is required when clients need passwords: peers "
                              "authenticate to each other with it")
        if c.gossip_port and not c.secret and not is_loopback(s.bind):
            raise ConfigError(f"cluster.secret (QUILLD_CLUSTER_SECRET) is required to gossip on {s.bind!r}, "
                              "a non-loopback address: without it one forged UDP packet can mark a node dead. "
                              "Set the same secret on every node, or bind to 127.0.0.1")
        if c.enabled and s.protected_mode and not passwords and not is_loopback(s.bind):
            raise ConfigError(f"a cluster on {s.bind!r} needs client passwords (security.requirepass or "
                              "security.users_file) or server.protected_mode = false: in protected mode "
                              "peers' RESP connections from other hosts would be refused")
        if self.admin.port and not self.admin.token and passwords:
            raise ConfigError("admin.token (QUILLD_ADMIN_TOKEN) is required when clients need passwords "
                              "(security.requirepass or security.users_file): without it anyone who reaches "
                              "admin.port could remove engines and register their own. Set it, or turn the "
                              "admin API off with admin.port = 0 (--admin-port 0)")
        for seed in filter(None, (x.strip() for x in c.seeds.split(","))):
            host, _, port = seed.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"cluster.seeds: {seed!r} is not host:port")
        if c.seeds.strip() and not c.gossip_port:
            raise ConfigError("cluster.seeds (--seeds) needs cluster.gossip_port (--gossip-port): a node joins its "
                              "seeds over gossip, so it needs a gossip port of its own, e.g. --gossip-port 7381")
        ix = self.index
        if ix.backend not in INDEX_BACKENDS:
            raise ConfigError(f"index.backend must be one of {', '.join(INDEX_BACKENDS)}, got {ix.backend!r}")
        if ix.backend != "memory" and not ix.path:
            raise ConfigError(f"index.backend = {ix.backend!r} needs index.path, the directory it keeps the "
                              "residency index in")
        if not 1 <= ix.commit_ms <= 60_000:
            raise ConfigError(f"index.commit_ms must be within 1..60000, got {ix.commit_ms}")
        g = self.gateway
        if min(g.ttft_slo_ms, g.connect_timeout_ms, g.first_byte_timeout_ms, g.chunk_chars, g.max_attempts,
               g.recorded_blocks) <= 0:
            raise ConfigError("gateway: timeouts, chunk_chars, max_attempts and recorded_blocks must be positive")
        if g.handoff_wait_ms < 0:
            raise ConfigError(f"gateway.handoff_wait_ms must be 0 or more, got {g.handoff_wait_ms}")
        if g.session_max < 1 or not 0 < g.session_idle_s < float("inf"):
            raise ConfigError(f"gateway: session_max must be at least 1 and session_idle_s a positive number of "
                              f"seconds, got {g.session_max} and {g.session_idle_s}")
        for name, section in (("admin", self.admin), ("gateway", g)):
            if min(section.max_connections, section.header_timeout_ms, section.body_timeout_ms) <= 0:
                raise ConfigError(f"{name}.max_connections, {name}.header_timeout_ms and {name}.body_timeout_ms "
                                  "must be positive")
        return self

    def redacted(self) -> dict[str, dict[str, Any]]:
        """The effective config as plain data, secrets replaced by `***`."""
        out = dataclasses.asdict(self)
        for section, key in _SECRETS:
            if out[section][key]:
                out[section][key] = "***"
        for e in out["engines"]:
            for secret in ("api_key", "hash_seed"):
                if e[secret]:
                    e[secret] = "***"
        return out


# Descriptors kept for everything but RESP clients (server.max_clients is sized to fit the
# limit around them: quilld/context/open_files.py). Redis keeps CONFIG_MIN_RESERVED_FDS (32) for
# its listeners, log and event loop; quilld's base (listeners, log, event loop, the arena's and the
# lease table's memory files) is 17 descriptors, so 32 covers it with room, plus what its parts open.
RESERVED_FDS = 32
SSD_FDS = 8  # the SSD tier's WAL, lock, directory, key and checkpoint files, beyond one per segment
CLUSTER_PEERS_RESERVED = 16  # peers whose outgoing connections are counted in the reserve
PEER_FDS = 16  # per peer: PeerPool's connections (8), the directory's (4) and room for a reconnect
ENGINE_FDS = 8  # per engine: its ZMQ KV-event and replay sockets and their share of the ZMQ context


def reserved_fds(cfg: Config) -> int:
    """Descriptors this configuration keeps for everything but RESP clients and HTTP listeners:
    RESERVED_FDS, the SSD tier's files, the gossip sockets and connections to peers, the engines'
    KV-event subscriptions. (RESP clients are `server.max_clients`, peers' connections to this node
    among them; the HTTP listeners' own caps are counted by their module.)"""
    n = RESERVED_FDS
    if cfg.ssd.dir:
        n += -(-cfg.ssd.size // cfg.ssd.segment_size) + SSD_FDS
    if cfg.cluster.enabled:
        n += 2 + CLUSTER_PEERS_RESERVED * PEER_FDS
    n += ENGINE_FDS * len(cfg.engines)
    return n


def map_user_names(spec: str) -> frozenset[str]:
    """security.map_users' names."""
    return frozenset(u.strip() for u in spec.split(",") if u.strip())


def shm_leases_per_user(cfg: Config) -> int:
    """Leases of the shared-memory table one user may hold: server.shm_max_leases_per_user, or
    (0) an equal share of the table per user allowed to map, so none can starve another."""
    return cfg.server.shm_max_leases_per_user or SHM_SLOTS // max(1, len(map_user_names(cfg.security.map_users)))


def is_loopback(host: str) -> bool:
    """Whether `host` (an IP literal, `localhost`, or a peer's address) is this machine's loopback:
    127.0.0.0/8, ::1 or an IPv4-mapped 127.x. `0.0.0.0`, `::`, `""` and other names are not."""
    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def protected_mode_refuses(server: ServerConfig, passwords: bool, peer: str | None) -> bool:
    """Protected mode's decision for one connection on any listener: refused when protected mode
    is on, no password is in force (`passwords`: the node's users require AUTH) and the peer is
    not loopback (or unknown)."""
    return server.protected_mode and not passwords and not (peer is not None and is_loopback(peer))


PROTECTED_MODE_REFUSAL = (
    "quilld is running in protected mode because protected mode is enabled and no password is set for "
    "the default user. In this mode connections are only accepted from the loopback interface. If you want "
    "to connect from external computers to quilld you may adopt one of the following solutions: 1) Set a "
    "password: security.requirepass (--requirepass) or security.users_file (--users-file); the admin API then "
    "needs admin.token too. 2) Disable protected mode: server.protected_mode = false in the config file, "
    "QUILLD_SERVER_PROTECTED_MODE=false or --protected-mode no, and restart; MAKE SURE quilld is not reachable "
    "from the internet if you do so. NOTE: You only need to do one of the above things in order for the "
    "server to start accepting connections from the outside.")


def validate_engine(e: EngineConfig) -> EngineConfig:
    """Check one engine's fields (from the config file or the admin API)."""
    if not e.id or not e.model or not e.url:
        raise ConfigError("an engine needs an id, a model and a url")
    if e.kind not in ENGINE_KINDS:
        raise ConfigError(f"engine {e.id}: kind must be one of {', '.join(ENGINE_KINDS)}")
    if e.block_size <= 0:
        raise ConfigError(f"engine {e.id}: block_size must be positive")
    if e.role not in ENGINE_ROLES:
        raise ConfigError(f"engine {e.id}: role must be one of {', '.join(ENGINE_ROLES)}, got {e.role!r}")
    if e.kv_bytes_per_token <= 0:
        raise ConfigError(f"engine {e.id}: kv_bytes_per_token must be positive")
    if e.kv_event_hashes not in KV_EVENT_HASHES:
        raise ConfigError(f"engine {e.id}: kv_event_hashes must be int (vLLM's default) or bytes "
                          f"(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), got {e.kv_event_hashes!r}")
    if e.prefix_caching_hash_algo and e.prefix_caching_hash_algo not in PREFIX_HASH_ALGOS:
        raise ConfigError(f"engine {e.id}: prefix_caching_hash_algo must be one of {', '.join(PREFIX_HASH_ALGOS)} "
                          f"(vLLM's --prefix-caching-hash-algo), got {e.prefix_caching_hash_algo!r}")
    if e.kv_transfer in KV_TRANSFERS_NOT_YET:
        raise ConfigError(f"engine {e.id}: kv_transfer = {e.kv_transfer!r} is not supported yet "
                          f"({KV_TRANSFERS_NOT_YET[e.kv_transfer]}); use one of {', '.join(KV_TRANSFERS)}")
    if e.kv_transfer not in KV_TRANSFERS:
        raise ConfigError(f"engine {e.id}: kv_transfer must be one of {', '.join(KV_TRANSFERS)} "
                          f"(pool: through quilld; nixl, mooncake: engine to engine), got {e.kv_transfer!r}")
    if e.kv_transfer == "mooncake" and not e.kv_engine_id:
        raise ConfigError(f"engine {e.id}: kv_transfer = \"mooncake\" needs kv_engine_id: the decode engine finds "
                          f"the prefill's KV by the engine_id of its --kv-transfer-config (give vLLM a fixed one, "
                          f"e.g. \"engine_id\": \"{e.id}\", and the same here)")
    if e.kv_bootstrap:
        host, sep, port = e.kv_bootstrap.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(f"engine {e.id}: kv_bootstrap must be host:port (its Mooncake bootstrap server), "
                              f"got {e.kv_bootstrap!r}")
    if len(e.groups) > MAX_KV_GROUPS:
        raise ConfigError(f"engine {e.id}: at most {MAX_KV_GROUPS} groups, got {len(e.groups)}")
    for i, g in enumerate(e.groups):
        where = f"engine {e.id}: groups[{i}]"
        if g.kind not in GROUP_KINDS:
            raise ConfigError(f"{where}.kind must be one of {', '.join(GROUP_KINDS)} (vLLM's full_attention and "
                              f"mla_attention are full, sliding_window_mla is sliding_window), got {g.kind!r}")
        if g.kind == "sliding_window" and g.window_tokens <= 0:
            raise ConfigError(f"{where}: a sliding_window group needs window_tokens, its window in tokens "
                              f"(vLLM's sliding_window, e.g. 4096), got {g.window_tokens}")
        if g.kind != "sliding_window" and g.window_tokens:
            raise ConfigError(f"{where}: window_tokens is for sliding_window groups only, not {g.kind}")
    return e


def _group_from(data: Any, where: str) -> GroupConfig:
    """One KV-cache group from a table of the config file or a JSON object."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: a group is a table such as {{kind = \"full\"}} or "
                          f"{{kind = \"sliding_window\", window_tokens = 4096}}")
    types = _types(GroupConfig)
    unknown = set(data) - set(types)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (a group has kind and window_tokens)")
    return GroupConfig(**{k: _coerce(where, k, types[k], v) for k, v in data.items()})


def _lora_modules(data: Any, origin: str) -> tuple[tuple[str, str], ...]:
    """An engine's LoRA adapters: a table {name = "path"}, or a list of "name=path" strings (vLLM's
    --lora-modules) or of [name, path] pairs (how the engine table travels between nodes)."""
    how = (f"{origin}: lora_modules is a table of adapter name to the path the engine loads it from, "
           f"e.g. {{sql-lora = \"/models/sql-lora\"}}, or a list of \"name=path\"")
    if isinstance(data, Mapping):
        pairs = list(data.items())
    elif isinstance(data, (list, tuple)):
        pairs = []
        for item in data:
            if isinstance(item, str) and "=" in item:
                pairs.append(tuple(item.split("=", 1)))
            elif isinstance(item, (list, tuple)) and len(item) == 2:
                pairs.append(tuple(item))
            else:
                raise ConfigError(f"{how}; got {item!r:.60}")
    else:
        raise ConfigError(f"{how}; got {data!r:.60}")
    out: dict[str, str] = {}
    for name, path in pairs:
        if not (isinstance(name, str) and isinstance(path, str) and name.strip() and path.strip()):
            raise ConfigError(f"{how}; got {name!r:.40} = {path!r:.60}")
        if name in out and out[name] != path:
            raise ConfigError(f"{origin}: lora_modules names adapter {name!r} twice, with two paths")
        out[name] = path
    return tuple(sorted(out.items()))


SEED_ENV_PREFIX = "env:"  # hash_seed = "env:NAME": the seed is environment variable NAME's value


def _resolve_hash_seed(data: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """`data` with its hash_seed read from `hash_seed_file` (the file's text, stripped) or from the
    environment (`hash_seed = "env:NAME"`). The errors name the file or variable, never the seed."""
    out = dict(data)
    path = out.pop("hash_seed_file", None)
    if path is not None:
        if "hash_seed" in out:
            raise ConfigError(f"{origin}: give hash_seed or hash_seed_file, not both")
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{origin}: hash_seed_file must be a file's path")
        try:
            with open(path, encoding="utf-8") as f:
                seed = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{origin}: hash_seed_file {path!r} cannot be read: "
                              f"{getattr(e, 'strerror', None) or type(e).__name__}") from None
        if not seed:
            raise ConfigError(f"{origin}: hash_seed_file {path!r} is empty")
        out["hash_seed"] = seed
        return out
    name = str(out["hash_seed"])[len(SEED_ENV_PREFIX):]
    seed = os.environ.get(name, "") if name else ""
    if not seed:
        raise ConfigError(f"{origin}: hash_seed names environment variable {name!r}, which is unset or empty")
    out["hash_seed"] = seed
    return out


def engine_from(data: Mapping[str, Any], origin: str) -> EngineConfig:
    """An EngineConfig from a table of the config file or a JSON body."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{origin}: an engine must be a table")
    types = _types(EngineConfig)
    if "kv_node" in data:
        if "locality" in data and data["locality"] != data["kv_node"]:
            raise ConfigError(f"{origin}: kv_node and locality (its older name) differ: give kv_node alone")
        data = {ENGINE_KEY_ALIASES.get(k, k): v for k, v in data.items() if k != "locality"}
    if "hash_seed_file" in data or str(data.get("hash_seed", "")).startswith(SEED_ENV_PREFIX):
        data = _resolve_hash_seed(data, origin)
    unknown = set(data) - set(types)
    if unknown:
        raise ConfigError(f"{origin}: unknown engine key(s) {', '.join(sorted(unknown))}"
                          + "".join(_did_you_mean(k, types) for k in sorted(unknown)[:1]))
    values = {k: _coerce("engines", k, types[k], v) for k, v in data.items() if k not in ("groups", "lora_modules")}
    if "lora_modules" in data:
        values["lora_modules"] = _lora_modules(data["lora_modules"], origin)
    if "groups" in data:
        groups = data["groups"]
        if not isinstance(groups, (list, tuple)):
            raise ConfigError(f"{origin}: groups must be a list of tables, e.g. [{{kind = \"full\"}}, "
                              "{kind = \"sliding_window\", window_tokens = 4096}, {kind = \"mamba\"}]")
        values["groups"] = tuple(_group_from(g, f"{origin}: groups[{i}]") for i, g in enumerate(groups))
    return validate_engine(EngineConfig(**values))


# QUILLD_CONFIG and QUILLD_LOG_LEVEL are read by the CLI, QUILLD_PURE_PYTHON by quilld/native.py
_CLI_ONLY = {"config", "log_level", "pure_python"}
_SECRETS = (("security", "requirepass"), ("admin", "token"), ("cluster", "secret"), ("cluster", "etcd_password"))
OCTAL_KEYS = {("server", "unixsocketperm")}
SIZE_KEYS = {("dram", "size"), ("dram", "inline_max"), ("dram", "maxmemory"),
              ("server", "proto_max_bulk_len"), ("server", "client_output_high_water"), ("server", "client_query_buffer_limit"),
              ("ssd", "size"), ("ssd", "segment_size"),
              ("ssd", "group_commit_bytes"), ("ssd", "checkpoint_wal_bytes")}


def _coerce(section: str, key: str, kind: type, value: Any) -> Any:
    where = f"{section}.{key}"
    try:
        if (section, key) in OCTAL_KEYS:
            try:
                return parse_mode(value)
            except ValueError:
                raise ConfigError(f"{where}: invalid mode {value!r} (octal digits as a string, e.g. \"700\", "
                                  "or a TOML 0o700)") from None
        if (section, key) in SIZE_KEYS:
            try:
                return parse_size(value)
            except ConfigError as e:
                raise ConfigError(f"{where}: {e.message}") from None
        if kind is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if kind is float:
            return float(value)
        return str(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{where}: invalid value {value!r} (expected {kind.__name__})") from None


def _did_you_mean(name: str, known: Any, elsewhere: Mapping[str, Any] | None = None, fmt: str = "{}") -> str:
    """" (did you mean X?)" for the known name closest to a misspelt `name` (difflib's ratio 0.75 and
    up), or, with `elsewhere` ({section: its keys}), the same key in another section; else ""."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    if close:
        return f" (did you mean {fmt.format(close[0])}?)"
    for section, keys in (elsewhere or {}).items():
        if name in keys:
            return f" (did you mean {section}.{name}?)"
    return ""


def _section_keys() -> dict[str, dict[str, type]]:
    """Every section's keys (engines, a list of tables, left out)."""
    return {f.name: _types(f.default_factory().__class__) for f in fields(Config)  # type: ignore[misc]
            if f.name != "engines"}


def _types(section_cls: type) -> dict[str, type]:
    """Each field's scalar type (a field of another type, such as EngineConfig.groups, maps to None:
    its caller reads it itself)."""
    hints = {"int": int, "float": float, "str": str, "bool": bool}
    return {f.name: hints.get(f.type) if isinstance(f.type, str) else f.type for f in fields(section_cls)}


def _apply(cfg: Config, updates: Mapping[str, Mapping[str, Any]], origin: str) -> Config:
    sections = {f.name: f for f in fields(Config)}
    for section, values in updates.items():
        if section not in sections:
            raise ConfigError(f"{origin}: unknown section [{section}]" + _did_you_mean(section, sections, fmt="[{}]"))
        if section == "engines":
            if not isinstance(values, list):
                raise ConfigError(f"{origin}: engines are [[engines]] tables")
            engines = tuple(engine_from(v, f"{origin}: engines[{i}]") for i, v in enumerate(values))
            cfg = replace(cfg, engines=engines)
            continue
        if not isinstance(values, Mapping):
            raise ConfigError(f"{origin}: [{section}] must be a table")
        current = getattr(cfg, section)
        types = _types(type(current))
        changes = {}
        for key, value in values.items():
            if key not in types:
                raise ConfigError(f"{origin}: unknown key {section}.{key}" + _did_you_mean(
                    key, types, _section_keys(), fmt=f"{section}.{{}}"))
            changes[key] = _coerce(section, key, types[key], value)
        cfg = replace(cfg, **{section: replace(current, **changes)})
    return cfg


def _from_env(environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    known = _section_keys()
    out: dict[str, dict[str, str]] = {}
    for name, value in environ.items():
        if not name.startswith("QUILLD_"):
            continue
        rest = name[len("QUILLD_"):].lower()
        if rest in _CLI_ONLY:
            continue
        section, _, key = rest.partition("_")
        if section not in known or key not in known[section]:
            names = [f"QUILLD_{sec}_{k}".upper() for sec, keys in known.items() for k in keys]
            guess = _did_you_mean(name, names).removesuffix("?)")
            raise ConfigError(f"environment: {name} names no config key"
                              + (f"{guess}? Names are QUILLD_<SECTION>_<KEY>)" if guess
                                 else " (expected QUILLD_<SECTION>_<KEY>)"))
        out.setdefault(section, {})[key] = value
    return out


def load(path: str | None = None, environ: Mapping[str, str] | None = None,
         overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Config:
    """Build the effective config: defaults < file < environment < overrides (flags)."""
    cfg = Config()
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: {e}") from None
        cfg = _apply(cfg, data, path)
    cfg = _apply(cfg, _from_env(os.environ if environ is None else environ), "environment")
    if overrides:
        cfg = _apply(cfg, overrides, "flags")
    return cfg.validate()
