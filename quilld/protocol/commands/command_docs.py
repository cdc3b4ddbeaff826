"""COMMAND: the command table as redis describes its own (COUNT, LIST, INFO, DOCS, GETKEYS,
GETKEYSANDFLAGS, HELP), in redis's reply shapes.

Everything is read off the table's rows (`table.Command` and its `Doc`); nothing here
knows a command by name. Replies hold sets whose order matters (flags, ACL categories,
key specs): those are the codec's `OrderedSet`s, redis's set type in RESP3 and an array
in RESP2.
"""

from __future__ import annotations

from typing import Any

from quilld.errors import CommandError
from quilld.protocol.commands.catalogue import redis_only
from quilld.protocol.commands.keys import glob_matcher
from quilld.protocol.resp import OrderedSet, Raw, Status, encode
from quilld.protocol.table import (ACL_CATEGORIES, ARG_FLAGS, KEY_FLAGS, Arg, Command, CommandTable, KeySpec,
                                   keys_from_specs, ordered)

_SYNTAX = CommandError("syntax error")


def render(value: Any, resp3: bool) -> Raw:
    """`value` encoded for the connection's protocol, its OrderedSets included."""
    out: list = []
    encode(value, resp3, out)
    return Raw(b"".join(out))


def help_reply(args: list, lines: tuple[str, ...]) -> list:
    """redis's addReplyHelp(): the command as the client typed it, upper-cased, then status lines."""
    name = bytes(args[0]).upper()
    return [Status(name + b" <subcommand> [<arg> [value] [opt] ...]. Subcommands are:")] + [
        Status(line.encode()) for line in lines] + [Status(b"HELP"), Status(b"    Prints this help.")]


def _statuses(words: tuple[str, ...], prefix: str = "") -> OrderedSet:
    return OrderedSet(Status((prefix + w).encode()) for w in words)


def _key_spec(spec: KeySpec) -> dict:
    out: dict = {}
    if spec.notes:
        out[b"notes"] = spec.notes.encode()
    out[b"flags"] = _statuses(ordered(spec.flags, KEY_FLAGS))
    if spec.keyword is not None:
        begin = {b"type": b"keyword", b"spec": {b"keyword": spec.keyword[0].encode(), b"startfrom": spec.keyword[1]}}
    elif spec.range is not None or spec.keynum is not None:
        begin = {b"type": b"index", b"spec": {b"index": spec.index}}
    else:
        begin = {b"type": b"unknown", b"spec": {}}
    out[b"begin_search"] = begin
    if spec.range is not None:
        last, step, limit = spec.range
        find = {b"type": b"range", b"spec": {b"lastkey": last, b"keystep": step, b"limit": limit}}
    elif spec.keynum is not None:
        idx, first, step = spec.keynum
        find = {b"type": b"keynum", b"spec": {b"keynumidx": idx, b"firstkey": first, b"keystep": step}}
    else:
        find = {b"type": b"unknown", b"spec": {}}
    out[b"find_keys"] = find
    return out


def command_info(cmd: Command | None) -> Any:
    """One command's COMMAND INFO entry (redis's addReplyCommandInfo), or None."""
    if cmd is None:
        return None
    first, last, step = cmd.key_range
    doc = cmd.doc
    tips = tuple(doc.tips.split()) if doc else ()
    specs = doc.keys if doc else ()
    return [cmd.name.encode(), cmd.arity, _statuses(cmd.info_flags), first, last, step,
            _statuses(cmd.acl_categories, "@"), OrderedSet(t.encode() for t in tips),
            OrderedSet(_key_spec(s) for s in specs),
            [command_info(s) for s in cmd.subcommands.values()] if cmd.subcommands else OrderedSet()]


def _arg_doc(arg: Arg) -> dict:
    out: dict = {b"name": arg.name.encode(), b"type": arg.type.encode()}
    if arg.key_spec >= 0:
        out[b"key_spec_index"] = arg.key_spec
    for field in ("token", "summary", "since", "deprecated_since"):
        value = getattr(arg, field)
        if value:
            out[field.encode()] = value.encode()
    if arg.flags:
        out[b"flags"] = _statuses(ordered(arg.flags, ARG_FLAGS))
    if arg.type in ("oneof", "block"):
        out[b"arguments"] = [_arg_doc(a) for a in arg.args]
    return out


def command_docs(cmd: Command) -> dict:
    """One command's COMMAND DOCS entry (redis's addReplyCommandDocs)."""
    doc = cmd.doc
    out: dict = {}
    if cmd.summary:
        out[b"summary"] = cmd.summary.encode()
    if cmd.since:
        out[b"since"] = cmd.since.encode()
    out[b"group"] = cmd.group.encode()
    if doc is not None:
        if doc.complexity:
            out[b"complexity"] = doc.complexity.encode()
        if doc.doc_flags:
            out[b"doc_flags"] = _statuses(ordered(doc.doc_flags, ("deprecated", "syscmd")))
        if doc.deprecated_since:
            out[b"deprecated_since"] = doc.deprecated_since.encode()
        if doc.replaced_by:
            out[b"replaced_by"] = doc.replaced_by.encode()
        if doc.history:
            out[b"history"] = OrderedSet([since.encode(), change.encode()] for since, change in doc.history)
        if doc.args:
            out[b"arguments"] = [_arg_doc(a) for a in doc.args]
    if cmd.subcommands:
        out[b"subcommands"] = {s.name.encode(): command_docs(s) for s in cmd.subcommands.values()}
    return out


