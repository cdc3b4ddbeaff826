"""Every command of the table against users held to key patterns (issue 29.17).

`PUT2PHASE PUT` wrote a key its user's pattern forbids (its key spec found keys only after
BEGIN), and a command whose key specs found no key was let through. Here each command and
subcommand quilld serves is sent in every form its documented arguments allow, each key
argument a forbidden key, by a user limited to `~carol:*` (every such form must be refused
with NOPERM) and by a read-only one, `%R~*` (the forbidden keys must come out unchanged, and
every form the server itself says writes a key must be refused)."""

from __future__ import annotations

import itertools

import crc32c
import pytest
import redis

from quilld.protocol.commands import build_table

FORBIDDEN = "alice:x"
VALUE = b"7"  # an integer: INCR, SETRANGE, GETRANGE, BITFIELD... would all succeed on it if let through
WRITES = {"RW", "OW", "RM", "insert", "update", "delete"}
MAX_FORMS = 64  # per command (each optional argument doubles them): the first ones, in document order


def _values(arg) -> list[list[str]]:
    """The argument lists one documented argument expands to: one per alternative form."""
    if arg.type == "pure-token":
        alts = [[arg.token]]
    elif arg.type == "oneof":
        alts = [a for sub in arg.args for a in _values(sub)]
    elif arg.type == "block":
        alts = _forms(arg.args)
    else:
        plain = {"key": FORBIDDEN, "pattern": "*", "integer": "1", "double": "1", "unix-time": "1"}.get(arg.type, "v")
        if arg.name == "crc":
            plain = str(crc32c.crc32c(b"v"))  # the payloads below are b"v": a put that is let through lands
        elif arg.name == "encoding":
            plain = "u8"  # BITFIELD's
        alts = [[plain]]
        if arg.token:
            alts = [[arg.token, *a] for a in alts]
    if arg.type != "pure-token" and arg.token and arg.type in ("oneof", "block"):
        alts = [[arg.token, *a] for a in alts]
    if "optional" in arg.flags:
        alts = [[]] + alts
    return alts


def _forms(args) -> list[list[str]]:
    out = [[]]
    for arg in args:
        out = [a + b for a, b in itertools.product(out, _values(arg))][:MAX_FORMS]
    return out


def every_form() -> list[tuple[str, list[str]]]:
    """(row name, argv) for every command and subcommand of the table, each form that names a key."""
    table = build_table()
    rows = []
    for cmd in table.commands.values():
        rows += [cmd, *cmd.subcommands.values()]
    out = []
    for cmd in sorted(rows, key=lambda c: c.name):
        words = cmd.name.split("|")
        doc_args = cmd.doc.args if cmd.doc is not None else ()
        for form in _forms(doc_args):
            if FORBIDDEN in form:
                out.append((cmd.name, [*words, *form]))
    return out


FORMS = every_form()


def test_the_catalogue_gives_a_keyed_form_to_every_command_that_takes_keys():
    table = build_table()
    keyed = {c.name for cmd in table.commands.values() for c in (cmd, *cmd.subcommands.values()) if c.has_keys}
    named = {name for name, _ in FORMS}
    assert keyed - {"peerget", "peermget", "peerpull"} <= named  # (a peer's commands name their keys' scope first)
    assert ["put2phase", "PUT", FORBIDDEN, "CRC32C", str(crc32c.crc32c(b"v")), "v"] in [f for _, f in FORMS]


@pytest.fixture
def node(quilld_factory):
    q = quilld_factory(admin=False)
    op = redis.Redis(port=q.port)
    for user, keys in (("carol", "~carol:*"), ("reader", "%R~*")):
        # the user's own tenant holds the forbidden key: made while the user could still write it
        assert op.execute_command("ACL", "SETUSER", user, "on", ">pw", "+@all", "~*")
        with redis.Redis(port=q.port, username=user, password="pw") as r:
            r.set(FORBIDDEN, VALUE)
        assert op.execute_command("ACL", "SETUSER", user, "resetkeys", keys)
    return q, op


