"""ACL against redis-server 7.0.15 (issue 18.12): users ACL SETUSER creates log in and are held
to their rules; the ACL replies and NOPERM errors are redis's, byte for byte; COMMAND GETKEYS
answers for every redis command as redis does. Each test starts its own servers: users outlive
FLUSHALL."""

from __future__ import annotations

import socket

import pytest
import redis

from conftest import cmd, read_lines, read_reply, same_reply
from quilld.protocol.commands.catalogue.redis_only import REDIS_ONLY
from quilld.protocol.table import ACL_CATEGORIES
from test_compat import run_script

DIGEST = "5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8"  # sha256("password")
SCRIPT = [
    ("ACL", "SETUSER"), ("ACL", "GETUSER", "default"), ("ACL", "SETUSER", "u"), ("ACL", "GETUSER", "u"),
    ("ACL", "SETUSER", "u2", "on", ">p", "~k*", "%R~r*", "%W~w*", "&ch", "+@all", "-get"), ("ACL", "GETUSER", "u2"),
    ("ACL", "LIST"), ("ACL", "USERS"), ("ACL", "SETUSER", "u3", "+nosuch"), ("ACL", "SETUSER", "u3", "+@nosuch"),
    ("ACL", "SETUSER", "u3", "foo"), ("ACL", "SETUSER", "u3", ">a", "nopass"), ("ACL", "GETUSER", "u3"),
    ("ACL", "SETUSER", "u3", "reset"), ("ACL", "GETUSER", "u3"), ("ACL", "DELUSER", "default"),
    ("ACL", "DELUSER", "nosuch", "u3"), ("ACL", "SETUSER", "u4", "(+get ~x*)", "(+set", "~y*)"),
    ("ACL", "GETUSER", "u4"), ("ACL", "LIST"), ("ACL", "SETUSER", "u4", "clearselectors"), ("ACL", "GETUSER", "u4"),
    ("ACL", "SETUSER", "u5", "+client|kill"), ("ACL", "GETUSER", "u5"), ("ACL", "SETUSER", "u6", "#abc"),
    ("ACL", "SETUSER", "u6", "<x"), ("ACL", "SETUSER", "u6", f"#{DIGEST}", f"!{DIGEST}"), ("ACL", "GETUSER", "u6"),
    ("ACL", "GENPASS", "0"), ("ACL", "GENPASS", "x"), ("ACL", "DRYRUN", "u2", "get", "k"),
    ("ACL", "DRYRUN", "u2", "set", "r1", "v"), ("ACL", "DRYRUN", "u2", "set", "k1", "v"),
    ("ACL", "DRYRUN", "nosuch", "get", "k"), ("ACL", "DRYRUN", "u2", "nosuchcmd"), ("ACL", "DRYRUN", "u2", "get"),
    ("ACL", "GETUSER", "nosuch"), ("ACL", "SETUSER", "u7", "~*", "~x"), ("ACL", "SETUSER", "u7", "&*", "&x"),
    ("ACL", "SETUSER", "u7", "+client|kill|x"), ("ACL", "SETUSER", "u7", "+client|"), ("ACL", "SETUSER", "u7", "(+get"),
    ("ACL", "SETUSER", "u7", "on", "nopass", "+@string", "~a*", "%RW~b*", "%R~c*", "%W~d*", "%R~c*"),
    ("ACL", "GETUSER", "u7"), ("ACL", "LIST"), ("ACL", "DRYRUN", "u7", "get", "c1"),
    ("ACL", "DRYRUN", "u7", "set", "c1", "x"), ("ACL", "DRYRUN", "u7", "append", "b1", "x"),
    ("ACL", "DRYRUN", "u7", "set", "d1", "x"), ("ACL", "DRYRUN", "u7", "getrange", "d1", "0", "1"),
    ("ACL", "DRYRUN", "u7", "ping"), ("ACL", "DRYRUN", "u7", "mset", "a1", "x", "c1", "y"),
    ("ACL", "SETUSER", "u8", "on", "+@all", "-@string", "+get", "allkeys", "allchannels"), ("ACL", "GETUSER", "u8"),
    ("ACL", "SETUSER", "u8", "nocommands", "allcommands", "-client"), ("ACL", "GETUSER", "u8"),
    ("ACL", "SETUSER", "u 9"), ("ACL", "WHOAMI"), ("ACL", "CAT", "nosuch"), ("ACL", "USERS"),
]


@pytest.mark.parametrize("resp3", [False, True], ids=["resp2", "resp3"])
def test_acl_replies_match_redis_byte_for_byte(quilld_factory, redis_server, resp3):
    q = quilld_factory(admin=False)
    theirs, ours = run_script(redis_server, SCRIPT, resp3), run_script(q.port, SCRIPT, resp3)
    assert len(theirs) == len(SCRIPT), theirs[-3:]
    for c, t, o in zip(SCRIPT, theirs, ours):
        assert same_reply(c, o, t), f"{c}: redis answered {t!r}, quilld {o!r}"


