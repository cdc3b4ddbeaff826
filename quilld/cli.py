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
from typing import TYPE_CHECKING

from quilld import __version__
from quilld.config import load
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quilld", description="QuillCache node: a Redis-protocol KV-block cache.")
    p.add_argument("--config", help="TOML config file (default: $QUILLD_CONFIG, else built-in defaults)")
    p.add_argument("--bind", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="RESP port (default 7379)")
    p.add_argument("--admin-port", type=int, help="admin HTTP port (default 7380; 0 disables it)")
    p.add_argument("--dram", help="DRAM arena size, e.g. 512MiB or 4GiB (default 1GiB)")
    p.add_argument("--requirepass", help="password of user `default`; AUTH required when set")
    p.add_argument("--users-file", help="file of `user password` lines (tenants)")
    p.add_argument("--node-id", help="this node's id (default host:port)")
    p.add_argument("--ssd-dir", help="directory of the SSD tier's segments and WAL (default: no SSD tier)")
    p.add_argument("--ssd-size", help="SSD tier capacity, e.g. 64GiB (default 16GiB)")
    p.add_argument("--gossip-port", type=int, help="cluster gossip port, UDP and TCP (default 0: single node)")
    p.add_argument("--seeds", help="comma-separated host:port gossip addresses of nodes to join")
    p.add_argument("--gateway-port", type=int, help="OpenAI-compatible gateway port (default 0: off)")
    p.add_argument("--unixsocket", help="unix socket path to listen on beside TCP (default: none)")
    p.add_argument("--unixsocketperm", help="the unix socket's mode, octal (default 700)")
    p.add_argument("--map-users", help="comma-separated users who may map the DRAM arena (SHM ATTACH; default none)")
    p.add_argument("--protected-mode", choices=["yes", "no"],
                   help="with no password set, accept only loopback clients on every listener (default yes)")
    p.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS,
                   help="log level (default: $QUILLD_LOG_LEVEL, else info)")
    p.add_argument("--version", action="version", version=f"quilld {__version__}")
    return p


def _overrides(a: argparse.Namespace) -> dict[str, dict]:
    out: dict[str, dict] = {}

    def put(section: str, key: str, value) -> None:
        if value is not None:
            out.setdefault(section, {})[key] = value

    put("server", "bind", a.bind)
    put("server", "port", a.port)
    put("server", "node_id", a.node_id)
    put("server", "protected_mode", a.protected_mode)
    put("server", "unixsocket", a.unixsocket)
    put("server", "unixsocketperm", a.unixsocketperm)
    put("security", "map_users", a.map_users)
    put("admin", "port", a.admin_port)
    put("dram", "size", a.dram)
    put("security", "requirepass", a.requirepass)
    put("security", "users_file", a.users_file)
    put("ssd", "dir", a.ssd_dir)
    put("ssd", "size", a.ssd_size)
    put("cluster", "gossip_port", a.gossip_port)
    put("cluster", "seeds", a.seeds)
    put("gateway", "port", a.gateway_port)
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
