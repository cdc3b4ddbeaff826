"""Hostile and broken input against a real quilld: garbage bytes, protocol limits,
payloads cut off mid-way, puts that never commit, wrong passwords and cross-scope reads.

Every case checks what a client observes (the reply bytes, whether the server closes
the connection, GET/EXISTS, INFO counters) and that the server is still up afterwards.
"""

from __future__ import annotations

import random
import socket
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from conftest import assert_alive, cmd, exchange, raw_exchange, start_quilld, stop_process, wait_until

MiB = 1024 * 1024
WRONGPASS = b"-WRONGPASS invalid username-password pair or user is disabled.\r\n"
NOAUTH = b"-NOAUTH Authentication required.\r\n"


# -- helpers ------------------------------------------------------------------

def arena(r: redis.Redis) -> tuple[int, int]:
    t = r.info("tiers")
    return t["dram_used_arena"], t["dram_reserved_blocks"]


def stats(r: redis.Redis) -> dict:
    return r.info("stats")


def no_retry(q, **kw) -> redis.Redis:
    """A client that reports an auth failure at once instead of retrying it."""
    return q.client(retry=Retry(NoBackoff(), 0), **kw)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One quilld for every case below that needs no special flags: whatever one case
    does to it, the next still finds it up and answering."""
    q = start_quilld(tmp_path_factory.mktemp("quilld"), "--dram", "256MiB")
    yield q
    stop_process(q.proc)


# -- garbage and protocol limits ---------------------------------------------

def test_random_binary_gets_only_errors_and_server_survives(server, redis_server):
    """Each case is answered as redis-server answers it, byte for byte, close included. A line
    in which a NUL byte comes before its end is no line yet for redis (it looks for the end
    with strchr), so such a case may get no reply at all: the connection just waits."""
    rng = random.Random(20240611)
    closed_count = answered = 0
    for i in range(16):
        # Random binary lines (CRLF-separated, so the parser has to judge each of them).
        payload = b"\r\n".join(rng.randbytes(rng.randint(0, 300)) for _ in range(rng.randint(1, 60)))
        if i % 3 == 0:
            payload = b"*" + payload  # garbage that starts like a multibulk command
        reply, closed = exchange(server.port, payload, timeout=3, quiet=0.3)
        assert (reply, closed) == exchange(redis_server, payload, timeout=3, quiet=0.3), i
        lines = [line for line in reply.split(b"\r\n") if line]
        answered += bool(lines)
        assert all(line.startswith(b"-ERR ") for line in lines), (i, reply[:300])
        if closed:
            closed_count += 1
            assert lines[-1].startswith(b"-ERR Protocol error: "), (i, lines[-1])
    assert answered >= 8 and closed_count >= 3  # most cases are answered; '*' ones end in an error
    assert_alive(server)


@pytest.mark.parametrize("payload, error", [
    (b"A" * (70 * 1024), b"too big inline request"),
    (b"*" + b"9" * (70 * 1024), b"too big mbulk count string"),
    (b"*" + b"A" * (70 * 1024), b"too big mbulk count string"),
    (b"*1\r\n$" + b"9" * (70 * 1024), b"too big bulk count string"),
    (b"*1\r\n$" + b"A" * (70 * 1024), b"too big bulk count string"),
], ids=["inline", "mbulk-digits", "mbulk-letters", "bulk-digits", "bulk-letters"])
def test_line_without_crlf_over_64k_is_a_protocol_error(server, payload, error):
    """redis-server answers every one of these (PROTO_INLINE_MAX_SIZE) and closes."""
    reply, closed = exchange(server.port, payload, timeout=3, quiet=None)
    assert reply == b"-ERR Protocol error: " + error + b"\r\n"
    assert closed
    assert_alive(server)


@pytest.mark.parametrize("payload, reply", [
    (b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$600000000\r\n", b"-ERR Protocol error: invalid bulk length\r\n"),
    (b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$-5\r\n", b"-ERR Protocol error: invalid bulk length\r\n"),
    (b"*abc\r\n", b"-ERR Protocol error: invalid multibulk length\r\n"),
    (b"*1\r\n$4\r\nPING\r\n*2\r\n$3\r\nGET\r\nxyz\r\n", b"+PONG\r\n-ERR Protocol error: expected '$', got 'x'\r\n"),
], ids=["oversized-bulk", "negative-bulk", "bad-mbulk-count", "missing-dollar"])
def test_protocol_errors_close_only_that_connection(server, payload, reply):
    r = server.client()
    before = arena(r)
    got, closed = exchange(server.port, payload, timeout=3, quiet=None)
    assert got == reply
    assert closed
    assert arena(r) == before  # an oversized header reserves nothing
    assert r.exists("k") == 0
    assert r.ping() is True  # the other connection is untouched
    assert_alive(server)


def test_commands_trickled_one_byte_at_a_time_are_answered(server):
    """A slow client: every byte of a pipeline arrives in its own TCP segment."""
    payload = cmd("SET", "trickle", "v1") + cmd("GET", "trickle") + b"PING\r\n" + cmd("DEL", "trickle")
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(len(payload)):
            try:
                s.sendall(payload[i:i + 1])
            except OSError as e:
                pytest.fail(f"quilld dropped the connection after {i} of {len(payload)} bytes: {e!r}")
            time.sleep(0.003)
        expected = b"+OK\r\n$2\r\nv1\r\n+PONG\r\n:1\r\n"
        got = b""
        deadline = time.monotonic() + 5
        while len(got) < len(expected) and time.monotonic() < deadline:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
    assert got == expected
    assert_alive(server)


def test_dollar_without_star_is_read_as_inline_commands(server):
    """As redis-server does: `$3` and `foo` are two unknown inline commands."""
    reply = raw_exchange(server.port, b"$3\r\nfoo\r\nPING\r\n", timeout=3)
    assert reply == (b"-ERR unknown command '$3', with args beginning with: \r\n"
                     b"-ERR unknown command 'foo', with args beginning with: \r\n"
                     b"+PONG\r\n")
    assert_alive(server)


# -- payloads cut off mid-way --------------------------------------------------

def _send_partial(port: int, header: bytes, body_bytes: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(header)
    chunk = b"\xab" * MiB
    sent = 0
    while sent < body_bytes:
        n = min(MiB, body_bytes - sent)
        s.sendall(chunk[:n])
        sent += n
    return s


def test_set_cut_off_mid_value_leaks_nothing_and_publishes_nothing(server):
    r = server.client()
    r.set("kept", b"old value")
    keys = r.dbsize()
    base = arena(r)
    assert base[1] == 0
    for key in (b"fresh", b"kept"):
        header = b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n" % (len(key), key, 32 * MiB)
        s = _send_partial(server.port, header, 10 * MiB)
        # While the value is arriving its space is reserved, and nothing is visible.
        assert wait_until(lambda: arena(r) == (base[0] + 32 * MiB, 1)), arena(r)
        assert r.get("fresh") is None
        assert r.get("kept") == b"old value"
        s.close()
        assert wait_until(lambda: arena(r) == base), f"arena not reclaimed: {arena(r)} != {base}"
        assert r.get("fresh") is None
        assert r.exists("fresh") == 0
        assert r.get("kept") == b"old value"  # a cut-off overwrite leaves the old value
    assert r.dbsize() == keys
    assert_alive(server)


def test_put2phase_data_cut_off_keeps_the_put_open_until_abort(server):
    r = server.client()
    base, st0 = arena(r), stats(r)
    handle = r.execute_command("PUT2PHASE", "BEGIN", "blk", 32 * MiB)
    assert arena(r) == (base[0] + 32 * MiB, base[1] + 1)
    r.execute_command("PUT2PHASE", "DATA", handle, 0, b"\x01" * MiB)
    header = b"*5\r\n$9\r\nPUT2PHASE\r\n$4\r\nDATA\r\n$%d\r\n%b\r\n$%d\r\n%d\r\n$%d\r\n" % (
        len(handle), handle, len(str(MiB)), MiB, 8 * MiB)
    clients = r.info("clients")["connected_clients"]
    s = _send_partial(server.port, header, 3 * MiB)
    assert wait_until(lambda: r.info("clients")["connected_clients"] == clients + 1)
    s.close()
    assert wait_until(lambda: r.info("clients")["connected_clients"] == clients), "the cut-off client lingers"
    assert stats(r)["put2phase_open"] == st0["put2phase_open"] + 1
    assert r.get("blk") is None and r.exists("blk") == 0
    # Only the first MiB counts as written: the cut-off payload never completed.
    with pytest.raises(redis.ResponseError, match=r"^INCOMPLETE .*%d of %d" % (31 * MiB, 32 * MiB)):
        r.execute_command("PUT2PHASE", "COMMIT", handle)
    assert arena(r) == (base[0] + 32 * MiB, base[1] + 1)  # still reserved for the open put
    assert r.execute_command("PUT2PHASE", "ABORT", handle) == b"OK"
    assert wait_until(lambda: arena(r) == base), f"arena not reclaimed: {arena(r)} != {base}"
    with pytest.raises(redis.ResponseError, match=r"^NOHANDLE"):
        r.execute_command("PUT2PHASE", "COMMIT", handle)
    st = stats(r)
    assert st["put2phase_open"] == st0["put2phase_open"]
    assert st["put2phase_aborted"] == st0["put2phase_aborted"] + 1
    assert r.get("blk") is None
    assert_alive(server)


def test_put_that_never_commits_is_reclaimed_after_its_lease(server):
    r = server.client()
    base, st0 = arena(r), stats(r)
    t0 = time.monotonic()
    handle = r.execute_command("PUT2PHASE", "BEGIN", "leased", 4 * MiB, "LEASE", 300)
    r.execute_command("PUT2PHASE", "DATA", handle, 0, b"\x02" * MiB)
    assert stats(r)["put2phase_open"] == st0["put2phase_open"] + 1
    assert arena(r) == (base[0] + 4 * MiB, base[1] + 1)
    # Housekeeping reclaims it on its own, without the client touching the handle again.
    assert wait_until(lambda: arena(r) == base, timeout=15), f"arena not reclaimed: {arena(r)} != {base}"
    assert time.monotonic() - t0 >= 0.25, "reclaimed before its lease ran out"
    time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
    with pytest.raises(redis.ResponseError, match=r"^NOHANDLE"):
        r.execute_command("PUT2PHASE", "DATA", handle, MiB, b"\x02" * 100)
    with pytest.raises(redis.ResponseError, match=r"^NOHANDLE"):
        r.execute_command("PUT2PHASE", "COMMIT", handle)
    st = stats(r)
    assert st["put2phase_expired"] >= st0["put2phase_expired"] + 1
    assert st["put2phase_open"] == st0["put2phase_open"]
    assert st["put2phase_committed"] == st0["put2phase_committed"]
    assert r.get("leased") is None and r.exists("leased") == 0
    assert arena(r) == base
    assert_alive(server)


def test_data_payload_still_arriving_when_the_lease_runs_out_is_refused(server):
    """The lease runs out while a large DATA payload is on the wire: the space is freed once
    it has arrived, and the client is told its handle is gone rather than `OK`."""
    r = server.client()
    base = arena(r)
    handle = r.execute_command("PUT2PHASE", "BEGIN", "straddle", 8 * MiB, "LEASE", 300)
    header = b"*5\r\n$9\r\nPUT2PHASE\r\n$4\r\nDATA\r\n$%d\r\n%b\r\n$1\r\n0\r\n$%d\r\n" % (
        len(handle), handle, 8 * MiB)
    with _send_partial(server.port, header, 4 * MiB) as s:
        time.sleep(0.8)  # the lease (300 ms) runs out mid-payload
        assert arena(r) == (base[0] + 8 * MiB, base[1] + 1)  # not freed under the payload
        s.sendall(b"\x01" * (4 * MiB) + b"\r\n")
        s.settimeout(5)
        reply = s.recv(4096)
    assert reply.startswith(b"-NOHANDLE "), reply
    assert wait_until(lambda: arena(r) == base), f"arena not reclaimed: {arena(r)} != {base}"
    with pytest.raises(redis.ResponseError, match=r"^NOHANDLE"):
        r.execute_command("PUT2PHASE", "COMMIT", handle)
    assert r.exists("straddle") == 0
    assert_alive(server)


# -- authentication ------------------------------------------------------------

def test_commands_before_auth_and_wrong_passwords(quilld_factory):
    q = quilld_factory("--dram", "64MiB", "--requirepass", "s3cret")
    reply = raw_exchange(q.port, b"PING\r\n" + cmd("SET", "k", "v") + b"GET k\r\n" + cmd("DBSIZE"))
    assert reply == NOAUTH * 4
    # Before AUTH, large commands are refused at the protocol level, as redis does.
    reply, closed = exchange(q.port, b"*11\r\n", timeout=3, quiet=None)
    assert (reply, closed) == (b"-ERR Protocol error: unauthenticated multibulk length\r\n", True)
    reply, closed = exchange(q.port, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$100000\r\n", timeout=3, quiet=None)
    assert (reply, closed) == (b"-ERR Protocol error: unauthenticated bulk length\r\n", True)

    session = (b"AUTH wrong\r\n" + cmd("AUTH", "default", "wrong") + b"HELLO 3 AUTH default wrong\r\n"
               + b"GET k\r\n" + b"AUTH s3cret\r\n" + b"GET k\r\n" + cmd("PING"))
    reply = raw_exchange(q.port, session)
    # The failed HELLO 3 switched nothing: the nil after AUTH is RESP2's.
    assert reply == WRONGPASS * 3 + NOAUTH + b"+OK\r\n" + b"$-1\r\n" + b"+PONG\r\n"

    with pytest.raises(redis.AuthenticationError):
        no_retry(q, password="nope").ping()
    with pytest.raises(redis.AuthenticationError):
        no_retry(q, password="nope", protocol=3).ping()
    with pytest.raises(redis.AuthenticationError):
        no_retry(q).get("k")  # no password at all

    r = q.client(password="s3cret")
    assert r.exists("k") == 0  # the SET sent before AUTH stored nothing
    assert r.info("stats")["auth_failures"] == 5
    r3 = q.client(password="s3cret", protocol=3)
    assert r3.ping() is True
    assert_alive_with_password(q, b"s3cret")


def assert_alive_with_password(q, password: bytes) -> None:
    assert q.proc.poll() is None
    assert raw_exchange(q.port, b"PING\r\n") == NOAUTH
    assert raw_exchange(q.port, b"AUTH " + password + b"\r\nPING\r\n") == b"+OK\r\n+PONG\r\n"


# -- cross-scope reads -----------------------------------------------------------

REASONS = ("cross_tenant", "cross_model", "cross_tokenizer", "cross_adapter")


def refusals(r: redis.Redis) -> dict[str, int]:
    st = r.info("stats")
    out = {reason: st[f"guard_refusals_{reason}"] for reason in REASONS}
    out["total"] = st["guard_refusals"]
    return out


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    users = tmp / "users"
    users.write_text("# tenants\nalice apw\nbob bpw\n")
    q = start_quilld(tmp, "--dram", "64MiB", "--users-file", str(users))
    yield q
    stop_process(q.proc)


def test_other_tenant_cannot_read_or_touch_a_block(tenants):
    q = tenants
    alice = q.client(username="alice", password="apw", single_connection_client=True)
    bob = q.client(username="bob", password="bpw", single_connection_client=True)
    big = random.Random(7).randbytes(64 * 1024)
    alice.set("shared", b"alice's kv block")
    alice.set("big", big)
    before, bob_before = refusals(alice), refusals(bob)

    assert bob.get("plain-miss") is None
    assert refusals(bob) == bob_before  # a plain miss is not a refusal

    assert bob.get("shared") is None
    assert bob.execute_command("GETBLK", "big") is None
    # counted for the operator (the admin API), never shown to bob (it would tell him alice holds
    # the key: issue 19 item 16) nor to alice (it would tell her bob's prompts)
    assert refusals(bob) == bob_before
    assert refusals(alice) == before
    assert bob.execute_command("LOCATE", "shared", "big") == [[], []]
    assert alice.get("shared") == b"alice's kv block" and alice.get("big") == big

    # Bob's write of the same key is his own object; Alice's stays hers.
    bob.set("shared", b"bob's")
    assert bob.get("shared") == b"bob's"
    assert alice.get("shared") == b"alice's kv block"

    # A handle is the tenant's: bob cannot write into, commit or abort alice's put.
    handle = alice.execute_command("PUT2PHASE", "BEGIN", "pending", 100)
    for args in (("DATA", handle, 0, b"x" * 100), ("DATA", handle, 0, b"x" * 40000),
                 ("COMMIT", handle), ("ABORT", handle)):
        with pytest.raises(redis.ResponseError, match=r"^NOHANDLE"):
            bob.execute_command("PUT2PHASE", *args)
    assert bob.ping() is True
    alice.execute_command("PUT2PHASE", "DATA", handle, 0, b"a" * 100)
    assert alice.execute_command("PUT2PHASE", "COMMIT", handle) == b"OK"
    assert alice.get("pending") == b"a" * 100
    assert bob.get("pending") is None
    assert_alive_with_password(q, b"alice apw")


def test_other_model_tokenizer_adapter_reads_are_refused_by_reason(tenants):
    q = tenants
    writer = q.client(username="alice", password="apw", single_connection_client=True)
    reader = q.client(username="alice", password="apw", single_connection_client=True)
    assert writer.execute_command("SCOPE", "llama-3-8b", "tok-a") == b"OK"
    writer.set("prefix-1", b"kv-1")

    cases = [
        (("mistral-7b", "tok-a"), "cross_model"),
        (("llama-3-8b", "tok-b"), "cross_tokenizer"),
        (("llama-3-8b", "tok-a", "lora-1"), "cross_adapter"),
    ]
    for scope, reason in cases:
        reader.execute_command("SCOPE", *scope)
        before = refusals(reader)
        assert reader.get("prefix-1") is None, scope
        assert delta(refusals(reader), before) == {reason: 1, "total": 1}, scope
        assert reader.execute_command("LOCATE", "prefix-1") == [[]]

    # No scope at all (the connection's default) is another model too.
    fresh = q.client(username="alice", password="apw", single_connection_client=True)
    before = refusals(fresh)
    assert fresh.get("prefix-1") is None
    assert delta(refusals(fresh), before) == {"cross_model": 1, "total": 1}

    # The same scope reads it; another tenant with the same scope does not.
    reader.execute_command("SCOPE", "llama-3-8b", "tok-a")
    assert reader.get("prefix-1") == b"kv-1"
    bob = q.client(username="bob", password="bpw", single_connection_client=True)
    bob.execute_command("SCOPE", "llama-3-8b", "tok-a")
    before = refusals(bob)
    assert bob.get("prefix-1") is None
    assert refusals(bob) == before  # refused, and not shown to bob: only the operator sees cross_tenant
    assert_alive_with_password(q, b"bob bpw")
