"""CONFIG GET, SET, RESETSTAT, REWRITE and HELP over every parameter redis 7.0.15 has.

Each parameter is one of three things for quilld:

- applied (`APPLIED`): quilld uses it, and CONFIG SET changes it while the node runs:
  maxmemory (dram.maxmemory: eviction starts at dram.high_watermark of it and stops at
  dram.low_watermark of it; at most the arena's size, which is fixed at start; 0, the
  default, means the whole arena, and CONFIG GET answers it as set, 0 included, as redis
  does, and so does INFO's maxmemory; INFO's dram_capacity is the arena), maxmemory-policy
  (dram.maxmemory_policy: what goes when DRAM is full and there is no SSD tier to demote to,
  tiers/eviction.py; allkeys-lru by default) with lfu-log-factor and lfu-decay-time (its LFU
  counters' growth and decay; until a restart, not rewritten), maxclients, timeout,
  slowlog-log-slower-than, slowlog-max-len, latency-monitor-threshold, proto-max-bulk-len,
  client-query-buffer-limit, loglevel, latency-tracking-info-percentiles,
  tracking-table-max-keys (CLIENT TRACKING's table, protocol/tracking.py), requirepass (user
  default's password, as redis: ACL SETUSER default resetpass >value; "" for nopass; kept
  until a restart, not rewritten). CONFIG REWRITE writes those with a config key back to
  the config file (`CONFIG_KEYS`).
- answered and kept (`REFUSED`): quilld has a value for it (port, bind, save, appendonly,
  hz, ...) or lacks the feature it switches on (keyspace
  notifications, TLS, client eviction, active defrag); CONFIG GET answers quilld's value,
  CONFIG SET to that same value is accepted, and any other value is refused with the
  reason.
- recorded: the settings of subsystems quilld does not have (other data types' encodings,
  replication, AOF and RDB tuning, cluster bus, Lua, lazy freeing, ...): CONFIG GET answers
  redis's default, or what CONFIG SET stored; nothing else changes, since the commands
  they would tune do not exist here.

Every value is checked as redis checks it, with redis's errors, before anything is
changed; a failure leaves every parameter of the call as it was. Redis's immutable and
protected parameters refuse CONFIG SET as redis refuses it. Changing anything, and
RESETSTAT and REWRITE, are the operator's (`default`'s): they affect every tenant.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import tomllib
from dataclasses import replace
from typing import Callable

from quilld.config import MAXMEMORY_POLICIES
from quilld.errors import CommandError, echo
from quilld.protocol.commands.client import operator_only
from quilld.protocol.commands.command_docs import help_reply
from quilld.protocol.commands.config_params import PARAMS, P
from quilld.protocol.commands.keys import glob_matcher
from quilld.context.node_context import NodeContext, apply_maxmemory, slow_ns
from quilld.context.figures import reset_stats
from quilld.context.open_files import fit_open_files
from quilld.protocol.info import HZ
from quilld.protocol.resp import OK
from quilld.protocol.table import CommandTable
from quilld.security import Login, digest

BY_NAME: dict[str, P] = {}
for _p in PARAMS:
    BY_NAME[_p.name] = _p
    if _p.alias:
        BY_NAME[_p.alias] = _p
LISTED = sorted(n for n, p in BY_NAME.items() if "hidden" not in p.flags.split())
_INT = re.compile(rb"-?(0|[1-9][0-9]*)")
_MEM_UNITS = {b"": 1, b"b": 1, b"k": 1000, b"kb": 1024, b"m": 1000 ** 2, b"mb": 1024 ** 2, b"g": 1000 ** 3,
              b"gb": 1024 ** 3}
LOG_LEVELS = {"debug": logging.DEBUG, "verbose": 15, "notice": logging.INFO, "warning": logging.WARNING,
              "nothing": logging.CRITICAL + 10}
_log = logging.getLogger("quilld")


class Failed(Exception):
    """A value redis would refuse, or one quilld cannot take: the reason after ' - '."""


# -- checking values as redis does --------------------------------------------------
def _strict_int(raw: bytes) -> int | None:
    """redis's string2ll: an optional '-', no leading zeros, no spaces, 64 bits."""
    if not _INT.fullmatch(raw) or raw == b"-0":
        return None
    n = int(raw)
    return n if -(1 << 63) <= n < (1 << 63) else None


