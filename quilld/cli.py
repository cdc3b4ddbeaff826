"""`quilld` entry point: flags -> config -> node, on uvloop, until SIGINT/SIGTERM.

SIGINT and SIGTERM stop the node cleanly at any moment, each saying so in the
log: before the event loop runs (nothing to undo), while the node starts (the
start is cancelled and what it opened is closed; an SSD recovery under way is
let finish, as its worker thread cannot be interrupted) and while it serves. A
second SIGINT while stopping (Ctrl-C twice) exits at once, as redis does,
leaving what was not flushed to the SSD tier's crash recovery.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from quilld import __version__
from quilld.config import OCTAL_KEYS, SIZE_KEYS, Config, load
from quilld.errors import ConfigError, StopFailed

if TYPE_CHECKING:  # imported in main(), once the stop signals are handled: the import takes about a second
    from quilld.node import Node

log = logging.getLogger("quilld")


def install_loop() -> str:
    """The one place the event loop is chosen: uvloop when importable, else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class Flag:
    """A flag that sets one config key. The one table of them (FLAGS) makes the parser, the
    overrides it hands config.load, and the flag column of docs/reference/configuration.md."""

    name: str  # --bind
    section: str
    key: str
    help: str  # what it sets; the key, its environment variable and its default are added
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] = ()
    default_note: str = ""  # said after the default ("single node" for gossip_port's 0)

    @property
    def env(self) -> str:
        return env_name(self.section, self.key)


def env_name(section: str, key: str) -> str:
    """The environment variable of a config key (config._from_env reads QUILLD_<SECTION>_<KEY>)."""
    return f"QUILLD_{section}_{key}".upper()


FLAGS = (
    Flag("--bind", "server", "bind", "address every listener binds (RESP, admin API, gateway, gossip)"),
    Flag("--port", "server", "port", "RESP port", int),
    Flag("--admin-port", "admin", "port", "admin HTTP port", int, default_note="0 disables it"),
    Flag("--dram", "dram", "size", "DRAM arena size, e.g. 512MiB or 4GiB"),
    Flag("--requirepass", "security", "requirepass", "password of user `default`; AUTH required when set"),
    Flag("--users-file", "security", "users_file", "file of `user password [model=M] [tokenizer=T] [adapter=A]` "
         "lines (tenants)"),
    Flag("--node-id", "server", "node_id", "this node's id", default_note="host:port"),
    Flag("--ssd-dir", "ssd", "dir", "directory of the SSD tier's segments and WAL", default_note="no SSD tier"),
    Flag("--ssd-size", "ssd", "size", "SSD tier capacity, e.g. 64GiB (preallocated at the first start)"),
    Flag("--gossip-port", "cluster", "gossip_port", "cluster gossip port, UDP and TCP", int,
         default_note="single node"),
    Flag("--seeds", "cluster", "seeds", "comma-separated host:port gossip addresses of nodes to join"),
    Flag("--registry", "cluster", "registry", "how members find each other: gossip or etcd"),
    Flag("--etcd-endpoints", "cluster", "etcd_endpoints", "comma-separated etcd client URLs (--registry etcd)",
         default_note="none"),
    Flag("--etcd-prefix", "cluster", "etcd_prefix", "the prefix of every key quilld keeps in etcd"),
    Flag("--gateway-port", "gateway", "port", "OpenAI-compatible gateway port", int, default_note="off"),
    Flag("--unixsocket", "server", "unixsocket", "unix socket path to listen on beside TCP (its directory must "
         "exist)", default_note="none"),
    Flag("--unixsocketperm", "server", "unixsocketperm", "the unix socket's mode, octal"),
    Flag("--map-users", "security", "map_users", "comma-separated users who may map the DRAM arena (SHM ATTACH)",
         default_note="nobody"),
    Flag("--protected-mode", "server", "protected_mode", "with no password set, accept only loopback clients "
         "on every listener", choices=("yes", "no")),
)

EPILOG = """\
Every config key, not only those with a flag, is set in the TOML file (--config, or
$QUILLD_CONFIG; conf/quilld.toml shows every key with its default) or by an environment
variable QUILLD_<SECTION>_<KEY> (QUILLD_DRAM_SIZE=4GiB). Precedence, lowest first: built-in
defaults < the file < the environment < flags. QUILLD_LOG_LEVEL sets --log-level, and
QUILLD_PURE_PYTHON=1 runs the plain-Python build.

The admin API's token has no flag (a flag shows in `ps`): set QUILLD_ADMIN_TOKEN, or
admin.token in the file. quilld refuses to start with passwords set (--requirepass,
--users-file) and the admin port open but no token; requests then need
`Authorization: Bearer <token>`. Likewise cluster.secret (QUILLD_CLUSTER_SECRET).

Every key, its type, default, flag and variable: docs/reference/configuration.md."""