def _login(port: int, user: str, password: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(cmd("AUTH", user, password))
    assert read_lines(s, 1) == b"+OK\r\n"
    return s


def _call(s: socket.socket, *args) -> bytes:
    s.sendall(cmd(*args))
    return read_lines(s, 1)


def test_a_user_acl_setuser_adds_logs_in_and_is_held_to_its_rules(quilld_factory, redis_server):
    q = quilld_factory(admin=False)
    replies = {}
    for name, port in (("redis", redis_server), ("quilld", q.port)):
        op = redis.Redis(port=port)
        assert op.acl_setuser("alice", enabled=True, passwords=["+apw"], keys=["cache:*"],
                              commands=["+get", "+set", "+ping", "+exists"])
        op.set("cache:1", "operator's")
        alice = _login(port, "alice", "apw")
        out = [_call(alice, *c) for c in (("SET", "cache:1", "alice's"), ("GET", "cache:1"), ("GET", "other"),
                                          ("DEL", "cache:1"), ("EXISTS", "cache:1", "other"), ("PING",),
                                          ("CLIENT", "LIST"), ("AUTH", "alice", "wrong"))]
        # off: no new login, the open connection goes on; DELUSER closes it
        op.acl_setuser("alice", enabled=False)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, username="alice", password="apw").ping()
        out.append(_call(alice, "PING"))
        assert op.acl_deluser("alice") == 1
        alice.settimeout(10)
        out.append(alice.recv(100))
        replies[name] = out
        alice.close()
    assert replies["quilld"] == replies["redis"]
    assert replies["quilld"][:4] == [
        b"+OK\r\n", b"$7\r\nalice's\r\n",
        b"-NOPERM this user has no permissions to access one of the keys used as arguments\r\n",
        b"-NOPERM this user has no permissions to run the 'del' command\r\n"]
    assert replies["quilld"][-1] == b""  # closed
    # alice is a tenant: her cache:1 was her own, the operator's is unchanged
    assert redis.Redis(port=q.port).get("cache:1") == b"operator's"


def test_only_the_operator_manages_users(quilld_factory, tmp_path):
    users = tmp_path / "users"
    users.write_text("bob bpw\n")
    q = quilld_factory("--users-file", str(users), "--requirepass", "opw")
    bob = redis.Redis(port=q.port, username="bob", password="bpw")
    for call in (("ACL", "SETUSER", "eve", "on", ">x", "+@all", "~*"), ("ACL", "GETUSER", "default"),
                 ("ACL", "LIST"), ("ACL", "DELUSER", "bob"), ("ACL", "DRYRUN", "bob", "get", "k")):
        with pytest.raises(redis.exceptions.NoPermissionError, match="this user has no permissions to run"):
            bob.execute_command(*call)
    op = redis.Redis(port=q.port, password="opw")
    assert op.execute_command("ACL", "LIST") == [b"user bob on #" + _sha(b"bpw") + b" ~* &* +@all",
                                                 b"user default on #" + _sha(b"opw") + b" ~* &* +@all"]
    # a users-file user's password can be changed at run time; the file's scope stays bound
    assert op.acl_setuser("bob", enabled=True, passwords=["+bpw2", "-bpw"])
    assert redis.Redis(port=q.port, username="bob", password="bpw2").ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=q.port, username="bob", password="bpw").ping()
    with pytest.raises(redis.ResponseError, match="may not contain '~'"):
        op.acl_setuser("eve~m~t", enabled=True)


def _sha(pw: bytes) -> bytes:
    import hashlib

    return hashlib.sha256(pw).hexdigest().encode()


def test_config_set_requirepass_and_redis_pys_test_auth(quilld_factory):
    """redis-py's own test_auth: CONFIG SET requirepass, then a user made with ACL SETUSER."""
    q = quilld_factory(admin=False)
    r = redis.Redis(port=q.port)
    with pytest.raises(redis.AuthenticationError):
        r.auth("some_password")
    with pytest.raises(redis.AuthenticationError):
        r.auth("some_password", "some_user")
    assert r.config_set("requirepass", "temp_pass")
    with pytest.raises(redis.AuthenticationError):  # a new connection now needs the password
        redis.Redis(port=q.port, single_connection_client=True).ping()
    assert r.auth("temp_pass", "default") is True and r.auth("temp_pass") is True
    assert r.acl_setuser("redis-py-auth", enabled=True, passwords=["+strong_password"], commands=["+acl"])
    assert r.auth(username="redis-py-auth", password="strong_password") is True
    with pytest.raises(redis.AuthenticationError):
        r.auth(username="redis-py-auth", password="wrong_password")
    r = redis.Redis(port=q.port, password="temp_pass")  # as its teardown: the failed AUTH dropped the connection
    assert r.config_set("requirepass", "") and r.acl_deluser("redis-py-auth") == 1
    assert redis.Redis(port=q.port, single_connection_client=True).ping()  # nopass again


def test_a_password_is_refused_while_the_admin_api_is_open(quilld_factory):
    q = quilld_factory()  # an admin port, no admin.token
    r = redis.Redis(port=q.port)
    with pytest.raises(redis.ResponseError, match="admin API is open without admin.token"):
        r.config_set("requirepass", "x")
    with pytest.raises(redis.ResponseError, match="admin API is open without admin.token"):
        r.acl_setuser("default", passwords=["+x"])
    assert r.acl_setuser("carol", enabled=True, passwords=["+cpw"], commands=["+@all"], keys=["*"])  # not default
    assert redis.Redis(port=q.port, username="carol", password="cpw").ping()
    assert redis.Redis(port=q.port).ping()  # default still needs nothing


