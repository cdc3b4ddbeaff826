"""Server commands: INFO (CONFIG: config_cmd.py; ACL: acl.py)."""

from __future__ import annotations

from quilld.protocol.commands.common import text
from quilld.protocol.info import info_sections, render_info, wanted_sections
from quilld.protocol.resp import Verbatim
from quilld.protocol.table import CommandTable


def cmd_info(c, args):
    names = wanted_sections([text(a) for a in args[1:]])
    return Verbatim(render_info(info_sections(c.ctx, c, names)).encode())


def register(t: CommandTable) -> None:
    t.add("info", -1, "", cmd_info)
