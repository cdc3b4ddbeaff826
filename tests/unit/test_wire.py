"""quillwire, the sans-IO codec quilld's peer client and quillclient share, on plain byte
strings: the command encoder (large arguments stay the caller's memory) and the reply
reader (every reply split at every byte offset reads the same, announced payloads land
in the caller's buffer, every limit is hit).
"""

from __future__ import annotations

import array
import asyncio
import os
import random
import re
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quillwire.encode import LARGE_ARG, encode_command, pack_command
from quillwire.reply import (
    MAX_ARRAY_LEN,
    MAX_BULK_LEN,
    MAX_DEPTH,
    MAX_LINE,
    NEED_DATA,
    Bulk,
    ProtocolError,
    ReplyError,
    ReplyReader,
    Status,
)

# -- helpers ----------------------------------------------------------------


def plain(value):
    """A reply with every buffer as bytes and errors as ('ERR', text), for comparisons."""
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, ReplyError):
        return ("ERR", value.message)
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def attach_new(reader: ReplyReader, bulk: Bulk) -> None:
    reader.attach(bytearray(bulk.length))


def read(chunks, large_bulk=None, answer=attach_new) -> list:
    """Feed `chunks` one by one; every reply, with announced bulks answered by `answer`."""
    reader = ReplyReader(large_bulk)
    out = []
    for chunk in chunks:
        reader.feed(chunk)
        while (ev := reader.next_event()) is not NEED_DATA:
            if type(ev) is Bulk:
                answer(reader, ev)
            else:
                out.append(ev)
    assert reader.idle, f"reader not idle after {chunks!r}"
    return out


def splits(data: bytes):
    """`data` whole, byte by byte, and cut in two at every offset."""
    yield [data]
    yield [data[i:i + 1] for i in range(len(data))]
    for i in range(1, len(data)):
        yield [data[:i], data[i:]]


PAYLOAD = bytes(range(256)) * 3 + b"\r\n$-1\r\n*2\r\n"  # 778 bytes, RESP-looking bytes inside

REPLIES = {
    "status": (b"+OK\r\n", [b"OK"]),
    "error": (b"-WRONGTYPE Operation against a key\r\n", [("ERR", "WRONGTYPE Operation against a key")]),
    "integer": (b":42\r\n:-7\r\n:0\r\n", [42, -7, 0]),
    "nil_bulk": (b"$-1\r\n", [None]),
    "nil_array": (b"*-1\r\n", [None]),
    "resp3_null": (b"_\r\n", [None]),
    "empty_bulk": (b"$0\r\n\r\n", [b""]),
    "empty_array": (b"*0\r\n", [[]]),
    "bulk": (b"$%d\r\n%b\r\n" % (len(PAYLOAD), PAYLOAD), [PAYLOAD]),
    "peerget": (b"*2\r\n:3735928559\r\n$%d\r\n%b\r\n" % (len(PAYLOAD), PAYLOAD), [[3735928559, PAYLOAD]]),
    "mget": (b"*4\r\n$3\r\nabc\r\n$-1\r\n$5\r\nhe\r\no\r\n$0\r\n\r\n", [[b"abc", None, b"he\r\no", b""]]),
    "nested": (b"*3\r\n*2\r\n:1\r\n+x\r\n*0\r\n-ERR in\r\n", [[[1, b"x"], [], ("ERR", "ERR in")]]),
    "pipeline": (b"+OK\r\n$-1\r\n$3\r\nabc\r\n-ERR no\r\n*1\r\n$2\r\nhi\r\n",
                 [b"OK", None, b"abc", ("ERR", "ERR no"), [b"hi"]]),
}


# -- the encoder --------------------------------------------------------------

