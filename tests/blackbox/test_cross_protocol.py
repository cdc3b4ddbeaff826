"""Issue 19, item 10: an HTTP request sent to the RESP port is never run as commands.

A web page in a local browser can POST to 127.0.0.1:7379 (`fetch` with a text/plain body needs
no preflight); before the fix quilld answered each header line with an error and then ran the
body: `SET` and `CONFIG SET` worked (cross-protocol scripting). redis closes the connection at a
command named `POST` or `Host:`, with no reply, and logs a security warning; quilld does the
same. Each case runs against redis-server 7 in the same test and must behave alike.
"""

from __future__ import annotations

import pytest

from conftest import exchange, start_quilld, start_redis, stop_process, wait_until

pytestmark = pytest.mark.timeout(90)

WARNING = "Possible SECURITY ATTACK detected"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("xproto")
    q = start_quilld(tmp, "--dram", "16MiB")
    rport, rproc = start_redis(tmp)
    yield q, rport
    stop_process(q.proc)
    stop_process(rproc)


def browser_post(port: int, body: bytes, method: bytes = b"POST") -> bytes:
    return (method + b" /submit HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nOrigin: http://evil.example\r\n"
            b"Content-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % (port, len(body))) + body


def state(port: int) -> bytes:
    out, _ = exchange(port, b"GET pwned\r\nCONFIG GET maxclients\r\n", lines=6)
    return out


BODY = b"SET pwned yes\r\nCONFIG SET maxclients 7\r\n*3\r\n$3\r\nSET\r\n$5\r\npwned\r\n$3\r\nyes\r\n"


def test_a_browser_post_is_closed_unanswered_and_its_body_never_runs(servers):
    q, rport = servers
    for port in (q.port, rport):
        out, closed = exchange(port, browser_post(port, BODY), timeout=10)
        assert (out, closed) == (b"", True), (port, out)
        assert state(port) == b"$-1\r\n*2\r\n$10\r\nmaxclients\r\n$5\r\n10000\r\n", port
    wait_until(lambda: WARNING in q.log(), 10)
    assert q.log().count(WARNING) == 1, q.log()
    # a second attack within the minute is closed just the same, and not logged again
    out, closed = exchange(q.port, browser_post(q.port, BODY, b"post"), timeout=10)
    assert (out, closed) == (b"", True)
    assert state(q.port).startswith(b"$-1\r\n") and q.log().count(WARNING) == 1


def test_a_get_request_is_closed_at_its_host_header_as_redis_does(servers):
    q, rport = servers
    request = b"GET /?x=1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nSET pwned yes\r\n"
    replies = [exchange(port, request, timeout=10) for port in (q.port, rport)]
    assert replies[0] == replies[1], replies
    # the request line's error is dropped unsent with the connection (redis frees the client at once)
    assert replies[0] == (b"", True)
    assert state(q.port).startswith(b"$-1\r\n")


def test_before_auth_too(tmp_path):
    """A node with a password closes it the same way, before asking for AUTH."""
    q = start_quilld(tmp_path, "--dram", "16MiB", "--requirepass", "pw")
    try:
        out, closed = exchange(q.port, browser_post(q.port, b"AUTH pw\r\nSET pwned yes\r\n"), timeout=10)
        assert (out, closed) == (b"", True), out
        out, _ = exchange(q.port, b"AUTH pw\r\nEXISTS pwned\r\n", lines=2)
        assert out == b"+OK\r\n:0\r\n"
    finally:
        stop_process(q.proc)