def _memtoull(raw: bytes) -> int | None:
    m = re.fullmatch(rb"([0-9]*)([a-zA-Z]*)", raw)
    if not m or raw.startswith(b"-") or m.group(2).lower() not in _MEM_UNITS:
        return None
    digits = m.group(1)
    n = int(digits) if digits else 0
    return n * _MEM_UNITS[m.group(2).lower()] if n < (1 << 64) else None


def check(p: P, raw: bytes) -> str:
    """The value as CONFIG GET will answer it, or Failed with redis's reason."""
    kind = p.kind
    if kind == "bool":
        word = raw.lower()
        if word not in (b"yes", b"no"):
            raise Failed("argument must be 'yes' or 'no'")
        return word.decode()
    if kind == "enum":
        choices = p.choices.split()
        words = raw.lower().decode("latin-1").split() if "multi_arg" in p.flags.split() else [
            raw.lower().decode("latin-1")]
        if not words or any(w not in choices for w in words):
            raise Failed("argument(s) must be one of the following: " + ", ".join(choices))
        return " ".join(words)
    if kind in ("int", "uint"):
        return str(_number(p, raw))
    if kind == "special":
        return _special(p, raw)
    return raw.decode("utf-8", "surrogateescape")


def _number(p: P, raw: bytes) -> int | str:
    fmt, value = p.fmt.split(), None
    if "memory" in fmt:
        value = _memtoull(raw)
    if value is None and "percent" in fmt and len(raw) > 1 and raw.endswith(b"%"):
        pct = _strict_int(raw[:-1])
        if pct is not None and pct >= 0:
            if pct > 100:
                raise Failed("percentage argument must be less or equal to 100")
            return f"{pct}%"
    if value is None and "octal" in fmt:
        value = int(raw, 8) if re.fullmatch(rb"[+-]?[0-7]+", raw) else None
    if value is None and not fmt:
        value = _strict_int(raw)
    if value is None:
        raise Failed("argument must be a memory or percent value" if fmt == ["memory", "percent"] else
                     "argument must be a memory value" if "memory" in fmt else
                     "argument couldn't be parsed as an octal number" if "octal" in fmt else
                     "argument couldn't be parsed into an integer")
    lo, hi = p.bounds
    if p.kind == "uint" and value < 0:
        value += 1 << 64
    if not lo <= value <= hi:
        shown = (f"{lo:o}", f"{hi:o}") if "octal" in fmt else (lo, hi)
        raise Failed(f"argument must be between {shown[0]} and {shown[1]} inclusive")
    return f"{value:o}" if "octal" in fmt else value


def _special(p: P, raw: bytes) -> str:
    words = raw.decode("utf-8", "surrogateescape").split()
    if p.name == "save":
        if len(words) % 2 or any(not re.fullmatch(r"-?[0-9]+", w) for w in words) or any(
                int(w) < (1 if i % 2 == 0 else 0) for i, w in enumerate(words)):
            raise Failed("Invalid save parameters")
    elif p.name == "latency-tracking-info-percentiles":
        try:
            values = [float(w) for w in words]
        except ValueError:
            values = [-1.0]
        if any(not 0.0 <= v <= 100.0 for v in values):
            raise Failed("latency-tracking-info-percentiles: percentile must be between 0.0 and 100.0")
        return " ".join(f"{v:g}" for v in values)
    return " ".join(words)


# -- what quilld answers and applies -------------------------------------------------
Getter = Callable[[NodeContext], str]
Setter = Callable[[NodeContext, str], None]


def _set_maxmemory(ctx: NodeContext, value: str) -> None:
    n, capacity = int(value), ctx.keyspace.capacity
    if n > capacity:
        raise Failed(f"maxmemory cannot exceed the DRAM arena ({capacity} bytes, dram.size), which is fixed "
                     f"when quilld starts")
    apply_maxmemory(ctx, n)