def test_small_arguments_become_one_piece():
    assert pack_command("SET", b"k", 12, -3, 1.5) == [
        b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n12\r\n$2\r\n-3\r\n$3\r\n1.5\r\n"]
    assert encode_command("GET", "clé") == b"*2\r\n$3\r\nGET\r\n$4\r\ncl\xc3\xa9\r\n"


def test_large_arguments_stay_the_callers_memory():
    data = bytearray(b"x" * LARGE_ARG)
    raw = b"y" * (LARGE_ARG + 5)
    pieces = pack_command("PUT2PHASE", "DATA", "h", 0, data, raw)
    assert pieces[0] == b"*6\r\n$9\r\nPUT2PHASE\r\n$4\r\nDATA\r\n$1\r\nh\r\n$1\r\n0\r\n$%d\r\n" % LARGE_ARG
    assert isinstance(pieces[1], memoryview) and pieces[1].obj is data  # not copied
    assert pieces[2] == b"\r\n$%d\r\n" % len(raw)
    assert pieces[3] is raw
    assert pieces[4] == b"\r\n"
    assert b"".join(pieces) == encode_command("PUT2PHASE", "DATA", "h", 0, bytes(data), raw)


def test_large_arg_limit_is_exact():
    below = pack_command("SET", "k", b"v" * (LARGE_ARG - 1))
    at = pack_command("SET", "k", bytearray(LARGE_ARG))
    assert len(below) == 1
    assert len(at) == 3 and isinstance(at[1], memoryview)


def test_buffers_of_any_format_are_sent_as_their_bytes():
    ints = array.array("i", [1, 2, 3])
    assert encode_command("SET", "k", ints) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n%b\r\n" % (
        ints.itemsize * 3, ints.tobytes())
    strided = memoryview(bytearray(b"abcdef"))[::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        pack_command("SET", "k", strided)


@pytest.mark.parametrize("arg, match", [(True, "bool"), (None, "NoneType"), (object(), "object"),
                                        ([b"a"], "list")])
def test_unsendable_arguments_raise_type_error(arg, match):
    with pytest.raises(TypeError, match=match):
        pack_command("SET", "k", arg)


def test_a_command_needs_an_argument():
    with pytest.raises(ValueError):
        pack_command()


def test_the_encoder_does_not_split_its_first_argument():
    # splitting "CLIENT LIST" is redis-py's API, kept in quillclient's redis-py packer
    assert read([encode_command("CLIENT LIST")]) == [[b"CLIENT LIST"]]
    from quillclient.client import CommandPacker

    assert b"".join(CommandPacker().pack("CLIENT LIST", "x")) == encode_command("CLIENT", "LIST", "x")


@settings(max_examples=60, deadline=None)
@given(args=st.lists(st.one_of(st.binary(max_size=40), st.text(max_size=10),
                               st.integers(-10**18, 10**18)), min_size=1, max_size=6))
def test_a_command_reads_back_as_the_array_of_its_arguments(args):
    expected = [a if isinstance(a, bytes) else str(a).encode() if isinstance(a, int) else a.encode()
                for a in args]
    assert read([encode_command(*args)]) == [expected]


# -- the reader: every reply at every split -------------------------------------

@pytest.mark.parametrize("name", REPLIES)
@pytest.mark.parametrize("large_bulk", [None, 0, 4], ids=["bytes", "all_announced", "announced_from_4"])
def test_every_split_reads_the_same(name, large_bulk):
    data, expected = REPLIES[name]
    for chunks in splits(data):
        assert plain(read(chunks, large_bulk)) == expected, f"{name} split as {[len(c) for c in chunks]}"


def test_types_of_values():
    (ok, err, n, nil) = read([b"+OK\r\n-NOAUTH Authentication required.\r\n:5\r\n$-1\r\n"])
    assert type(ok) is Status and ok == b"OK"
    assert isinstance(err, ReplyError) and err.message == "NOAUTH Authentication required."
    assert type(n) is int and nil is None


def test_attached_payload_lands_in_the_callers_buffer():
    target = bytearray(b"#" * (len(PAYLOAD) + 4))
    seen = []

    def answer(reader, bulk):
        seen.append((bulk.depth, bulk.index, bulk.count, list(bulk.items)))
        reader.attach(target)  # longer than the payload: it fills the front

    [reply] = read([REPLIES["peerget"][0]], 0, answer)
    assert seen == [(1, 1, 2, [3735928559])]
    assert reply[0] == 3735928559 and reply[1] is target
    assert target == PAYLOAD + b"####"


def test_a_buffer_of_any_item_format_receives_bytes():
    ints = array.array("i", [0, 0])
    payload = array.array("i", [7, -1]).tobytes()
    [reply] = read([b"$%d\r\n%b\r\n" % (len(payload), payload)], 0, lambda r, b: r.attach(ints))
    assert reply is ints and ints.tolist() == [7, -1]


def test_mget_style_array_lands_each_bulk_in_its_own_buffer():
    targets = [bytearray(3), bytearray(5), bytearray(0)]
    it = iter(targets)
    data = REPLIES["mget"][0]
    for chunks in splits(data):
        it = iter(targets)
        [reply] = read(chunks, 0, lambda r, b: r.attach(next(it)))
        assert reply[0] is targets[0] and reply[1] is None and reply[2] is targets[1] and reply[3] is targets[2]
        assert targets[:2] == [b"abc", b"he\r\no"]


def test_a_top_level_bulk_is_announced_at_depth_zero():
    reader = ReplyReader()
    reader.feed(b"$3\r\nab")
    bulk = reader.next_event()
    assert (bulk.length, bulk.depth, bulk.items, bulk.count, bulk.index) == (3, 0, None, None, None)


def socket_read(data: bytes, step: int, hint: int, target: bytearray) -> tuple[list, int]:
    """Replies read with get_buffer/buffer_updated, at most `step` bytes per "recv";
    how many of the payload bytes were received straight into `target`."""
    reader = ReplyReader(0)
    out, pos, direct = [], 0, 0
    while pos < len(data) or not reader.idle:
        ev = reader.next_event()
        if ev is NEED_DATA:
            view = reader.get_buffer(hint)
            n = min(len(view), step, len(data) - pos)
            assert n > 0, "the reader waits for data that will never come"
            view[:n] = data[pos:pos + n]
            if view.obj is target:
                direct += n
            reader.buffer_updated(n)
            pos += n
        elif type(ev) is Bulk:
            reader.attach(target)
        else:
            out.append(ev)
    return out, direct


@pytest.mark.parametrize("step", [1, 2, 3, 7, 64, 1000, 10**6])
@pytest.mark.parametrize("hint", [-1, 1, 16])
def test_received_in_place_at_any_recv_size(step, hint):
    data = REPLIES["peerget"][0]
    target = bytearray(len(PAYLOAD))
    out, direct = socket_read(data, step, hint, target)
    assert plain(out) == [[3735928559, PAYLOAD]]
    if hint == 1:  # headers read a byte at a time: the whole payload goes straight to the target
        assert direct == len(PAYLOAD)
    if step == 10**6 and hint == -1:  # all in one recv: copied from the reader's buffer once
        assert direct == 0


def test_drop_and_take():
    data = b"*3\r\n$4\r\nkeep\r\n$4\r\ndrop\r\n$4\r\ntake\r\n"
    for chunks in splits(data):
        calls = iter([lambda r: r.attach(bytearray(4)), lambda r: r.drop("dropped"), lambda r: r.take()])
        [reply] = read(chunks, 0, lambda r, b: next(calls)(r))
        assert plain(reply) == [b"keep", "dropped", b"take"]
        assert type(reply[2]) is bytes


def test_a_dropped_payload_larger_than_the_buffer():
    big = b"z" * 300_000  # more than the reader's own buffer
    data = b"$%d\r\n%b\r\n+OK\r\n" % (len(big), big)
    reader = ReplyReader(0)
    reader.feed(data[:10])
    assert type(reader.next_event()) is Bulk
    reader.drop()
    pos = 10
    while (ev := reader.next_event()) is NEED_DATA:
        view = reader.get_buffer(4096)
        n = min(len(view), len(data) - pos)
        view[:n] = data[pos:pos + n]
        reader.buffer_updated(n)
        pos += n
    assert ev is None
    assert reader.next_event() == b"OK" and reader.idle


def test_unannounced_bulk_larger_than_the_buffer_comes_out_whole():
    big = bytes(range(256)) * 1000
    assert read([b"$%d\r\n" % len(big), big[:100], big[100:], b"\r\n"]) == [big]


def test_feeding_far_ahead_of_reading():
    data = b"".join(b"$6\r\nv%05d\r\n" % i for i in range(30_000))  # 390 KB, more than the buffer
    assert read([data]) == [b"v%05d" % i for i in range(30_000)]


def test_buffered_and_idle():
    reader = ReplyReader()
    reader.feed(b"+OK\r\n:1")
    assert not reader.idle and reader.buffered == 7
    assert reader.next_event() == b"OK"
    assert reader.next_event() is NEED_DATA and not reader.idle
    reader.feed(b"\r\n")
    assert reader.next_event() == 1 and reader.idle and reader.buffered == 0


# -- the reader: misuse -----------------------------------------------------------

def test_an_announcement_must_be_answered():
    reader = ReplyReader()
    reader.feed(b"$3\r\nabc\r\n")
    assert type(reader.next_event()) is Bulk
    with pytest.raises(RuntimeError, match="answer"):
        reader.next_event()
    with pytest.raises(ValueError, match="3 bytes but the buffer holds 2"):
        reader.attach(bytearray(2))
    with pytest.raises(TypeError, match="writable"):
        reader.attach(b"xyz")
    with pytest.raises(ValueError, match="C-contiguous"):
        reader.attach(memoryview(bytearray(6))[::2])
    target = bytearray(3)
    reader.attach(target)  # still answerable after the refusals
    assert reader.next_event() is target and target == b"abc"
    with pytest.raises(RuntimeError, match="no bulk"):
        reader.drop()


# -- the reader: errors and limits --------------------------------------------------

@pytest.mark.parametrize("data, match", [
    (b"$3\r\nabcXY", "not followed by CRLF"),
    (b"$3\r\nabc\rX", "not followed by CRLF"),
    (b"*1\r\n$0\r\nXX", "not followed by CRLF"),
    (b"$-2\r\n", "invalid bulk length"),
    (b"$01\r\n", "invalid bulk length"),
    (b"$+1\r\n", "invalid bulk length"),
    (b"$1_0\r\n", "invalid bulk length"),
    (b"$ 1\r\n", "invalid bulk length"),
    (b"$-0\r\n", "invalid bulk length"),
    (b"$\r\n", "invalid bulk length"),
    (b"*x\r\n", "invalid array length"),
    (b"*-2\r\n", "invalid array length"),
    (b":1.5\r\n", "invalid integer"),
    (b":\r\n", "invalid integer"),
    (b"_x\r\n", "unexpected reply"),
    (b"~1\r\n", "unexpected reply"),
    (b"hello\r\n", "unexpected reply"),
])
@pytest.mark.parametrize("large_bulk", [None, 0])
def test_malformed_replies_raise_protocol_error(data, match, large_bulk):
    for chunks in splits(data):
        with pytest.raises(ProtocolError, match=match):
            read(chunks, large_bulk, lambda r, b: r.attach(bytearray(b.length)))
    assert issubclass(ProtocolError, ValueError)


def test_limit_max_line():
    ok = b"+" + b"s" * (MAX_LINE - 1) + b"\r\n"  # the line without its CRLF is MAX_LINE bytes
    assert read([ok]) == [ok[1:-2]]
    with pytest.raises(ProtocolError, match="longer than"):
        read([b"-" + b"e" * MAX_LINE + b"\r\n"])  # arrived whole
    reader = ReplyReader()
    reader.feed(b"+" + b"s" * (MAX_LINE - 1))
    assert reader.next_event() is NEED_DATA  # at the limit, still waiting for its CRLF
    reader.feed(b"s")
    with pytest.raises(ProtocolError, match="longer than"):
        reader.next_event()  # over it with no end in sight


def test_limit_max_bulk_len():
    assert ReplyReader().max_bulk_len == MAX_BULK_LEN
    with pytest.raises(ProtocolError, match="over the reader's limit"):
        read([b"$%d\r\n" % (MAX_BULK_LEN + 1)])
    reader = ReplyReader(None, max_bulk_len=100)
    reader.feed(b"$100\r\n" + b"a" * 100 + b"\r\n$101\r\n")
    assert reader.next_event() == b"a" * 100
    with pytest.raises(ProtocolError, match="over the reader's limit of 100"):
        reader.next_event()
    # take() allocates too: the same limit
    reader = ReplyReader(0, max_bulk_len=100)
    reader.feed(b"$101\r\n")
    assert reader.next_event().length == 101
    with pytest.raises(ProtocolError, match="over the reader's limit"):
        reader.take()
    # an attached bulk goes to the caller's memory: the caller judges its length
    reader = ReplyReader(0, max_bulk_len=100)
    reader.feed(b"$101\r\n" + b"b" * 101 + b"\r\n")
    target = bytearray(101)
    reader.next_event()
    reader.attach(target)
    assert reader.next_event() is target


def test_limit_max_array_len():
    reader = ReplyReader()
    reader.feed(b"*%d\r\n:1\r\n" % MAX_ARRAY_LEN)
    assert reader.next_event() is NEED_DATA  # accepted: elements are kept as they come
    with pytest.raises(ProtocolError, match="invalid array length"):
        read([b"*%d\r\n" % (MAX_ARRAY_LEN + 1)])


def test_limit_max_depth():
    deepest = b"*1\r\n" * MAX_DEPTH + b":1\r\n"
    value: object = 1
    for _ in range(MAX_DEPTH):
        value = [value]
    assert read([deepest]) == [value]
    with pytest.raises(ProtocolError, match="nested deeper"):
        read([b"*1\r\n" * (MAX_DEPTH + 1) + b":1\r\n"])


def test_limit_signed_64_bit_integers_and_lengths():
    assert read([b":9223372036854775807\r\n:-9223372036854775808\r\n"]) == [2**63 - 1, -2**63]
    for bad in (b":9223372036854775808\r\n", b":-9223372036854775809\r\n", b":" + b"9" * 5000 + b"\r\n"):
        with pytest.raises(ProtocolError, match="invalid integer"):
            read([bad])
    with pytest.raises(ProtocolError, match="invalid bulk length"):
        read([b"$99999999999999999999\r\n"])


# -- hypothesis: random reply trees, random splits ---------------------------------

leaf = st.one_of(st.binary(max_size=60), st.integers(-2**63, 2**63 - 1), st.none(),
                 st.text(alphabet="abcXYZ -_:", max_size=20).map(lambda s: ("ERR", s)),
                 st.text(alphabet="OKabc ", max_size=10).map(lambda s: ("+", s)))
tree = st.recursive(leaf, lambda kids: st.lists(kids, max_size=4), max_leaves=12)


def encode_reply(value) -> bytes:
    if isinstance(value, bytes):
        return b"$%d\r\n%b\r\n" % (len(value), value)
    if isinstance(value, int):
        return b":%d\r\n" % value
    if value is None:
        return b"$-1\r\n"
    if isinstance(value, tuple):
        return (b"-" if value[0] == "ERR" else b"+") + value[1].encode() + b"\r\n"
    return b"*%d\r\n" % len(value) + b"".join(encode_reply(v) for v in value)


def expected_value(value):
    if isinstance(value, tuple):
        return value if value[0] == "ERR" else value[1].encode()
    if isinstance(value, list):
        return [expected_value(v) for v in value]
    return value


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(replies=st.lists(tree, min_size=1, max_size=4), large_bulk=st.sampled_from([None, 0, 8]),
       data=st.data())
def test_random_replies_through_random_splits(replies, large_bulk, data):
    wire = b"".join(encode_reply(r) for r in replies)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=6), label="cuts"))
    chunks = [wire[a:b] for a, b in zip([0] + cuts, cuts + [len(wire)])]
    assert plain(read(chunks, large_bulk)) == [expected_value(r) for r in replies]


