"""ACL: SETUSER, GETUSER, DELUSER, LIST, DRYRUN, GENPASS, CAT, USERS, WHOAMI, LOAD, SAVE, HELP.

quilld's users are its tenants: `default` (security.requirepass), the users file's, and
those ACL SETUSER adds while the node runs (lost at a restart: quilld keeps no ACL file,
so ACL LOAD and SAVE say so). A user logs in with AUTH as any other; its keys are its own
keyspace, and its ACL rules (acl_rules.py says which quilld honours) restrict what it may
run there. Creating, changing, describing and removing users is the operator's (`default`'s):
the rest answer NOPERM, as CONFIG SET does. A tenant's ACL USERS lists itself only.

Turning on a password for `default` while the admin API is open without admin.token is
refused, as quilld refuses to start that way. ACL DELUSER closes the connections of the
users it removes, as redis does; ACL SETUSER's new rules apply to a user's open
connections from their next command.
"""

from __future__ import annotations

import secrets

from quilld.errors import CommandError, echo
from quilld.protocol.commands.acl_rules import AclUser, RuleError, Universe, merge_selectors
from quilld.protocol.commands.catalogue.redis_only import REDIS_ONLY
from quilld.protocol.commands.client import operator_only
from quilld.protocol.commands.command_docs import help_reply
from quilld.protocol.commands.common import parse_int, text
from quilld.protocol.resp import OK, OrderedSet
from quilld.protocol.table import ACL_CATEGORIES, CommandTable
from quilld.security import SCOPE_SEP, Login

NO_ACL_FILE = ("quilld keeps no ACL file: users added with ACL SETUSER last until the node restarts "
               "(security.users_file and security.requirepass hold the users it starts with)")


class Acl:
    """The node's view of its users' ACLs (one per command table, so one per node)."""

    def __init__(self, table: CommandTable) -> None:
        self.table = table
        self._universe: Universe | None = None

    @property
    def universe(self) -> Universe:
        if self._universe is None:  # every family has registered by the first ACL command
            others = {name: tuple(row[2].split()) for name, row in REDIS_ONLY.items()}
            self._universe = Universe.of(self.table.commands, others)
        return self._universe

    def user(self, c, name: str) -> AclUser | None:
        """`name`'s ACL as it stands (a configured user's: everything), or None: no such user."""
        users = c.ctx.users
        acl = users.acl_of(name)
        if acl is not None:
            return acl
        login = users.login_of(name)
        return None if login is None else AclUser.everything(login, self.universe)

    def save(self, c, name: str, acl: AclUser) -> None:
        """Store `acl` as `name`'s; its open connections follow from their next command."""
        users = c.ctx.users
        users.set_login(name, acl.login, acl.settle(self.universe))
        for conn in c.ctx.clients.connections.values():
            if conn.session.user == name:
                conn.session.set_perms(acl if acl.restricted else None)


def _all_channels(c) -> bool:
    return c.ctx.runtime.inert.get("acl-pubsub-default", "resetchannels") == "allchannels"


def require_token_for_passwords(c, login: Login) -> None:
    """A node whose clients need a password must not have an open admin API (config.py refuses
    to start that way): a change to `default` that would need one is refused alike."""
    admin = c.ctx.cfg.admin
    if admin.port and not admin.token and not (login.enabled and login.nopass) and not c.ctx.users.required:
        raise CommandError("quilld refuses passwords while its admin API is open without admin.token: set "
                           "admin.token (QUILLD_ADMIN_TOKEN) and restart, then set the password")


def cmd_setuser(c, args, acl: Acl):
    operator_only(c, "acl|setuser")
    name = text(args[2])
    if " " in name or "\x00" in name:
        raise CommandError("Usernames can't contain spaces or null characters")
    if SCOPE_SEP in name:
        raise CommandError(f"quilld user names may not contain '{SCOPE_SEP}': it separates the scope in a login "
                           f"name (user{SCOPE_SEP}model{SCOPE_SEP}tokenizer)")
    u, channels = acl.universe, _all_channels(c)
    current = acl.user(c, name)
    temp = current.copy() if current is not None else AclUser.new(u, channels)
    try:
        rules = merge_selectors([text(a) for a in args[3:]])
    except ValueError as e:
        raise CommandError(f"Unmatched parenthesis in acl selector starting at '{e.args[0]}'.") from None
    for rule in rules:
        try:
            temp.apply(rule, u, channels)
        except RuleError as e:
            raise CommandError(f"Error in ACL SETUSER modifier '{rule}': {e}") from None
    if name == "default":
        require_token_for_passwords(c, temp.login)
    acl.save(c, name, temp)
    return OK