def _set_policy(ctx: NodeContext, value: str) -> None:
    if value not in MAXMEMORY_POLICIES:
        raise Failed(f"quilld does not offer {value}: a cache pool keeps an exact LRU, and a random victim is "
                     f"only worse (one of {', '.join(MAXMEMORY_POLICIES)})")
    ctx.keyspace.set_policy(value)


def _runtime(field: str) -> tuple[Getter, Setter]:
    def get(ctx: NodeContext) -> str:
        return str(getattr(ctx.runtime, field))

    def set_(ctx: NodeContext, value: str) -> None:
        setattr(ctx.runtime, field, int(value))
        ctx.table.set_timing(slow_ns(ctx.runtime))
        if field == "proto_max_bulk_len":
            for conn in ctx.clients.connections.values():
                conn.parser.max_bulk_len = int(value)

    return get, set_


def _loglevel(ctx: NodeContext) -> str:
    level = _log.getEffectiveLevel()
    return min(LOG_LEVELS, key=lambda name: abs(LOG_LEVELS[name] - level))


def _set_loglevel(ctx: NodeContext, value: str) -> None:
    _log.setLevel(LOG_LEVELS[value])


def _set_maxclients(ctx: NodeContext, value: str) -> None:
    """As redis's updateMaxclients: more clients than now first raise the descriptor limit to fit
    them; a value it cannot fit is refused with the number that would fit."""
    n = int(value)
    if n > ctx.clients.max_clients:
        fit = fit_open_files(ctx.cfg, n)
        if fit.maxclients < n:
            raise Failed("The operating system is not able to handle the specified number of clients, "
                         f"try with {fit.maxclients}")
    ctx.clients.max_clients = n


def _percentiles(ctx: NodeContext) -> str:
    return ctx.runtime.inert.get("latency-tracking-info-percentiles", "50 99 99.9")


def _set_percentiles(ctx: NodeContext, value: str) -> None:
    ctx.runtime.inert["latency-tracking-info-percentiles"] = value


def _set_tracking_max_keys(ctx: NodeContext, value: str) -> None:
    """CLIENT TRACKING's table holds at most this many keys (0: no bound); a table fuller than the
    new bound is trimmed at once, as much as one pass may (tracking.TRIM_EFFORT), then by each read."""
    tracking = ctx.clients.tracking
    tracking.max_keys = int(value)
    tracking.trim()


def _requirepass(ctx: NodeContext) -> str:
    return ctx.runtime.inert.get("requirepass", ctx.cfg.security.requirepass)


def _set_requirepass(ctx: NodeContext, value: str) -> None:
    """As redis: user default's one password (`ACL SETUSER default resetpass >value`), or nopass
    for "". Refused while the admin API is open without admin.token (quilld starts no node so)."""
    users, admin = ctx.users, ctx.cfg.admin
    if value and admin.port and not admin.token and not users.required:
        raise Failed("quilld refuses passwords while its admin API is open without admin.token: set admin.token "
                     "(QUILLD_ADMIN_TOKEN) and restart, then set the password")
    now = users.login_of("default")
    login = Login(enabled=now.enabled, nopass=not value, digests=(digest(value.encode()),) if value else ())
    acl = users.acl_of("default")
    users.set_login("default", login, None if acl is None else replace(acl, login=login))
    ctx.runtime.inert["requirepass"] = value