# -- its two users on loopback: quilld's peer client, quillclient's raw sockets -------------

class CannedServer:
    """A loopback server answering each request with the next canned reply, `step` bytes per
    send; a None after a reply closes the connection right after it (else it stays open until
    the client closes it). Bounded: every socket has a timeout."""

    def __init__(self, replies: list[bytes | None], step: int = 1 << 20, pause: float = 0.0) -> None:
        self.replies = list(replies)
        self.step = step
        self.pause = pause  # seconds between two sends of one reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(10)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while self.replies:
                conn, _ = self.sock.accept()
                conn.settimeout(10)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with conn:
                    while self.replies and conn.recv(65536):
                        reply = self.replies.pop(0)
                        for i in range(0, len(reply), self.step):
                            conn.sendall(reply[i:i + self.step])
                            if self.pause:
                                time.sleep(self.pause)
                        if self.replies and self.replies[0] is None:
                            self.replies.pop(0)
                            break
                    else:  # the last reply sent: the connection stays open until the client closes it
                        conn.recv(1)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        self.thread.join(timeout=10)


PEER_PAYLOAD = bytes(range(256)) * 12  # 3072 bytes
PEER_HIT = b"*2\r\n:77\r\n$%d\r\n%b\r\n" % (len(PEER_PAYLOAD), PEER_PAYLOAD)
PEER_HIT_PXAT = b"*3\r\n:77\r\n$%d\r\n%b\r\n:1700000000123\r\n" % (len(PEER_PAYLOAD), PEER_PAYLOAD)


