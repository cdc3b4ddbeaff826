"""Server commands: INFO, CONFIG."""

from __future__ import annotations

import fnmatch

from quilld.errors import CommandError
from quilld.protocol.commands.common import text
from quilld.protocol.context import NodeContext
from quilld.protocol.info import info_sections, render_info, reset_stats, wanted_sections
from quilld.protocol.resp import OK, Verbatim
from quilld.protocol.table import CommandTable

def cmd_info(c, args):
    names = wanted_sections([text(a) for a in args[1:]])
    return Verbatim(render_info(info_sections(c.ctx, c, names)).encode())


def _config_params(ctx: NodeContext) -> dict[str, str]:
    cfg = ctx.cfg
    return {
        "bind": cfg.server.bind,
        "port": str(cfg.server.port),
        "maxmemory": str(ctx.keyspace.capacity),
        "maxmemory-policy": "allkeys-lru",
        "maxclients": str(cfg.server.max_clients),
        "proto-max-bulk-len": str(cfg.server.proto_max_bulk_len),
        "databases": "1",
        "save": "",
        "appendonly": "no",
        "timeout": "0",
        "dram-size": str(cfg.dram.size),
        "dram-high-watermark": str(cfg.dram.high_watermark),
        "dram-low-watermark": str(cfg.dram.low_watermark),
        "dram-inline-max": str(cfg.dram.inline_max),
    }


def cmd_config_get(c, args):
    params = _config_params(c.ctx)
    out: dict[bytes, bytes] = {}
    for pattern in args[2:]:
        pat = text(pattern).lower()
        for name, value in params.items():
            if fnmatch.fnmatchcase(name, pat):
                out[name.encode()] = value.encode()
    return out


def cmd_config_set(c, args):
    raise CommandError(f"CONFIG SET is not supported: set '{text(args[2])}' in the config file or a "
                       "QUILLD_* variable and restart quilld")


def cmd_config_resetstat(c, args):
    reset_stats(c.ctx)
    return OK


def register(t: CommandTable) -> None:
    t.add("info", -1, "", cmd_info, "Returns information and statistics about the server.", "server")
    cfg = CommandTable()
    cfg.add("config|get", -3, "", cmd_config_get, "Returns the effective values of configuration parameters.",
            "server", "2.0.0")
    cfg.add("config|set", -4, "", cmd_config_set, "Not supported: quilld's config is fixed at start.", "server")
    cfg.add("config|resetstat", 2, "", cmd_config_resetstat, "Resets the server's statistics.", "server")
    t.add("config", -2, "", lambda c, a: None, "A container for server configuration commands.", "server",
          subcommands={n.split(b"|")[1]: cmd for n, cmd in cfg.commands.items()})