def _selector_reply(s) -> dict:
    return {b"commands": s.commands_text().encode(), b"keys": s.keys_text().encode(),
            b"channels": s.channels_text().encode()}


def cmd_getuser(c, args, acl: Acl):
    operator_only(c, "acl|getuser")
    user = acl.user(c, text(args[2]))
    if user is None:
        return None
    return {b"flags": OrderedSet(f.encode() for f in user.flags()),
            b"passwords": [d.encode() for d in user.login.digests],
            **_selector_reply(user.root),
            b"selectors": [_selector_reply(s) for s in user.selectors]}


def cmd_deluser(c, args, acl: Acl):
    operator_only(c, "acl|deluser")
    names = [text(a) for a in args[2:]]
    if "default" in names:
        raise CommandError("The 'default' user cannot be removed")
    users, removed = c.ctx.users, set()
    for name in names:
        if users.delete(name):
            removed.add(name)
    for conn in list(c.ctx.clients.connections.values()):
        if conn.session.user in removed:
            conn.transport.close()
    return len(removed)


def cmd_list(c, args, acl: Acl):
    operator_only(c, "acl|list")
    return [acl.user(c, name).describe(name).encode() for name in c.ctx.users.names()]


def cmd_dryrun(c, args, acl: Acl):
    operator_only(c, "acl|dryrun")
    user = acl.user(c, text(args[2]))
    if user is None:
        raise CommandError(f"User '{echo(args[2])}' not found")
    argv = args[3:]
    cmd = c.ctx.table.resolve(argv)
    if cmd is None:
        raise CommandError(f"Command '{echo(argv[0])}' not found")
    if (cmd.arity > 0 and cmd.arity != len(argv)) or len(argv) < -cmd.arity:
        raise CommandError(f"wrong number of arguments for '{cmd.name}' command")
    refusal = user.dry_run(cmd, argv)
    return OK if refusal is None else refusal.encode()


def cmd_genpass(c, args):
    bits = 256
    if len(args) > 2:
        bits = parse_int(args[2])
        if bits <= 0 or bits > 4096:
            raise CommandError("ACL GENPASS argument must be the number of bits for the output password, a positive "
                               "number up to 4096")
    chars = (bits + 3) // 4
    return secrets.token_hex((chars + 1) // 2)[:chars].encode()


def cmd_whoami(c, args):
    return c.user.encode()


def cmd_users(c, args):
    if c.user != "default":
        return [c.user.encode()]
    return [name.encode() for name in c.ctx.users.names()]


def cmd_cat(c, args):
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


def cmd_no_file(c, args):
    raise CommandError(NO_ACL_FILE)


_HELP = (
    "CAT [<category>]",
    "    List all commands that belong to <category>, or all command categories",
    "    when no category is specified.",
    "DELUSER <username> [<username> ...]",
    "    Delete a list of users.",
    "DRYRUN <username> <command> [<arg> ...]",
    "    Returns whether the user can execute the given command without executing the command.",
    "GETUSER <username>",
    "    Get the user's details.",
    "GENPASS [<bits>]",
    "    Generate a secure 256-bit user password. The optional `bits` argument can",
    "    be used to specify a different size.",
    "LIST",
    "    Show users details in config file format.",
    "USERS",
    "    List all the registered usernames.",
    "SETUSER <username> <attribute> [<attribute> ...]",
    "    Create or modify a user with the specified attributes.",
    "WHOAMI",
    "    Return the current connection username.",
)


def cmd_help(c, args):
    return help_reply(args, _HELP)


def register(t: CommandTable) -> None:
    acl = Acl(t)
    sub = CommandTable()
    sub.add("acl|cat", -2, "", cmd_cat)
    sub.add("acl|deluser", -3, "", lambda c, a: cmd_deluser(c, a, acl))
    sub.add("acl|dryrun", -4, "", lambda c, a: cmd_dryrun(c, a, acl))
    sub.add("acl|genpass", -2, "", cmd_genpass)
    sub.add("acl|getuser", 3, "", lambda c, a: cmd_getuser(c, a, acl))
    sub.add("acl|help", 2, "", cmd_help)
    sub.add("acl|list", 2, "", lambda c, a: cmd_list(c, a, acl))
    sub.add("acl|load", 2, "", cmd_no_file)
    sub.add("acl|save", 2, "", cmd_no_file)
    sub.add("acl|setuser", -3, "", lambda c, a: cmd_setuser(c, a, acl))
    sub.add("acl|users", 2, "", cmd_users)
    sub.add("acl|whoami", 2, "", cmd_whoami)
    t.add("acl", -2, "", lambda c, a: None, subcommands={n.split(b"|")[1]: x for n, x in sub.commands.items()})