def peer_fetch(replies: list[bytes | None], step: int = 1 << 20, fetches: int = 1):
    """`fetches` fetch_into calls on one PeerConnection; per call (result or exception, lengths
    asked of target, whether the connection is closed after it)."""
    from quilld.cluster.peer_client import PeerConnection

    server = CannedServer(replies, step)

    async def main():
        conn = PeerConnection("127.0.0.1", server.port)
        out = []
        for _ in range(fetches):
            asked = []

            def target(n):
                asked.append(n)
                return memoryview(bytearray(n))

            try:
                result = await asyncio.wait_for(conn.fetch_into(("PEERGET", "k"), target, timeout=10), 20)
            except Exception as e:  # noqa: BLE001 - the test looks at the type
                result = e
            out.append((result, asked, conn.closed))
        conn.close()
        return out

    try:
        return asyncio.run(main())
    finally:
        server.close()


def test_a_large_payload_wakes_the_peer_client_a_few_times_and_the_next_reply_still_comes():
    """A 4 MiB block sent in 64 KiB pieces, a pause after each: the fetching node is woken about
    once per PAYLOAD_LOWAT of it (SO_RCVLOWAT), not once per piece (issue 22.5), and the socket
    is back to waking for one byte, so the small reply that follows is read at once."""
    from quilld.cluster.peer_client import PAYLOAD_LOWAT, PeerConnection

    payload = random.Random(5).randbytes(4 << 20)
    big = b"*2\r\n:9\r\n$%d\r\n%b\r\n" % (len(payload), payload)
    server = CannedServer([big, PEER_HIT], step=64 * 1024, pause=0.002)

    async def main():
        conn = PeerConnection("127.0.0.1", server.port)
        await conn.connect()
        wakes = []
        received = conn._received

        def counted(n):  # the real callback, counted
            wakes.append(n)
            received(n)

        conn._received = counted
        got = await asyncio.wait_for(conn.fetch_into(("PEERGET", "k"), lambda n: memoryview(bytearray(n))), 20)
        big_wakes = len(wakes)
        lowat = conn.transport.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)
        small = await asyncio.wait_for(conn.fetch_into(("PEERGET", "k"), lambda n: memoryview(bytearray(n))), 20)
        conn.close()
        return got, big_wakes, lowat, small

    try:
        (crc, view, _), big_wakes, lowat, small = asyncio.run(main())
    finally:
        server.close()
    assert crc == 9 and bytes(view) == payload
    assert big_wakes <= len(payload) // PAYLOAD_LOWAT + 4, big_wakes  # 64 pieces came
    assert lowat == 1
    assert small[0] == 77 and bytes(small[1]) == PEER_PAYLOAD


