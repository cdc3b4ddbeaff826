"""A user's ACL rules as redis keeps them: selectors of command, key and channel rules.

`AclUser` is what ACL SETUSER builds (redis 7.0's ACLSetUser and ACLSetSelector, with
redis's errors), what ACL GETUSER and ACL LIST describe, and what the dispatcher asks
before running a restricted user's command (`refusal`). A user may run a command when
its root selector, or any other selector, allows the command and every key it names.

What quilld honours: on/off, passwords (`>p <p #digest !digest nopass resetpass`),
command rules (`+cmd -cmd +cmd|sub -cmd|sub +@category -@category allcommands
nocommands`, over quilld's commands; redis commands quilld does not serve may be named,
and allow or deny nothing), key patterns (`~p %R~p %W~p allkeys resetkeys`, matched
against the keys a command names in the user's own keyspace: a user is a tenant),
selectors (`(...)`, `clearselectors`), `reset`, `sanitize-payload` and
`skip-sanitize-payload` (flags only: RESTORE reads strings, which need no sanitizing).
Channel rules (`&p allchannels resetchannels`) are kept and shown; quilld has no pub/sub,
so there is nothing for them to allow. Refused with a clear error: a first argument of a
command that has no subcommands (`+select|0`, deprecated in redis 7.0).

How GETUSER and LIST show a user's command rules: `+@all` or `-@all`, then the rules as
given, each command or category once (a later rule replaces an earlier one for the same
name), as redis 7.2 does. redis 7.0 rebuilds them from a bitmap instead, in the order of
its command hash table, which differs between processes; the two agree for the usual
cases (`+@all`, `+@all -cmd`, `-@all +cmd`, `-@all +@category`).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace

from quilld.errors import NoPerm
from quilld.protocol.commands.keys import glob_matcher
from quilld.protocol.table import ACL_CATEGORIES, NOAUTH, Command, keys_from_specs
from quilld.security import Login, digest

READ, WRITE = 1, 2
OK, DENIED_CMD, DENIED_KEY = 0, 1, 2
_ERRORS = {
    "ENOENT": "Unknown command or category name in ACL",
    "EINVAL": "Syntax error",
    "EEXIST": "Adding a pattern after the * pattern (or the 'allkeys' flag) is not valid and does not have any "
              "effect. Try 'resetkeys' to start with an empty list of patterns",
    "EISDIR": "Adding a pattern after the * pattern (or the 'allchannels' flag) is not valid and does not have any "
              "effect. Try 'resetchannels' to start with an empty list of channels",
    "ENODEV": "The password you are trying to remove from the user does not exist",
    "EBADMSG": "The password hash must be exactly 64 characters and contain only lowercase hexadecimal characters",
    "ECHILD": "Allowing first-arg of a subcommand is not supported",
    "EFIRSTARG": "quilld does not allow a first argument of a command without subcommands (redis 7.0 deprecates "
                 "it): allow or deny the whole command",
}
_HEX = frozenset("0123456789abcdef")
_WRITES = frozenset(("insert", "delete", "update"))


class RuleError(ValueError):
    """A rule ACL SETUSER refuses; its message is redis's reason."""

    def __init__(self, code: str) -> None:
        super().__init__(_ERRORS[code])


@dataclass(frozen=True)
class Universe:
    """The command names rules may name: quilld's (with their ACL categories) and redis's others."""

    served: dict[str, Command]  # full name -> row, subcommands included
    others: frozenset[str]  # redis 7.0.15 commands quilld does not serve
    subs: dict[str, tuple[str, ...]]  # container -> its subcommands' full names
    by_category: dict[str, frozenset[str]]

    @classmethod
    def of(cls, commands: dict[bytes, Command], others: dict[str, tuple[str, ...]]) -> Universe:
        """`others`: redis's command names quilld does not serve -> their ACL categories."""
        served: dict[str, Command] = {}
        subs: dict[str, tuple[str, ...]] = {}
        for cmd in commands.values():
            served[cmd.name] = cmd
            for sub in cmd.subcommands.values():
                served[sub.name] = sub
            if cmd.subcommands:
                subs[cmd.name] = tuple(s.name for s in cmd.subcommands.values())
        rest = {n: c for n, c in others.items() if n not in served}
        for name in rest:
            if "|" in name:
                top = name.split("|")[0]
                subs[top] = (*subs.get(top, ()), name)
        cats: dict[str, set[str]] = {c: set() for c in ACL_CATEGORIES}
        for name, cmd in served.items():
            for cat in cmd.acl_categories:
                cats[cat].add(name)
        for name, categories in rest.items():
            for cat in categories:
                cats.setdefault(cat, set()).add(name)
        return cls(served, frozenset(rest), subs, {c: frozenset(n) for c, n in cats.items()})

    def find(self, name: str) -> str | None:
        name = name.lower()
        return name if name in self.served or name in self.others else None

    @property
    def everything(self) -> frozenset[str]:
        return frozenset(self.served) | self.others


