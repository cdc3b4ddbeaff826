"""Every door a TTL comes in by range-checks it as redis-server 7.0.15 does (issue 29.14): the
same reply, the same key made or not, the same deadline, at the edges of 64 bits. A deadline
quilld keeps always fits the signed 64-bit unix ms its SSD tier packs."""

from __future__ import annotations

import pytest
import redis

pytestmark = pytest.mark.shared_node  # one quilld and one redis-server for the module


def relative_and_tiny(cmd: tuple) -> bool:  # 1 ms from now: gone or not by the time EXISTS runs
    return "1" in cmd and not ({"EXAT", "PXAT", "ABSTTL", "expireat", "pexpireat"} & set(cmd))


MAX = "9223372036854775807"
SECONDS_EDGE = ("9223372036854775", "9223372036854776", "-9223372036854775", "-9223372036854776")
VALUES = (MAX, "9223372036854775806", "9223372036854000000", "-9223372036854775808", "-1", "0", "1", "3000",
          *SECONDS_EDGE)
CASES = [("set", "a", "b", opt, v) for opt in ("EX", "PX", "EXAT", "PXAT") for v in VALUES]
CASES += [("getex", "a", opt, v) for opt in ("EX", "PX", "EXAT", "PXAT") for v in VALUES]
CASES += [(name, "a", v) for name in ("expire", "pexpire", "expireat", "pexpireat") for v in VALUES]
CASES += [(name, "a", v, "b") for name in ("setex", "psetex") for v in VALUES]
CASES += [("restore", "a", v, "PAYLOAD", "REPLACE", *absttl) for v in VALUES for absttl in ((), ("ABSTTL",))]
CASES += [("restore", "new", v, "PAYLOAD", *absttl) for v in VALUES for absttl in ((), ("ABSTTL",))]
CASES = [c for c in CASES if not relative_and_tiny(c)]


def outcome(client: redis.Redis, cmd: tuple, payload: bytes):
    client.delete("new")
    client.set("a", "b")
    try:
        reply = client.execute_command(*(payload if a == "PAYLOAD" else a for a in cmd))
    except redis.ResponseError as e:
        reply = f"-{e}"
    key = cmd[1]
    return reply, client.exists(key), client.pexpiretime(key)


@pytest.mark.parametrize("cmd", CASES, ids=" ".join)
def test_a_ttl_at_the_edge_of_64_bits_is_taken_or_refused_as_redis_does(quilld, redis_server, cmd):
    r, q = redis.Redis(port=redis_server), quilld.client()
    r.set("src", "v" * 100)
    payload = r.dump("src")
    theirs, ours = outcome(r, cmd, payload), outcome(q, cmd, payload)
    assert ours[:2] == theirs[:2], f"redis: {theirs}, quilld: {ours}"
    if theirs[2] < 0 or cmd[0] in ("expireat", "pexpireat") or "AT" in cmd or "ABSTTL" in cmd:
        assert ours[2] == theirs[2]  # an absolute deadline, exactly
    else:
        assert abs(ours[2] - theirs[2]) < 5_000  # a relative one: the two clocks read apart
    assert ours[2] <= int(MAX)