@pytest.mark.parametrize("reply, expires", [(PEER_HIT, -1), (PEER_HIT_PXAT, 1700000000123)], ids=["plain", "pxat"])
@pytest.mark.parametrize("step", [1, 5, 1 << 20])
def test_peer_fetch_into_receives_into_the_target(step, reply, expires):
    [((crc, view, pxat), asked, closed)] = peer_fetch([reply], step)
    assert crc == 77 and bytes(view) == PEER_PAYLOAD and asked == [len(PEER_PAYLOAD)] and not closed
    assert pxat == expires


def test_peer_fetch_into_nil_and_error_replies():
    from quilld.cluster.peer_client import PeerError
    from quilld.errors import QuillError

    (nil, asked1, closed1), (err, asked2, closed2), (hit, _, _) = peer_fetch(
        [b"$-1\r\n", b"-NOPERM node-to-node command\r\n", PEER_HIT], fetches=3)
    assert nil == (None, None, -1) and asked1 == [] and not closed1
    assert type(err) is QuillError and not isinstance(err, PeerError)
    assert err.message == "NOPERM node-to-node command" and asked2 == [] and closed2
    assert hit[0] == 77 and bytes(hit[1]) == PEER_PAYLOAD  # a new connection after the error


@pytest.mark.parametrize("reply, target_called", [
    (b"$5\r\nhello\r\n", False),  # a bare bulk
    (b"*3\r\n:1\r\n$1\r\nx\r\n$1\r\ny\r\n", True),  # a third element that is not the expiry
    (b"*3\r\n:1\r\n$1\r\nx\r\n+OK\r\n", True),  # ... nor an integer
    (b"*4\r\n:1\r\n$1\r\nx\r\n:1\r\n:2\r\n", False),  # four elements
    (b"*2\r\n$1\r\nx\r\n$1\r\ny\r\n", False),  # no CRC first
    (b"*2\r\n:1\r\n-ERR inside\r\n", False),
    (b"+OK\r\n", False),
    (b"*2\r\n:1\r\n$3\r\nabcXY", True),  # no CRLF after the payload
    (b"*2\r\n:1\r\n$10\r\nabc", True),  # the peer leaves mid-payload
    (b"*2\r\n:1\r\n", False),  # ... or before the payload
])
def test_peer_fetch_into_malformed_replies_are_peer_errors(reply, target_called):
    from quilld.cluster.peer_client import PeerError

    [(err, asked, closed)] = peer_fetch([reply, None])
    assert isinstance(err, PeerError), err
    assert bool(asked) == target_called and closed