def _run(client: redis.Redis, argv: list[str]):
    try:
        return client.execute_command(*argv)
    except redis.ResponseError as e:
        return e


def test_no_command_touches_a_key_outside_the_users_pattern(node):
    q, op = node
    carol = redis.Redis(port=q.port, username="carol", password="pw", socket_timeout=10)
    let_through = []
    for name, argv in FORMS:
        reply = _run(carol, argv)
        if not isinstance(reply, redis.exceptions.NoPermissionError):
            let_through.append((argv, reply))
    assert let_through == [], "answered for a key outside ~carol:*:\n" + "\n".join(map(repr, let_through))
    op.execute_command("ACL", "SETUSER", "carol", "~*")
    with redis.Redis(port=q.port, username="carol", password="pw") as r:
        assert r.get(FORBIDDEN) == VALUE and r.pttl(FORBIDDEN) == -1 and r.dbsize() == 1


def test_no_command_writes_a_key_for_a_read_only_user(node):
    q, op = node
    reader = redis.Redis(port=q.port, username="reader", password="pw", socket_timeout=10)
    reader.set_response_callback("COMMAND", lambda reply, **kw: reply)  # COMMAND GETKEYSANDFLAGS as sent
    changed, let_through = [], []
    for name, argv in FORMS:
        before = reader.execute_command("COMMAND", "GETKEYSANDFLAGS", *argv) if _has_keys(reader, argv) else []
        reply = _run(reader, argv)
        writes = [k for k, flags in before if WRITES & {f.decode() for f in flags}]
        if writes and not isinstance(reply, redis.exceptions.NoPermissionError):
            let_through.append((argv, reply))
        state = (reader.get(FORBIDDEN), reader.pttl(FORBIDDEN), reader.dbsize())
        if state != (VALUE, -1, 1):
            changed.append((argv, reply, state))
            op.execute_command("ACL", "SETUSER", "reader", "~*")  # put it back, then go on
            with redis.Redis(port=q.port, username="reader", password="pw") as r:
                r.flushdb()
                r.set(FORBIDDEN, VALUE)
            op.execute_command("ACL", "SETUSER", "reader", "resetkeys", "%R~*")
    assert changed == [], "a read-only user changed a key:\n" + "\n".join(map(repr, changed))
    assert let_through == [], "a write answered for a read-only user:\n" + "\n".join(map(repr, let_through))


def _has_keys(client: redis.Redis, argv: list[str]) -> bool:
    return not isinstance(_run(client, ["COMMAND", "GETKEYS", *argv]), redis.ResponseError)


def test_a_command_whose_keys_cannot_be_found_is_refused_not_let_through(node):
    """Selector.check fails closed: a command that takes keys, sent in a form its key specs find
    no key in (and none of whose keys is optional), is NOPERM for a key-pattern user."""
    q, op = node
    carol = redis.Redis(port=q.port, username="carol", password="pw", socket_timeout=10)
    assert carol.execute_command("PUT2PHASE", "BEGIN", "carol:a", "1")  # her own key: fine
    with pytest.raises(redis.exceptions.NoPermissionError):
        carol.execute_command("PUT2PHASE", "put", FORBIDDEN, "CRC32C", crc32c.crc32c(b"v"), "v")
    assert carol.execute_command("PUT2PHASE", "PUT", "carol:b", "CRC32C", crc32c.crc32c(b"v"), "v")
    dry = op.execute_command("ACL", "DRYRUN", "carol", "PUT2PHASE", "PUT", FORBIDDEN, "CRC32C", "1", "v")
    assert dry == f"This user has no permissions to access the '{FORBIDDEN}' key".encode()
    # DATA, COMMIT and ABORT name a handle, not a key: a put she began goes on
    h = carol.execute_command("PUT2PHASE", "BEGIN", "carol:c", "1")
    assert carol.execute_command("PUT2PHASE", "DATA", h, "0", "v") == b"OK"
    assert carol.execute_command("PUT2PHASE", "COMMIT", h) == b"OK"
    assert carol.get("carol:c") == b"v"