@dataclass
class Selector:
    allowed: set[str] = field(default_factory=set)  # full command names it allows
    future: bool = False  # +@all's "and every command to come" bit: shown as +@all rather than -@all
    rules: list[str] = field(default_factory=list)  # the command rules as given, each name once
    allkeys: bool = False
    patterns: list[list] = field(default_factory=list)  # [pattern, READ|WRITE bits]
    allchannels: bool = False
    channels: list[str] = field(default_factory=list)

    def copy(self) -> Selector:
        return replace(self, allowed=set(self.allowed), rules=list(self.rules),
                       patterns=[list(p) for p in self.patterns], channels=list(self.channels))

    # -- rules ---------------------------------------------------------------------------
    def apply(self, op: str, u: Universe) -> None:
        """redis's ACLSetSelector: one rule, or RuleError."""
        low = op.lower()
        if low in ("allkeys", "~*"):
            self.allkeys, self.patterns = True, []
        elif low == "resetkeys":
            self.allkeys, self.patterns = False, []
        elif low in ("allchannels", "&*"):
            self.allchannels, self.channels = True, []
        elif low == "resetchannels":
            self.allchannels, self.channels = False, []
        elif low in ("allcommands", "+@all"):
            self.allowed, self.future, self.rules = set(u.everything), True, []
        elif low in ("nocommands", "-@all"):
            self.allowed, self.future, self.rules = set(), False, []
        elif op[:1] in ("~", "%"):
            self._key_pattern(op)
        elif op[:1] == "&":
            if self.allchannels:
                raise RuleError("EISDIR")
            if any(ch in op[1:] for ch in " \x00"):
                raise RuleError("EINVAL")
            if op[1:] not in self.channels:
                self.channels.append(op[1:])
        elif op[:2] in ("+@", "-@"):
            cat = op[2:].lower()
            if cat not in u.by_category:
                raise RuleError("ENOENT")
            self._change(u.by_category[cat], op[0] == "+", u)
            self._rule("@" + cat, op[0] == "+")
        elif op[:1] == "+" and "|" in op:
            self._allow_sub(op[1:], u)
        elif op[:1] in ("+", "-"):
            name = u.find(op[1:])
            if name is None:
                raise RuleError("ENOENT")
            self._change((name,), op[0] == "+", u)
            self._rule(name, op[0] == "+")
        else:
            raise RuleError("EINVAL")

    def _allow_sub(self, spec: str, u: Universe) -> None:
        container, _, sub = spec.rpartition("|")
        top = u.find(container)
        if top is None:
            raise RuleError("ENOENT")
        if "|" in top:
            raise RuleError("ECHILD")
        if not sub:
            raise RuleError("EINVAL")
        if top not in u.subs:
            raise RuleError("EFIRSTARG")
        name = u.find(spec)
        if name is None:
            raise RuleError("ENOENT")
        self._change((name,), True, u)
        self._rule(name, True)

    def _change(self, names, allow: bool, u: Universe) -> None:
        for name in names:
            group = (name, *u.subs.get(name, ()))
            if allow:
                self.allowed.update(group)
            else:
                self.allowed.difference_update(group)

    def _rule(self, name: str, allow: bool) -> None:
        """redis 7.2's ACLUpdateCommandRules: the rule replaces earlier ones for the same name
        (and for its subcommands)."""
        self.rules = [r for r in self.rules if r[1:] != name and not r[1:].startswith(name + "|")]
        self.rules.append(("+" if allow else "-") + name)

    def _key_pattern(self, op: str) -> None:
        if self.allkeys:
            raise RuleError("EEXIST")
        bits, offset = 0, 1
        if op[0] == "%":
            for offset in range(1, len(op)):
                ch = op[offset].upper()
                if ch == "R" and not bits & READ:
                    bits |= READ
                elif ch == "W" and not bits & WRITE:
                    bits |= WRITE
                elif ch == "~":
                    offset += 1
                    break
                else:
                    raise RuleError("EINVAL")
            else:
                offset = len(op)
        else:
            bits = READ | WRITE
        pattern = op[offset:]
        if pattern == "*" and bits == READ | WRITE:
            self.allkeys, self.patterns = True, []
            return
        for p in self.patterns:
            if p[0] == pattern:
                p[1] |= bits
                return
        self.patterns.append([pattern, bits])

    # -- checks --------------------------------------------------------------------------
    def check(self, cmd: Command, argv: list) -> tuple[int, int]:
        """(OK, DENIED_CMD or DENIED_KEY, the denied key's position: -1 when a command that takes
        keys names none the specs find and none is optional, which is refused, not let through)."""
        if NOAUTH not in cmd.flags and cmd.name not in self.allowed:
            return DENIED_CMD, 0
        if not self.allkeys and cmd.has_keys:
            found = keys_from_specs(cmd, argv)
            if not found and (found is None or "no_mandatory_keys" not in cmd.info_flags):
                return DENIED_KEY, -1  # a command that takes keys, its keys not found: closed, not open
            for pos, flags in found:
                words = flags.split()
                need = (READ if "access" in words else 0) | (WRITE if _WRITES.intersection(words) else 0)
                key = bytes(argv[pos])
                if not any(bits & need == need and _matcher(pattern)(key) for pattern, bits in self.patterns):
                    return DENIED_KEY, pos
        return OK, 0

    def covers(self, u: Universe) -> bool:
        """Whether it allows every command quilld serves on every key."""
        return self.allkeys and self.allowed.issuperset(u.served)

    # -- descriptions --------------------------------------------------------------------
    def commands_text(self) -> str:
        return " ".join(("+@all" if self.future else "-@all", *self.rules))

    def keys_text(self) -> str:
        if self.allkeys:
            return "~*"
        return " ".join({READ: "%R~", WRITE: "%W~"}.get(bits, "~") + p for p, bits in self.patterns)

    def channels_text(self) -> str:
        return "&*" if self.allchannels else " ".join("&" + c for c in self.channels)

    def describe(self) -> str:
        """As ACL LIST shows it (redis's ACLDescribeSelector)."""
        keys = self.keys_text()
        channels = "&*" if self.allchannels else " ".join(("resetchannels", *("&" + c for c in self.channels)))
        return " ".join(x for x in (keys, channels, self.commands_text()) if x)