def test_the_redis_only_catalogue_is_redis_7_0_15s(redis_server):
    """Every command quilld does not serve, as redis's COMMAND INFO gives it: arity, flags, ACL
    categories and key specs (what COMMAND GETKEYS answers from)."""
    with socket.create_connection(("127.0.0.1", redis_server), timeout=10) as s:
        s.sendall(cmd("COMMAND"))
        infos = read_reply(s)
    seen = {}

    def walk(info):
        seen[info[0].decode()] = info
        for sub in info[9] or []:
            walk(sub)

    for info in infos:
        walk(info)
    for name, (arity, flags, acl, keys) in REDIS_ONLY.items():
        info = seen[name]
        assert info[1] == arity, name
        assert [f.decode() for f in info[2] if f != b"movablekeys"] == flags.split(), name
        assert [c.decode()[1:] for c in info[6]] == acl.split(), name
        assert len(info[8]) == len(keys), name
    assert all(cat in ACL_CATEGORIES for row in REDIS_ONLY.values() for cat in row[2].split())


GETKEYS = [
    ("MSET", "a", "b", "c", "d", "e", "f"), ("EVAL", '"not consulted"', "3", "key1", "key2", "key3", "arg1", "arg2"),
    ("EVAL", "x", "0"), ("LMOVE", "mylist1", "mylist2", "left", "left"), ("SORT", "k", "BY", "w", "STORE", "dst"),
    ("SORT", "k", "LIMIT", "0", "1", "STORE", "a", "STORE", "b"), ("SORT_RO", "k", "BY", "x"),
    ("MIGRATE", "h", "1", "", "0", "5", "KEYS", "a", "b"), ("MIGRATE", "h", "1", "k", "0", "5"),
    ("ZUNIONSTORE", "d", "2", "a", "b", "WEIGHTS", "1", "2"), ("XREAD", "COUNT", "2", "STREAMS", "s1", "s2", "0", "0"),
    ("GEORADIUS", "g", "0", "0", "1", "km", "STORE", "out"), ("LMPOP", "2", "a", "b", "LEFT"),
    ("CLIENT", "TRACKING", "on"), ("XINFO", "STREAM", "s"), ("GET", "k"), ("SET", "k", "v", "GET"),
    ("PING",), ("NOSUCH", "x"), ("GET",), ("EVAL", "x", "5", "a"), ("CLIENT", "NOSUCH"), ("OBJECT", "FREQ", "k"),
    ("BITFIELD", "b", "GET", "u8", "0"), ("PUBLISH", "ch", "m"), ("FCALL", "f", "1", "k"),
]


@pytest.mark.parametrize("resp3", [False, True], ids=["resp2", "resp3"])
def test_command_getkeys_matches_redis_for_every_redis_command(quilld_factory, redis_server, resp3):
    q = quilld_factory(admin=False)
    script = [("COMMAND", "GETKEYS", *c) for c in GETKEYS] + [("COMMAND", "GETKEYSANDFLAGS", *c) for c in GETKEYS]
    theirs, ours = run_script(redis_server, script, resp3), run_script(q.port, script, resp3)
    assert len(theirs) == len(script)
    for c, t, o in zip(script, theirs, ours):
        assert o == t, f"{c}: redis answered {t!r}, quilld {o!r}"


def test_rights_revoked_while_a_transaction_is_queued_are_checked_at_exec(quilld_factory, redis_server):
    """Issue 29.19: EXEC ran queued commands the user's ACL no longer allowed (`*2 +OK +OK`);
    redis checks each again and answers NOPERM for those, running the others."""
    q = quilld_factory(admin=False)
    replies = {}
    for name, port in (("redis", redis_server), ("quilld", q.port)):
        op = redis.Redis(port=port)
        assert op.acl_setuser("dan", enabled=True, passwords=["+dpw"], keys=["*"], commands=["+@all"])
        dan = _login(port, "dan", "dpw")
        out = [_call(dan, *c) for c in (("MULTI",), ("SET", "k", "v"), ("GET", "k"), ("SET", "other", "1"))]
        op.acl_setuser("dan", reset_keys=True, keys=["other"])  # k is no longer his to touch
        dan.sendall(cmd("EXEC"))
        out.append(read_lines(dan, 4))  # *3 and its three replies
        out += [_call(dan, *c) for c in (("MULTI",), ("SET", "other", "2"), ("GET", "other"))]
        op.acl_setuser("dan", commands=["-get"])  # nor is GET his to run
        dan.sendall(cmd("EXEC"))
        out.append(read_lines(dan, 3))  # *2 and its two replies
        out.append(_call(dan, "GET", "k"))
        replies[name] = out
        dan.close()
    assert replies["quilld"] == replies["redis"]
    assert replies["quilld"][4].count(b"-NOPERM ACLs rules changed") == 2