def raw_get(replies: list[bytes | None], buffers: list, step: int = 1 << 20, drain_max: int = 1 << 20):
    """One quillclient raw pool: a get_into per buffer; per call its result or exception."""
    from quillclient.config import ClientConfig
    from quillclient.zerocopy import RawPool, get_into

    server = CannedServer(replies, step)
    pool = RawPool(ClientConfig(port=server.port, socket_timeout=10, drain_max=drain_max))
    out = []
    try:
        for buf in buffers:
            try:
                out.append(get_into(pool, "k", memoryview(buf)))
            except Exception as e:  # noqa: BLE001 - the test looks at the type
                out.append(e)
        return out, pool.created
    finally:
        pool.close()
        server.close()


@pytest.mark.parametrize("step", [1, 3, 1 << 20])
def test_get_into_receives_into_the_buffer(step):
    buf = bytearray(len(PEER_PAYLOAD) + 10)
    (n,), created = raw_get([b"$%d\r\n%b\r\n" % (len(PEER_PAYLOAD), PEER_PAYLOAD)], [buf], step)
    assert n == len(PEER_PAYLOAD) and buf[:n] == PEER_PAYLOAD and buf[n:] == bytes(10)


def test_get_into_keeps_the_socket_after_a_miss_an_error_and_a_dropped_block():
    from quillclient.errors import BufferTooSmall, WrongType

    results, created = raw_get([b"$-1\r\n", b"-WRONGTYPE no\r\n", b"$5\r\nhello\r\n", b"$2\r\nhi\r\n"],
                               [bytearray(4)] * 4)
    miss, err, small, hit = results
    assert miss == -1 and type(err) is WrongType and err.message == "no"
    assert type(small) is BufferTooSmall and (small.needed, small.size) == (5, 4)
    assert hit == 2 and created == 1