def _table(c) -> CommandTable:
    return c.ctx.table


def by_full_name(table: CommandTable, raw: bytes) -> Command | None:
    """redis's lookupCommandBySds: `name` or `container|sub`, any case; None otherwise."""
    parts = bytes(raw).lower().split(b"|")
    cmd = table.commands.get(parts[0])
    if cmd is None or len(parts) == 1:
        return cmd
    if len(parts) > 2 or not cmd.subcommands:
        return None
    return cmd.subcommands.get(parts[1])


def cmd_command(c, args):
    return render([command_info(cmd) for cmd in _table(c).commands.values()], c.resp3)


def cmd_command_count(c, args):
    return len(_table(c).commands)


def _all(table: CommandTable):
    for cmd in table.commands.values():
        yield cmd
        yield from cmd.subcommands.values()


def cmd_command_list(c, args):
    table = _table(c)
    if len(args) == 2:
        return [cmd.name.encode() for cmd in _all(table)]
    if len(args) != 5 or bytes(args[2]).lower() != b"filterby":
        raise _SYNTAX
    kind, arg = bytes(args[3]).lower(), bytes(args[4])
    if kind == b"module":
        return []  # quilld loads no modules
    if kind == b"aclcat":
        cat = arg.lower().decode("latin-1")
        if cat not in ACL_CATEGORIES:
            return []
        return [cmd.name.encode() for cmd in _all(table) if cat in cmd.acl_categories]
    if kind == b"pattern":
        match = glob_matcher(arg.lower())
        return [cmd.name.encode() for cmd in _all(table) if match(cmd.name.encode())]
    raise _SYNTAX


def cmd_command_info(c, args):
    table = _table(c)
    if len(args) == 2:
        return cmd_command(c, args)
    return render([command_info(by_full_name(table, a)) for a in args[2:]], c.resp3)


def cmd_command_docs(c, args):
    table = _table(c)
    if len(args) == 2:
        found = list(table.commands.values())
    else:
        found = [cmd for cmd in (by_full_name(table, a) for a in args[2:]) if cmd is not None]
    return render({cmd.name.encode(): command_docs(cmd) for cmd in found}, c.resp3)


def _keys(c, args, with_flags: bool):
    table, argv = _table(c), args[2:]
    cmd = table.resolve(argv) or redis_only.resolve(argv)  # redis's others answer from their key specs
    if cmd is None:
        raise CommandError("Invalid command specified")
    if not cmd.has_keys:
        raise CommandError("The command has no key arguments")
    if (cmd.arity > 0 and cmd.arity != len(argv)) or len(argv) < -cmd.arity:
        raise CommandError("Invalid number of arguments specified for command")
    found = keys_from_specs(cmd, argv)
    if not found:
        if found is None and "no_mandatory_keys" not in cmd.info_flags:
            raise CommandError("Invalid arguments specified for command")
        return []
    if not with_flags:
        return [bytes(argv[pos]) for pos, _ in found]
    return render([[bytes(argv[pos]), _statuses(ordered(flags, KEY_FLAGS))] for pos, flags in found], c.resp3)


def cmd_command_getkeys(c, args):
    return _keys(c, args, False)


def cmd_command_getkeysandflags(c, args):
    return _keys(c, args, True)


_HELP = (
    "(no subcommand)",
    "    Return details about all Redis commands.",
    "COUNT",
    "    Return the total number of commands in this Redis server.",
    "LIST",
    "    Return a list of all commands in this Redis server.",
    "INFO [<command-name> ...]",
    "    Return details about multiple Redis commands.",
    "    If no command names are given, documentation details for all",
    "    commands are returned.",
    "DOCS [<command-name> ...]",
    "    Return documentation details about multiple Redis commands.",
    "    If no command names are given, documentation details for all",
    "    commands are returned.",
    "GETKEYS <full-command>",
    "    Return the keys from a full Redis command.",
    "GETKEYSANDFLAGS <full-command>",
    "    Return the keys and the access flags from a full Redis command.",
)


def cmd_command_help(c, args):
    return help_reply(args, _HELP)


def register(t: CommandTable) -> None:
    sub = CommandTable()
    sub.add("command|count", 2, "", cmd_command_count)
    sub.add("command|docs", -2, "", cmd_command_docs)
    sub.add("command|getkeys", -4, "", cmd_command_getkeys)
    sub.add("command|getkeysandflags", -4, "", cmd_command_getkeysandflags)
    sub.add("command|help", 2, "", cmd_command_help)
    sub.add("command|info", -2, "", cmd_command_info)
    sub.add("command|list", -2, "", cmd_command_list)
    t.add("command", -1, "", cmd_command, subcommands={n.split(b"|")[1]: cmd for n, cmd in sub.commands.items()})
