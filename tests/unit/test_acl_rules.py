"""ACL rules through the real command table (issue 18.12): who the dispatcher checks, what a
restricted session may run, and how rules are kept and shown."""

from __future__ import annotations

from dataclasses import replace

import pytest

from handler_context import make_context, session
from quilld.errors import NoPerm
from quilld.protocol.resp import OK
from quilld.protocol.table import Doc, KeySpec


def call(ctx, s, *args):
    return ctx.table.dispatch(s, [a.encode() if isinstance(a, str) else a for a in args])


@pytest.fixture
def ctx():
    return make_context()


def test_only_a_restricted_user_is_checked_per_command(ctx):
    """The fast path serves a session whose user may run everything on every key (perms None)."""
    op = session(ctx)
    assert op.perms is None
    assert call(ctx, op, "ACL", "SETUSER", "dave", "on", ">d", "+@all", "~*") is OK
    assert call(ctx, op, "ACL", "SETUSER", "erin", "on", ">e", "+@all", "~*", "-flushall") is OK
    dave, erin = session(ctx, "dave"), session(ctx, "erin")
    assert dave.perms is None and erin.perms is not None
    assert call(ctx, dave, "SET", "k", "v") is OK and call(ctx, erin, "SET", "k", "v") is OK
    refused = call(ctx, erin, "FLUSHALL")
    assert isinstance(refused, NoPerm)
    assert refused.message == "this user has no permissions to run the 'flushall' command"
    # new rules reach open sessions at their next command
    assert call(ctx, op, "ACL", "SETUSER", "dave", "-set") is OK
    ctx.clients.connections.clear()  # (no server here: update the sessions the test holds)
    dave.perms = ctx.users.acl_of("dave")
    assert isinstance(call(ctx, dave, "SET", "k", "v"), NoPerm)
    assert call(ctx, dave, "AUTH", "dave", "d") is OK  # AUTH, HELLO and QUIT are never denied


def test_key_patterns_read_and_write(ctx):
    op = session(ctx)
    assert call(ctx, op, "ACL", "SETUSER", "f", "on", "nopass", "+@all", "%R~r*", "%W~w*", "~b*") is OK
    f = session(ctx, "f")
    assert call(ctx, f, "SET", "w1", "x") is OK and call(ctx, f, "SET", "b1", "x") is OK
    assert isinstance(call(ctx, f, "GET", "w1"), NoPerm)  # write-only pattern
    assert call(ctx, f, "GET", "r1") is None  # readable, absent
    assert isinstance(call(ctx, f, "SET", "r1", "x"), NoPerm)
    assert isinstance(call(ctx, f, "COPY", "r1", "w2"), NoPerm) is False  # r1 read, w2 written
    assert isinstance(call(ctx, f, "MSET", "w1", "x", "r1", "y"), NoPerm)
    assert call(ctx, f, "EXISTS", "r1", "w1", "b1") == 2  # EXISTS's keys need no access: any pattern


def test_rules_are_kept_as_given_each_name_once(ctx):
    op = session(ctx)
    assert call(ctx, op, "ACL", "SETUSER", "g", "+get", "+client|kill", "-get", "+client", "+@string", "-@string",
                "+hset") is OK
    user = ctx.users.acl_of("g")
    assert user.root.commands_text() == "-@all -get +client -@string +hset"  # hset: redis's, not served here
    assert "client|kill" in user.root.allowed and "get" not in user.root.allowed
    assert call(ctx, op, "ACL", "SETUSER", "g", "+@all") is OK and ctx.users.acl_of("g").root.commands_text() == "+@all"
    err = call(ctx, op, "ACL", "SETUSER", "g", "+select|0")
    assert "quilld does not allow a first argument of a command" in err.message


def test_a_command_whose_key_specs_find_no_key_is_refused_not_let_through(ctx):
    """Issue 29.17: Selector.check let through a command that takes keys when its specs found
    none in the arguments (PUT2PHASE PUT, whose only spec looked for keys after BEGIN). A row
    whose keyword spec is not in the arguments is now refused to a key-pattern user (and run
    for one with every key); one whose keys are all optional (no_mandatory_keys) is not."""
    ran = []

    def handler(c, args):
        ran.append(bytes(args[1]))
        return OK

    for name, flags in (("wput", "write"), ("wopt", "write no_mandatory_keys")):
        row = ctx.table.add(name, -2, "write", handler)
        doc = Doc("a write whose key follows a keyword", "1.0.0", "generic", flags=flags,
                  keys=(KeySpec("OW update", keyword=("INTO", 1), range=(0, 1, 0)),))
        ctx.table.commands[name.encode()] = replace(row, doc=doc)
    op = session(ctx)
    assert call(ctx, op, "ACL", "SETUSER", "h", "on", "nopass", "+@all", "~carol:*") is OK
    h = session(ctx, "h")
    refused = call(ctx, h, "WPUT", "alice:x")
    assert isinstance(refused, NoPerm) and ran == []
    assert refused.message == "this user has no permissions to access one of the keys used as arguments"
    assert bytes(call(ctx, op, "ACL", "DRYRUN", "h", "wput", "alice:x")) == \
        b"This user has no permissions to access one of the keys used as arguments"
    assert isinstance(call(ctx, h, "WPUT", "INTO", "alice:x"), NoPerm)
    assert call(ctx, h, "WPUT", "INTO", "carol:x") is OK
    assert call(ctx, h, "WOPT", "alice:x") is OK  # none of its keys is mandatory: none named, none checked
    assert call(ctx, op, "WPUT", "alice:x") is OK  # a user with every key is not checked at all
    assert ran == [b"INTO", b"alice:x", b"alice:x"]
