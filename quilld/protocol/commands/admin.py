"""Server commands: INFO, and ACL's WHOAMI, USERS, CAT and HELP (CONFIG: config_cmd.py).

quilld's users are its tenants (security.requirepass for `default`, security.users_file
for the others); ACL SETUSER and the rest of redis's ACL are not here. A tenant's ACL
USERS lists itself only, as its CLIENT LIST lists its own connections.
"""

from __future__ import annotations

from quilld.errors import CommandError, echo
from quilld.protocol.commands.command_docs import help_reply
from quilld.protocol.commands.common import text
from quilld.protocol.info import info_sections, render_info, wanted_sections
from quilld.protocol.resp import Verbatim
from quilld.protocol.table import ACL_CATEGORIES, CommandTable


def cmd_info(c, args):
    names = wanted_sections([text(a) for a in args[1:]])
    return Verbatim(render_info(info_sections(c.ctx, c, names)).encode())


def cmd_acl_whoami(c, args):
    return c.user.encode()


def cmd_acl_users(c, args):
    if c.user != "default":
        return [c.user.encode()]
    users = c.ctx.users
    names = {"default"} | set(getattr(users, "_passwords", {}))  # Users keeps its names to itself
    return [name.encode() for name in sorted(names)]


def cmd_acl_cat(c, args):
    if len(args) > 3:
        raise CommandError(f"unknown subcommand or wrong number of arguments for '{echo(args[1], 128)}'. Try "
                           f"{echo(bytes(args[0]).upper())} HELP.")
    if len(args) == 2:
        return [cat.encode() for cat in ACL_CATEGORIES]
    cat = bytes(args[2]).lower().decode("latin-1")
    if cat not in ACL_CATEGORIES:
        raise CommandError(f"Unknown category '{echo(args[2], 128)}'")
    table = c.ctx.table
    return [cmd.name.encode() for top in table.commands.values() for cmd in (top, *top.subcommands.values())
            if cat in cmd.acl_categories]


_ACL_HELP = (
    "CAT [<category>]",
    "    List all commands that belong to <category>, or all command categories",
    "    when no category is specified.",
    "USERS",
    "    List all the registered usernames.",
    "WHOAMI",
    "    Return the current connection username.",
)


def cmd_acl_help(c, args):
    return help_reply(args, _ACL_HELP)


def register(t: CommandTable) -> None:
    t.add("info", -1, "", cmd_info)
    acl = CommandTable()
    acl.add("acl|cat", -2, "", cmd_acl_cat)
    acl.add("acl|help", 2, "", cmd_acl_help)
    acl.add("acl|users", 2, "", cmd_acl_users)
    acl.add("acl|whoami", 2, "", cmd_acl_whoami)
    t.add("acl", -2, "", lambda c, a: None, subcommands={n.split(b"|")[1]: x for n, x in acl.commands.items()})