@pytest.mark.parametrize("reply, match", [
    (b"$3\r\nabcXY", "not followed by CRLF"),
    (b"*1\r\n$1\r\nx\r\n", "expected a bulk reply, got an array"),
    (b":1\r\n", "expected a bulk reply"),
    (b"$-7\r\n", "invalid bulk length"),
    (b"?\r\n", "unexpected reply"),
])
def test_get_into_malformed_replies_are_protocol_errors_and_close_the_socket(reply, match):
    from quillclient.errors import ProtocolError as ClientProtocolError

    (err, hit), created = raw_get([reply, b"$2\r\nhi\r\n"], [bytearray(4), bytearray(4)])
    assert type(err) is ClientProtocolError and re.search(match, str(err)), err
    assert hit == 2 and created == 2  # the broken socket was not reused


def test_raw_send_completes_a_partial_sendmsg_byte_for_byte():
    """Pieces far larger than both socket buffers: sendmsg takes part of them, send() goes on
    from the exact byte where it stopped, in order, until everything is through."""
    from quillclient.zerocopy import RawConnection

    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 * 1024)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    a.settimeout(10)
    b.settimeout(10)
    pieces = [b"*3\r\n$3\r\nSET\r\n", memoryview(os.urandom(3 * 1024 * 1024 + 5)), b"\r\n", memoryview(b"x" * 70001),
              b"tail"]
    want = b"".join(bytes(p) for p in pieces)
    got = bytearray()

    def drain():
        while len(got) < len(want):
            chunk = b.recv(7919)  # small reads: the sender meets a full buffer again and again
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    conn = RawConnection.__new__(RawConnection)  # the socket alone: no server to set up with
    conn.sock = a
    calls = []
    real = a.sendmsg

    class Spy:
        def __getattr__(self, name):
            return getattr(a, name)

        def sendmsg(self, buffers):
            sent = real(buffers)
            calls.append(sent)
            return sent

    conn.sock = Spy()
    try:
        conn.send(pieces)
        reader.join(timeout=20)
    finally:
        a.close()
        b.close()
    assert bytes(got) == want
    assert len(calls) > 1 and sum(calls) == len(want)  # partial sends happened, each resumed exactly


