"""What a command is, apart from running it: its row (`Command`) and what COMMAND INFO and
COMMAND DOCS tell about it (`Doc`, `Arg`, `KeySpec`), its flags, and where its keys are
(`keys_from_specs`, `legacy_range`, as redis finds them from its key specs).

Kept apart from table.py's dispatcher, which is compiled with mypyc (quilld/native.py): these
are frozen dataclasses with cached properties, read when a command is added, by COMMAND and by
ACL, never per call. table.py re-exports every name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

Handler = Callable[[Any, list], Any]

NOAUTH = "noauth"  # may run before AUTH (AUTH, HELLO, QUIT)
PEER = "peer"  # may run on a cluster peer's connection (PEERAUTH) whether it logged in or not
WRITE = "write"
READONLY = "readonly"
FAST = "fast"
ADMIN = "admin"
PROTECTED = "protected"  # runs only where its setting allows it (redis's CMD_PROTECTED): table.protected_refusal

# the orders redis lists them in (server.c addReplyFlagsForCommand, acl.c ACLCommandCategories, ...)
COMMAND_FLAGS = ("write", "readonly", "denyoom", "module", "admin", "pubsub", "noscript", "blocking", "loading",
                 "stale", "skip_monitor", "skip_slowlog", "asking", "fast", "no_auth", "no_mandatory_keys",
                 "no_async_loading", "no_multi", "movablekeys", "allow_busy")
ACL_CATEGORIES = ("keyspace", "read", "write", "set", "sortedset", "list", "hash", "string", "bitmap",
                  "hyperloglog", "geo", "stream", "pubsub", "admin", "fast", "slow", "blocking", "dangerous",
                  "connection", "transaction", "scripting")
KEY_FLAGS = ("RO", "RW", "OW", "RM", "access", "update", "insert", "delete", "not_key", "incomplete",
             "variable_flags")
ARG_FLAGS = ("optional", "multiple", "multiple_token")
_TABLE_FLAG_NAMES = {NOAUTH: "no_auth"}  # a row's dispatcher flag -> redis's name, for rows without a Doc


def ordered(words: str | tuple[str, ...] | frozenset[str], order: tuple[str, ...]) -> tuple[str, ...]:
    given = set(words.split()) if isinstance(words, str) else set(words)
    return tuple(w for w in order if w in given)


@dataclass(frozen=True)
class Arg:
    """One documented argument (COMMAND DOCS `arguments`); `args` for a oneof or a block."""

    name: str
    type: str  # string integer double key pattern unix-time pure-token oneof block
    token: str = ""
    key_spec: int = -1  # index of the key spec that finds it (a key argument)
    flags: str = ""  # optional multiple multiple_token
    since: str = ""
    deprecated_since: str = ""
    summary: str = ""
    args: tuple["Arg", ...] = ()


@dataclass(frozen=True)
class KeySpec:
    """Where a command's keys are (redis's key specs): a begin search, then a find-keys rule.

    begin: `index` (the argument's position) or `keyword` (keyword, startfrom); neither is
    "unknown". find: `range` (lastkey, keystep, limit) or `keynum` (keynumidx, firstkey,
    keystep); neither is "unknown".
    """

    flags: str  # RO RW OW RM access update insert delete not_key incomplete variable_flags
    index: int = 0
    keyword: tuple[str, int] | None = None
    range: tuple[int, int, int] | None = None
    keynum: tuple[int, int, int] | None = None
    notes: str = ""


KeysOf = Callable[[list], list[tuple[int, str]]]  # argv -> [(position, key flags)]


@dataclass(frozen=True)
class Doc:
    """What COMMAND INFO and COMMAND DOCS tell about a command beyond its arity and handler."""

    summary: str
    since: str
    group: str
    complexity: str = ""
    flags: str = ""  # redis's command flags, as COMMAND INFO names them
    acl: str = ""  # ACL categories it is declared in (those its flags imply are added)
    tips: str = ""
    keys: tuple[KeySpec, ...] = ()
    args: tuple[Arg, ...] = ()
    history: tuple[tuple[str, str], ...] = ()
    doc_flags: str = ""  # deprecated syscmd
    deprecated_since: str = ""
    replaced_by: str = ""
    getkeys: KeysOf | None = None  # keys and their flags when the specs cannot tell (SET ... GET)
    redact: Callable[[list], list[int]] | None = None  # arguments MONITOR and the slowlog never show
    sampled: bool | None = None  # timed one call in SAMPLE_EVERY; None: when redis calls it fast
    multi: Callable[[list], str | None] | None = None  # why these arguments may not be queued by MULTI, or None


@dataclass(frozen=True)
class Command:
    name: str  # lowercase, as redis names it in errors (`client|setname` for subcommands)
    arity: int  # redis convention: n means exactly n arguments (name included), -n at least n
    flags: frozenset[str]
    handler: Handler
    summary: str = ""
    group: str = "generic"
    since: str = "1.0.0"
    first_key: int = 0
    last_key: int = 0
    step: int = 0
    subcommands: dict[bytes, "Command"] = field(default_factory=dict)
    doc: Doc | None = None
    arg_limit: int = 0  # bytes one argument may hold (0: proto-max-bulk-len); a longer one is refused unread

    @cached_property
    def _legacy(self) -> tuple[int, int, int, bool]:
        if self.doc is None:
            return self.first_key, self.last_key, self.step, False
        return legacy_range(self.doc.keys)

    @property
    def key_range(self) -> tuple[int, int, int]:
        """(first key, last key, step) as COMMAND INFO gives them."""
        return self._legacy[:3]

    @cached_property
    def info_flags(self) -> tuple[str, ...]:
        if self.doc is None:
            return ordered(frozenset(_TABLE_FLAG_NAMES.get(f, f) for f in self.flags), COMMAND_FLAGS)
        movable = ("movablekeys",) if self._legacy[3] else ()
        return ordered(tuple(self.doc.flags.split()) + movable, COMMAND_FLAGS)

    @cached_property
    def acl_categories(self) -> tuple[str, ...]:
        """The declared categories and those the flags imply (server.c setImplicitACLCategories)."""
        cats = set(self.doc.acl.split()) if self.doc else set()
        flags = set(self.info_flags)
        if "write" in flags:
            cats.add("write")
        if "readonly" in flags and "scripting" not in cats:
            cats.add("read")
        if "admin" in flags:
            cats |= {"admin", "dangerous"}
        for implied in ("pubsub", "fast", "blocking"):
            if implied in flags:
                cats.add(implied)
        if "fast" not in cats:
            cats.add("slow")
        return ordered(frozenset(cats), ACL_CATEGORIES)

    @property
    def has_keys(self) -> bool:
        """redis's doesCommandHaveKeys: a key spec that is not `not_key`, or a getkeys function."""
        doc = self.doc
        if doc is None:
            return self.first_key > 0
        return doc.getkeys is not None or any("not_key" not in k.flags.split() for k in doc.keys)


def legacy_range(specs: tuple[KeySpec, ...]) -> tuple[int, int, int, bool]:
    """(first, last, step, movable) from the key specs, as redis's populateCommandLegacyRangeSpec."""
    if not specs:
        return 0, 0, 0, False
    plain = [s.keyword is None and s.range is not None for s in specs]
    if len(specs) == 1 and plain[0]:
        s = specs[0]
        last = s.range[0]
        return s.index, (last + s.index if last >= 0 else last), s.range[1], "incomplete" in s.flags.split()
    first, last, prev_last, movable = None, 0, 0, False
    for s, ok in zip(specs, plain):
        if not ok or s.range[1] != 1 or (prev_last and prev_last != s.index - 1):
            movable = True
            continue
        if "incomplete" in s.flags.split():
            movable = True
        first = s.index if first is None else min(first, s.index)
        abs_last = s.range[0] + s.index if s.range[0] >= 0 else s.range[0]
        last = max(last % (1 << 32), abs_last % (1 << 32))  # redis compares them unsigned
        last = last - (1 << 32) if last >= 1 << 31 else last
        prev_last = last
    if first is None:
        return 0, 0, 0, True
    return first, last, 1, movable


def keys_from_specs(cmd: Command, argv: list) -> list[tuple[int, str]] | None:
    """The positions of `argv`'s keys with their flags (redis's getKeysFromCommandWithSpecs),
    or None when the arguments do not fit the specs."""
    doc = cmd.doc
    if doc is None:
        if not cmd.first_key:
            return []
        last = cmd.last_key if cmd.last_key >= 0 else len(argv) + cmd.last_key
        if last >= len(argv):
            return None
        return [(i, "") for i in range(cmd.first_key, last + 1, cmd.step or 1)]
    specs = doc.keys
    # the specs cannot tell (their flags vary, or some keys are past what they find): ask getkeys
    partial = any({"variable_flags", "incomplete"} & set(s.flags.split()) for s in specs)
    if doc.getkeys is not None and (partial or not specs):
        return doc.getkeys(argv)
    found = _keys_by_specs(specs, argv)
    if found is None and doc.getkeys is not None:
        return doc.getkeys(argv)
    return found


def _keys_by_specs(specs: tuple[KeySpec, ...], argv: list) -> list[tuple[int, str]] | None:
    argc, out = len(argv), []
    for spec in specs:
        if "not_key" in spec.flags.split():
            continue
        if spec.keyword is not None:
            keyword, start = spec.keyword
            begin = start if start > 0 else argc + start
            end = argc - 1 if start > 0 else 1
            first, i = 0, begin
            while i != end and 1 <= i < argc:
                if bytes(argv[i]).lower() == keyword.lower().encode():
                    first = i + 1
                    break
                i += 1 if begin <= end else -1
            if not first:
                continue
        elif spec.range is None and spec.keynum is None:
            return None
        else:
            first = spec.index
        if spec.range is not None:
            lastkey, step, limit = spec.range
            if lastkey >= 0:
                last = first + lastkey
            elif not limit:
                last = argc + lastkey
            else:
                last = first + ((argc - first) // limit + lastkey)
        elif spec.keynum is not None:
            numidx, firstkey, step = spec.keynum
            if first + numidx >= argc:
                return None
            raw = bytes(argv[first + numidx])
            if not (raw == b"0" or (raw[:1] in b"123456789" and raw.isdigit() and len(raw) < 19)):
                return None  # not a count string2ll would take, or negative
            first += firstkey
            last = first + int(raw) - 1
        else:
            return None
        if last >= argc or last < first or first >= argc:
            return None
        out.extend((i, spec.flags) for i in range(first, last + 1, step))
        if "incomplete" in spec.flags.split():
            return None
    return out