APPLIED: dict[str, tuple[Getter, Setter]] = {
    "requirepass": (_requirepass, _set_requirepass),
    "maxmemory": (lambda ctx: str(ctx.runtime.maxmemory), _set_maxmemory),  # as set: 0 is "the whole arena"
    "maxmemory-policy": (lambda ctx: ctx.keyspace.policy, _set_policy),
    "lfu-log-factor": (lambda ctx: str(ctx.keyspace.lfu.log_factor),
                       lambda ctx, v: setattr(ctx.keyspace.lfu, "log_factor", int(v))),
    "lfu-decay-time": (lambda ctx: str(ctx.keyspace.lfu.decay_minutes),
                       lambda ctx, v: setattr(ctx.keyspace.lfu, "decay_minutes", int(v))),
    "maxclients": (lambda ctx: str(ctx.clients.max_clients), _set_maxclients),
    "timeout": _runtime("timeout"),
    "slowlog-log-slower-than": _runtime("slowlog_log_slower_than"),
    "slowlog-max-len": _runtime("slowlog_max_len"),
    "latency-monitor-threshold": _runtime("latency_monitor_threshold"),
    "proto-max-bulk-len": _runtime("proto_max_bulk_len"),
    "client-query-buffer-limit": _runtime("client_query_buffer_limit"),
    "loglevel": (_loglevel, _set_loglevel),
    "latency-tracking-info-percentiles": (_percentiles, _set_percentiles),
    "tracking-table-max-keys": (lambda ctx: str(ctx.clients.tracking.max_keys), _set_tracking_max_keys),
}

# config keys CONFIG REWRITE writes: parameter -> (section, key, value from the runtime)
CONFIG_KEYS: dict[str, tuple[str, str]] = {
    "maxclients": ("server", "max_clients"), "timeout": ("server", "timeout"),
    "slowlog-log-slower-than": ("server", "slowlog_log_slower_than"),
    "slowlog-max-len": ("server", "slowlog_max_len"),
    "latency-monitor-threshold": ("server", "latency_monitor_threshold"),
    "proto-max-bulk-len": ("server", "proto_max_bulk_len"),
    "client-query-buffer-limit": ("server", "client_query_buffer_limit"),
    "tracking-table-max-keys": ("server", "tracking_table_max_keys"),
}

_RESTART = "set it in the config file and restart quilld"
REFUSED: dict[str, tuple[Getter, str]] = {
    "port": (lambda ctx: str(ctx.port), f"quilld cannot move its RESP listener while it runs: {_RESTART} "
                                        "(server.port)"),
    "bind": (lambda ctx: ctx.cfg.server.bind, f"quilld cannot move its listeners while it runs: {_RESTART} "
                                              "(server.bind)"),
    "unixsocket": (lambda ctx: ctx.cfg.server.unixsocket,
                   f"quilld cannot move its unix socket while it runs: {_RESTART} (server.unixsocket)"),
    "unixsocketperm": (lambda ctx: f"{ctx.cfg.server.unixsocketperm:o}",
                       f"the unix socket's mode is fixed at start: {_RESTART} (server.unixsocketperm)"),
    "protected-mode": (lambda ctx: "yes" if ctx.cfg.server.protected_mode else "no",
                       f"protected mode is fixed at start: {_RESTART} (server.protected_mode)"),
    "save": (lambda ctx: "", "quilld takes no RDB snapshots: its SSD tier (ssd.dir) keeps blocks across restarts"),
    "appendonly": (lambda ctx: "no", "quilld has no append-only file: its SSD tier (ssd.dir) keeps blocks "
                                     "across restarts, with its own write-ahead log"),
    "maxmemory-clients": (lambda ctx: "0", "quilld does not evict clients"),
    "hz": (lambda ctx: str(HZ), f"quilld's housekeeping runs {HZ} times a second, always"),
    "dynamic-hz": (lambda ctx: "no", f"quilld's housekeeping runs {HZ} times a second, always"),
    "notify-keyspace-events": (lambda ctx: "", "quilld has no keyspace notifications (no pub/sub)"),
    "client-output-buffer-limit": (lambda ctx: "normal 0 0 0 slave 268435456 67108864 60 pubsub 33554432 8388608 60",
                                   "quilld stops reading from a client whose replies are not drained "
                                   "(server.client_output_high_water) instead of closing it"),
    "activedefrag": (lambda ctx: "no", "quilld's arena is offset-allocated: there is nothing to defragment"),
    "latency-tracking": (lambda ctx: "yes", "quilld always tracks command latency (see slowlog-log-slower-than)"),
    "tls-port": (lambda ctx: "0", "quilld has no TLS listener"),
    "oom-score-adj": (lambda ctx: "no", "quilld does not set its OOM score"),
    "oom-score-adj-values": (lambda ctx: "0 200 800", "quilld does not set its OOM score"),
    "appendfsync": (lambda ctx: "everysec", "quilld has no append-only file"),
    "tcp-backlog": (lambda ctx: "1024", ""),
    "databases": (lambda ctx: "1", ""),
    "dir": (lambda ctx: os.getcwd(), ""),
    "io-threads": (lambda ctx: "1", ""),
    "daemonize": (lambda ctx: "no", ""),
    "cluster-enabled": (lambda ctx: "no", ""),
    "enable-debug-command": (lambda ctx: ctx.cfg.security.enable_debug_command, ""),
}