_matchers: dict[str, object] = {}


def _matcher(pattern: str):
    m = _matchers.get(pattern)
    if m is None:
        if len(_matchers) > 4096:
            _matchers.clear()
        m = _matchers[pattern] = glob_matcher(pattern.encode("utf-8", "surrogateescape"))
    return m


@dataclass
class AclUser:
    """One user's ACL: how it logs in, its flags, its root selector and the others."""

    login: Login
    root: Selector
    selectors: list[Selector] = field(default_factory=list)
    sanitize: str = ""  # "", "sanitize-payload" or "skip-sanitize-payload"
    restricted: bool = False  # some command or key is denied: the dispatcher asks `refusal`

    @classmethod
    def everything(cls, login: Login, u: Universe) -> AclUser:
        """A user of the users file, or `default`: every command, key and channel."""
        return cls(login, Selector(set(u.everything), True, [], True, [], True, []))

    @classmethod
    def new(cls, u: Universe, all_channels: bool) -> AclUser:
        """A user ACL SETUSER creates: off, no command, key or password."""
        return cls(Login(enabled=False), Selector(allchannels=all_channels))

    def copy(self) -> AclUser:
        return replace(self, root=self.root.copy(), selectors=[s.copy() for s in self.selectors])

    def apply(self, op: str, u: Universe, all_channels: bool) -> None:
        """redis's ACLSetUser: one rule, or RuleError."""
        low, login = op.lower(), self.login
        if low == "on":
            self.login = replace(login, enabled=True)
        elif low == "off":
            self.login = replace(login, enabled=False)
        elif low in ("sanitize-payload", "skip-sanitize-payload"):
            self.sanitize = low
        elif low == "nopass":
            self.login = replace(login, nopass=True, digests=())
        elif low == "resetpass":
            self.login = replace(login, nopass=False, digests=())
        elif op[:1] in (">", "#"):
            value = digest(op[1:].encode("utf-8", "surrogateescape")) if op[0] == ">" else _checked_digest(op[1:])
            digests = login.digests if value in login.digests else (*login.digests, value)
            self.login = replace(login, nopass=False, digests=digests)
        elif op[:1] in ("<", "!"):
            value = digest(op[1:].encode("utf-8", "surrogateescape")) if op[0] == "<" else _checked_digest(op[1:])
            if value not in login.digests:
                raise RuleError("ENODEV")
            self.login = replace(login, digests=tuple(d for d in login.digests if d != value))
        elif op[:1] == "(" and op[-1:] == ")":
            selector = Selector(allchannels=all_channels)
            for rule in _split(op[1:-1]):
                selector.apply(rule, u)
            self.selectors.append(selector)
        elif low == "clearselectors":
            self.selectors = []
        elif low == "reset":
            self.login = Login(enabled=False)
            self.root = Selector(allchannels=all_channels)
            self.sanitize = "sanitize-payload"
            self.selectors = []
        else:
            self.root.apply(op, u)

    def settle(self, u: Universe) -> AclUser:
        self.restricted = not self.root.covers(u)
        return self

    def flags(self) -> list[str]:
        return ["on" if self.login.enabled else "off", *(["nopass"] if self.login.nopass else []),
                *([self.sanitize] if self.sanitize else [])]

    def describe(self, name: str) -> str:
        """ACL LIST's line (redis's ACLDescribeUser)."""
        parts = ["user", name, *self.flags(), *("#" + d for d in self.login.digests), self.root.describe()]
        return " ".join(parts) + "".join(f" ({s.describe()})" for s in self.selectors)

    def denial(self, cmd: Command, argv: list) -> int:
        """OK when the user may run `argv` (command `cmd`), else DENIED_CMD or DENIED_KEY."""
        worst = OK
        for selector in (self.root, *self.selectors):
            result, _ = selector.check(cmd, argv)
            if result == OK:
                return OK
            worst = max(worst, result)
        return worst

    def refusal(self, cmd: Command, argv: list) -> NoPerm | None:
        """None when the user may run `argv` (command `cmd`), else the NOPERM redis answers."""
        worst = self.denial(cmd, argv)
        if worst == OK:
            return None
        if worst == DENIED_CMD:
            return NoPerm(f"this user has no permissions to run the '{cmd.name}' command")
        return NoPerm("this user has no permissions to access one of the keys used as arguments")

    def refusal_at_exec(self, cmd: Command, argv: list) -> NoPerm | None:
        """None when the user may still run a command queued by MULTI, else redis's NOPERM for
        rights that changed since it was queued (execCommand checks each one again)."""
        worst = self.denial(cmd, argv)
        if worst == OK:
            return None
        reason = ("no permission to execute the command or subcommand" if worst == DENIED_CMD
                  else "no permission to touch the specified keys")
        return NoPerm("ACLs rules changed between the moment the transaction was accumulated and the EXEC call. "
                      f"This command is no longer allowed for the following reason: {reason}")

    def dry_run(self, cmd: Command, argv: list) -> str | None:
        """ACL DRYRUN's text for a refusal (the denied command or key), or None."""
        worst, at = OK, 0
        for selector in (self.root, *self.selectors):
            result, pos = selector.check(cmd, argv)
            if result == OK:
                return None
            if result > worst:
                worst, at = result, pos
        if worst == DENIED_CMD:
            return f"This user has no permissions to run the '{cmd.name}' command"
        if at < 0:  # its keys could not be found
            return "This user has no permissions to access one of the keys used as arguments"
        return f"This user has no permissions to access the '{bytes(argv[at]).decode('utf-8', 'replace')}' key"


def _checked_digest(text: str) -> str:
    if len(text) != 64 or not set(text) <= _HEX:
        raise RuleError("EBADMSG")
    return text


def _split(text: str) -> list[str]:
    """A selector's rules, split as redis's sdssplitargs splits them."""
    try:
        return shlex.split(text, posix=True)
    except ValueError:
        raise RuleError("EINVAL") from None


def merge_selectors(args: list[str]) -> list[str]:
    """redis's ACLMergeSelectorArguments: `(+get ~k*)` sent as two arguments is one rule;
    ValueError(the argument it starts at) when a parenthesis is never closed."""
    out: list[str] = []
    open_at: list[str] | None = None
    for a in args:
        if open_at is not None:
            open_at.append(a)
            if a.endswith(")"):
                out.append(" ".join(open_at))
                open_at = None
        elif a.startswith("(") and not a.endswith(")"):
            open_at = [a]
        else:
            out.append(a)
    if open_at is not None:
        raise ValueError(open_at[0])
    return out