def shown_default(section: str, key: str) -> str:
    """A key's built-in default as the config file would spell it: sizes with binary units
    (1GiB), modes in octal, booleans as true/false, strings quoted."""
    value = getattr(getattr(Config(), section), key)
    if (section, key) in SIZE_KEYS:
        for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value and value % size == 0:
                return f"{value // size}{unit}"
        return str(value)
    if (section, key) in OCTAL_KEYS:
        return f"{value:o}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def _flag_help(flag: Flag) -> str:
    default = shown_default(flag.section, flag.key)
    if flag.choices and default in ("true", "false"):
        default = "yes" if default == "true" else "no"
    note = f": {flag.default_note}" if flag.default_note else ""
    return f"{flag.help} ({flag.section}.{flag.key}, ${flag.env}; default {default}{note})"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quilld", description="QuillCache node: a Redis-protocol KV-block cache.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML config file (default: $QUILLD_CONFIG, else built-in defaults)")
    for flag in FLAGS:
        p.add_argument(flag.name, type=flag.type, choices=list(flag.choices) or None, help=_flag_help(flag),
                       dest=_dest(flag))
    p.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS,
                   help="log level (default: $QUILLD_LOG_LEVEL, else info)")
    p.add_argument("--version", action="version", version=f"quilld {__version__}")
    return p


def _dest(flag: Flag) -> str:
    return flag.name.removeprefix("--").replace("-", "_")


def _overrides(a: argparse.Namespace) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for flag in FLAGS:
        value = getattr(a, _dest(flag))
        if value is not None:
            out.setdefault(flag.section, {})[flag.key] = value
    return out


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class EarlySignal(Exception):
    """A stop signal that arrived before the event loop took the signals over."""


_early_received: list[str] = []  # stop signals taken by _early_signal, even if its exception was swallowed


def _early_signal(signum: int, frame) -> None:
    # The exception can land inside code that swallows it (a logging handler's emit, say), so the
    # signal is also recorded: _serve acts on it once the loop has taken the signals over.
    name = signal.Signals(signum).name
    _early_received.append(name)
    raise EarlySignal(name)


class _LogNode(logging.Filter):
    """Gives every log record `node`: this node's id once it is built (several nodes of one host
    write to one terminal or journal), its pid before."""

    def __init__(self) -> None:
        super().__init__()
        self.node = f"pid {os.getpid()}"

    def filter(self, record: logging.LogRecord) -> bool:
        record.node = self.node
        return True


LOG_NODE = _LogNode()


async def _serve(cfg, make_node: Callable[[], Node]) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    node = make_node()
    LOG_NODE.node = node.node_id
    starting = asyncio.ensure_future(node.start())
    received: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig.name)
        if len(received) == 1:
            if starting.done():
                log.info("%s received, shutting down", sig.name)
            else:
                log.warning("%s received while starting (%s): stopping without serving", sig.name, node.phase)
                starting.cancel()
            stop.set()
        elif sig == signal.SIGINT:
            log.warning("SIGINT received again while stopping: exiting now, without a clean stop: %s",
                        node.unflushed())
            logging.shutdown()
            os._exit(1)
        else:
            log.info("%s received while stopping: the stop goes on", sig.name)

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    if _early_received:  # one arrived before, and its EarlySignal did not reach main()
        on_signal(signal.Signals[_early_received[0]])
    try:
        try:
            await starting
        except asyncio.CancelledError:
            if not received:
                raise
            return
        # Everything built so far (modules, config, the recovered index) lives as long as the
        # process: keep it out of the cyclic collector's scans, which otherwise grow with it.
        gc.collect()
        gc.freeze()
        print(f"quilld ready on {cfg.server.bind}:{node.port}", flush=True)
        await stop.wait()
    finally:
        await node.stop()
    if node.stop_failed:
        raise StopFailed(f"stopped, but {'; '.join(node.stop_failed)} failed to stop")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.log_level is None:
        env_level = os.environ.get("QUILLD_LOG_LEVEL", "info")
        if env_level.lower() not in LOG_LEVELS:
            parser.error(f"QUILLD_LOG_LEVEL: invalid log level {env_level!r} (choose from {', '.join(LOG_LEVELS)})")
        args.log_level = env_level.lower()
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s [%(node)s] %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for handler in logging.getLogger().handlers:
        handler.addFilter(LOG_NODE)
    config_file = args.config or os.environ.get("QUILLD_CONFIG", "")
    for sig in STOP_SIGNALS:  # until the event loop takes them over (a SIGINT ignored by a shell included)
        signal.signal(sig, _early_signal)
    log.info("quilld %s starting, pid %d", __version__, os.getpid())
    try:
        # imported here, not at the top: a stop signal during this import (about a second) is handled
        from quilld.node import ListenError, Node
        try:
            cfg = load(config_file or None, overrides=_overrides(args))
        except ConfigError as e:
            print(f"quilld: {e.message}", file=sys.stderr)
            return 2
        loop_name = install_loop()
        log.info("event loop: %s", loop_name)
        try:
            asyncio.run(_serve(cfg, lambda: Node(cfg, config_file)))
        except ConfigError as e:
            print(f"quilld: {e.message}", file=sys.stderr)
            return 2
        except ListenError as e:
            print(f"quilld: cannot start: {e.strerror}", file=sys.stderr)
            return 1
        except StopFailed as e:
            print(f"quilld: {e}", file=sys.stderr)
            return 1
        except OSError as e:
            print(f"quilld: cannot start: {e}", file=sys.stderr)
            return 1
    except EarlySignal as e:
        log.info("%s received before the node started: exiting", e)
        return 0
    return 0