def value_of(ctx: NodeContext, p: P, secrets: bool) -> str:
    """What CONFIG GET answers for `p` (sensitive values only to the operator)."""
    if "sensitive" in p.flags.split() and not secrets:
        return ""
    if p.name in APPLIED:
        return APPLIED[p.name][0](ctx)
    if p.name in REFUSED:
        return REFUSED[p.name][0](ctx)
    return ctx.runtime.inert.get(p.name, p.default)


def cmd_config_get(c, args):
    ctx, out = c.ctx, {}
    secrets = c.user == "default"
    for raw in args[2:]:
        pattern = bytes(raw).lower()
        if not any(ch in pattern for ch in b"[*?"):
            p = BY_NAME.get(pattern.decode("utf-8", "surrogateescape"))
            if p is not None:
                out.setdefault(pattern, value_of(ctx, p, secrets).encode("utf-8", "surrogateescape"))
            continue
        match = glob_matcher(pattern)
        for name in LISTED:
            if name.encode() not in out and match(name.encode()):
                out[name.encode()] = value_of(ctx, BY_NAME[name], secrets).encode("utf-8", "surrogateescape")
    return out


def cmd_config_set(c, args):
    if len(args) % 2:
        raise CommandError("syntax error")
    ctx = c.ctx
    chosen: list[tuple[P, bytes]] = []
    unknown = error = None
    for name_raw, value in zip(args[2::2], args[3::2]):
        p = BY_NAME.get(bytes(name_raw).lower().decode("utf-8", "surrogateescape"))
        if unknown is not None or error is not None:
            continue
        if p is None:
            unknown = name_raw
            continue
        flags = p.flags.split()
        if "immutable" in flags or "protected" in flags:
            error = (name_raw, "can't set immutable config" if "immutable" in flags else "can't set protected config")
        elif any(q is p for q, _ in chosen):
            error = (name_raw, "duplicate parameter")
        chosen.append((p, bytes(value)))
    if unknown is not None:
        raise CommandError(f"Unknown option or number of arguments for CONFIG SET - '{echo(unknown)}'")
    if error is not None:
        raise CommandError(f"CONFIG SET failed (possibly related to argument '{echo(error[0])}') - {error[1]}")
    operator_only(c, "config|set")
    values = []
    for p, raw in chosen:  # redis's "set" phase: every value checked first
        try:
            values.append(check(p, raw))
        except Failed as e:
            raise CommandError(f"CONFIG SET failed (possibly related to argument '{p.name}') - {e}") from None
    before = {p.name: value_of(ctx, p, True) for p, _ in chosen}
    done: list[P] = []
    try:  # redis's "apply" phase: a failure puts back what was applied
        for (p, _), value in zip(chosen, values):
            _apply(ctx, p, value, before[p.name])
            done.append(p)
    except Failed as e:
        for q in reversed(done):
            _apply(ctx, q, before[q.name], before[q.name])
        raise CommandError(f"CONFIG SET failed (possibly related to argument '{p.name}') - {e}") from None
    return OK


def _apply(ctx: NodeContext, p: P, value: str, current: str) -> None:
    if p.name in APPLIED:
        APPLIED[p.name][1](ctx, value)
    elif p.name in REFUSED:
        if value != current:
            if p.name == "port":
                _port_free(ctx, int(value))
            raise Failed(REFUSED[p.name][1])
    else:
        ctx.runtime.inert[p.name] = value