def test_put_sends_set_with_the_callers_bytes_and_reads_its_reply():
    from quillclient.config import ClientConfig
    from quillclient.errors import CommandError
    from quillclient.zerocopy import RawPool, put

    seen = []

    class Recording(CannedServer):
        def _run(self) -> None:
            try:
                conn, _ = self.sock.accept()
                conn.settimeout(10)
                with conn:
                    for reply in self.replies:
                        data = b""
                        while not data.endswith(b"\r\n" + payload + b"\r\n") and not data.endswith(b"PX\r\n$4\r\n1500\r\n"):
                            data += conn.recv(1 << 20)
                        seen.append(data)
                        conn.sendall(reply)
                    conn.recv(1)
            except OSError:
                pass

    payload = bytes(range(256)) * 300
    server = Recording([b"+OK\r\n", b"-ERR no room\r\n"])
    pool = RawPool(ClientConfig(port=server.port, socket_timeout=10))
    try:
        put(pool, "k", memoryview(bytearray(payload)))
        with pytest.raises(CommandError, match="no room"):
            put(pool, b"k2", payload, 1500)
        assert pool.created == 1  # an error reply keeps the socket
    finally:
        pool.close()
        server.close()
    assert seen[0] == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$76800\r\n" + payload + b"\r\n"
    assert seen[1] == b"*5\r\n$3\r\nSET\r\n$2\r\nk2\r\n$76800\r\n" + payload + b"\r\n$2\r\nPX\r\n$4\r\n1500\r\n"


def test_a_payload_attached_to_a_list_of_buffers_is_scattered_over_them():
    """attach([b0, b1, ...]): the first len(b0) payload bytes into b0, the next into b1...; at
    every cut of the stream, and with buffers longer in all than the payload (their tail kept)."""
    payload = bytes(range(256)) * 3 + b"\r\n$-1\r\n"  # CRLFs inside the payload are data
    data = b"*2\r\n$%d\r\n%b\r\n:7\r\n" % (len(payload), payload)
    for sizes in ([len(payload)], [1, 0, 99, len(payload) - 100], [300, 300, 300], [0, len(payload) + 5]):
        for chunks in splits(data):
            parts = [bytearray(b"#" * n) for n in sizes]
            [reply] = read(chunks, 0, lambda r, b: r.attach(parts))
            assert reply[0] is parts and reply[1] == 7
            joined = b"".join(parts)
            assert joined[:len(payload)] == payload and set(joined[len(payload):]) <= {ord("#")}


def test_a_list_of_buffers_receives_straight_from_the_socket():
    """Read as a socket would (get_buffer / buffer_updated): the payload lands in the buffers."""
    payload = bytes(range(200)) * 50
    data = b"$%d\r\n%b\r\n+OK\r\n" % (len(payload), payload)
    for step in (1, 7, 4096, 10**6):
        parts = [bytearray(3000), bytearray(0), bytearray(7000)]
        reader = ReplyReader(0)
        out, pos = [], 0
        while pos < len(data) or not reader.idle:
            ev = reader.next_event()
            if ev is NEED_DATA:
                view = reader.get_buffer(16)
                n = min(len(view), step, len(data) - pos)
                view[:n] = data[pos:pos + n]
                reader.buffer_updated(n)
                pos += n
            elif type(ev) is Bulk:
                reader.attach(parts)
            else:
                out.append(ev)
        assert out[0] is parts and out[1] == b"OK"
        assert bytes(parts[0] + parts[2]) == payload


def test_a_list_of_buffers_too_short_or_read_only_is_refused():
    reader = ReplyReader(0)
    reader.feed(b"$6\r\nabcdef\r\n")
    assert type(reader.next_event()) is Bulk
    with pytest.raises(ValueError, match="the bulk is 6 bytes but the buffer holds 5"):
        reader.attach([bytearray(2), bytearray(3)])
    with pytest.raises(TypeError, match="writable"):
        reader.attach([bytearray(2), b"xyzw"])
    parts = [bytearray(2), bytearray(4)]
    reader.attach(parts)
    assert reader.next_event() is parts and parts == [b"ab", b"cdef"]