def _port_free(ctx: NodeContext, port: int) -> None:
    """redis's apply error when the new port is taken; quilld refuses to move either way."""
    try:
        with socket.socket() as s:
            s.bind((ctx.cfg.server.bind, port))
    except OSError as e:
        raise Failed(f"Unable to listen on this port: {e.strerror}") from None


def cmd_config_resetstat(c, args):
    operator_only(c, "config|resetstat")
    reset_stats(c.ctx)
    return OK


def _toml(value: object) -> str:
    if isinstance(value, str):  # a TOML basic string (the values written here need no escapes)
        return f'"{value}"'
    return repr(value) if isinstance(value, float) else str(value)


def rewrite(path: str, updates: dict[tuple[str, str], object]) -> None:
    """Set `updates` ((section, key) -> value) in the TOML file at `path`, keeping every other
    line and comment; a key not there yet goes at the end of its section. Atomic (rename)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    section, last_line, done = "", {}, set()
    for i, line in enumerate(lines):
        stripped = line.strip()
        m = re.fullmatch(r"\[([A-Za-z0-9_.-]+)\]", stripped)
        if m:
            section = m.group(1)
            last_line[section] = i
            continue
        m = re.match(r"([A-Za-z0-9_]+)\s*=", stripped)
        if m and (section, m.group(1)) in updates:
            lines[i] = f"{m.group(1)} = {_toml(updates[section, m.group(1)])}"
            done.add((section, m.group(1)))
        if stripped and not stripped.startswith("#") and section:
            last_line[section] = i
    inserts: dict[int, list[str]] = {}
    tail: list[str] = []
    for (sec, key), value in updates.items():
        if (sec, key) in done:
            continue
        if sec in last_line:
            inserts.setdefault(last_line[sec], []).append(f"{key} = {_toml(value)}")
        else:
            tail += ["", f"[{sec}]", f"{key} = {_toml(value)}"]
    out: list[str] = []
    for i, line in enumerate(lines):
        out.append(line)
        out.extend(inserts.get(i, []))
    body = "\n".join(out).rstrip("\n") + "\n" + ("\n".join(tail).lstrip("\n") + "\n" if tail else "")
    tomllib.loads(body)  # what is written must load
    tmp = f"{path}.rewrite-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def cmd_config_rewrite(c, args):
    """Write the settings changed at run time back to the config file (quilld's TOML)."""
    operator_only(c, "config|rewrite")
    ctx = c.ctx
    if not ctx.config_file:
        raise CommandError("The server is running without a config file")
    updates: dict[tuple[str, str], object] = {}
    for name, (section, key) in CONFIG_KEYS.items():
        now = int(APPLIED[name][0](ctx))
        if now != getattr(getattr(ctx.cfg, section), key):
            updates[section, key] = now
    if ctx.runtime.maxmemory != ctx.cfg.dram.maxmemory:
        updates["dram", "maxmemory"] = ctx.runtime.maxmemory
    if ctx.keyspace.policy != ctx.cfg.dram.maxmemory_policy:
        updates["dram", "maxmemory_policy"] = ctx.keyspace.policy
    try:
        rewrite(ctx.config_file, updates)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise CommandError(f"Rewriting config file: {getattr(e, 'strerror', None) or e}") from None
    return OK


_HELP = (
    "GET <pattern>",
    "    Return parameters matching the glob-like <pattern> and their values.",
    "SET <directive> <value>",
    "    Set the configuration <directive> to <value>.",
    "RESETSTAT",
    "    Reset statistics reported by the INFO command.",
    "REWRITE",
    "    Rewrite the configuration file.",
)


def cmd_config_help(c, args):
    return help_reply(args, _HELP)


def register(t: CommandTable) -> None:
    sub = CommandTable()
    sub.add("config|get", -3, "", cmd_config_get)
    sub.add("config|help", 2, "", cmd_config_help)
    sub.add("config|resetstat", 2, "", cmd_config_resetstat)
    sub.add("config|rewrite", 2, "", cmd_config_rewrite)
    sub.add("config|set", -4, "", cmd_config_set)
    t.add("config", -2, "", lambda c, a: None, subcommands={n.split(b"|")[1]: x for n, x in sub.commands.items()})
