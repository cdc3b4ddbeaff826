"""The sans-IO RESP codec on plain byte strings: every split of the input parses the
same, every limit fails with redis's error text, and replies encode as RESP2/RESP3.

Each parser test runs with each fast path (hiredis, the plain Python build's; the scan of
canonical commands, the compiled build's: quilld/native.py) and with none: a fast path must be
invisible (same commands, same errors), so all three modes are held to one expectation.
"""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quilld.errors import (
    ChecksumMismatch,
    CommandError,
    NoHandle,
    OutOfMemory,
    ProtocolError,
    QuillError,
)
from quilld.model import Pinned
from quilld.protocol import resp
from quilld.protocol.resp import (
    LARGE_BULK,
    MAX_INLINE,
    NULL2,
    NULL3,
    OK,
    UNAUTH_BULK_LEN,
    UNAUTH_MULTIBULK_LEN,
    Attribute,
    BigNumber,
    LargeBulk,
    Push,
    Raw,
    RespParser,
    Status,
    Verbatim,
    encode,
    encode_error,
    split_args,
)
from quillwire.encode import encode_command

MODES = pytest.mark.parametrize("use_hiredis", ["hiredis", "scan", "python"])


def parser_for(mode: str, **kw) -> RespParser:
    """A parser whose fast path is `mode`'s ("python": none, the Python parser reads everything)."""
    return RespParser(use_hiredis=mode != "python", scan=mode == "scan", **kw)


# -- helpers ----------------------------------------------------------------

class Dropped:
    """What a refused large bulk stands for in the arguments (the server uses the error)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Dropped) and other.length == self.length

    def __repr__(self) -> str:
        return f"Dropped({self.length})"


def _arg(a):
    if isinstance(a, Dropped):
        return a
    assert isinstance(a, (bytes, bytearray)), f"argument of unexpected type {type(a).__name__}"
    return bytes(a)


def drain(p: RespParser, out: list, drop: bool = False) -> None:
    """Take every complete command, as the server loop does: parsed() first, then next_command().

    A LargeBulk is attached to a fresh bytearray (or dropped), and its bytes are
    recorded as the argument once the command completes.
    """
    while True:
        out.extend([_arg(a) for a in cmd] for cmd in p.parsed())
        item = p.next_command()
        if item is None:
            return
        if isinstance(item, LargeBulk):
            assert item.index == len(item.args)
            if drop:
                p.drop(Dropped(item.length), item.length)
            else:
                target = bytearray(item.length)
                p.attach(target, memoryview(target))
            continue
        out.append([_arg(a) for a in item])


def feed_like_transport(p: RespParser, data: bytes, out: list, drop: bool) -> None:
    """Deliver `data` as the BufferedProtocol does: into sink_view() while a large bulk
    is being received (sink_advance), otherwise through feed()."""
    data = memoryview(data)
    while data:
        sink = p.sink_view()
        if sink is None:
            p.feed(data)
            data = data[:0]
        else:
            n = min(len(sink), len(data))
            sink[:n] = data[:n]
            p.sink_advance(n)
            data = data[n:]
        drain(p, out, drop)


def parse(chunks, use_hiredis: str, style: str = "feed", drop: bool = False, **kw) -> list:
    p = parser_for(use_hiredis, **kw)
    out: list = []
    for chunk in chunks:
        if style == "feed":
            p.feed(chunk)
            drain(p, out, drop)
        else:
            feed_like_transport(p, chunk, out, drop)
    drain(p, out, drop)
    assert p.pending_bytes() == 0, "bytes left over after complete input"
    return out


def _short(value, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def expect_parse(chunks, expected: list, use_hiredis: str, style: str = "feed", drop: bool = False,
                 where: str = "", **kw) -> None:
    """parse() must give `expected`; on failure say where, briefly (values can be 16 KiB)."""
    try:
        got = parse(chunks, use_hiredis, style, drop, **kw)
    except Exception as e:  # noqa: BLE001 - any exception is the failure being reported
        pytest.fail(f"{where}: parsing raised {e!r}", pytrace=False)
    if got == expected:
        return
    i = next((i for i, (g, e) in enumerate(zip(got, expected)) if g != e), min(len(got), len(expected)))
    pytest.fail(f"{where}: {len(got)} commands parsed, {len(expected)} expected; first difference at "
                f"command {i}: got {_short(got[i:i + 1])}, expected {_short(expected[i:i + 1])}",
                pytrace=False)


def protocol_error(chunks, use_hiredis: str, authenticated: bool = True, **kw) -> ProtocolError:
    """The ProtocolError the input raises (fed in `chunks`); fails if none is raised."""
    p = parser_for(use_hiredis, **kw)
    p.authenticated = authenticated
    with pytest.raises(ProtocolError) as info:
        for chunk in chunks:
            p.feed(chunk)
            drain(p, [])
    return info.value


def pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)] or [b""]


# -- messages parsed whole, in two pieces at every offset, and byte by byte --

BINARY = bytes(range(256))
BIG = (b"0123456789abcdef\r\n$5\r\n*1\r\n" * (LARGE_BULK // 16 + 1))[:LARGE_BULK + 5]
JUST_SMALL = (b"v\r\n" * LARGE_BULK)[:LARGE_BULK - 1]

MESSAGES = {
    "pipeline": (
        encode_command(b"SET", b"k1", b"v\r\nwith\r\ncrlf\r\n")
        + encode_command(b"GET", b"k1")
        + encode_command(b"MSET", b"a", BINARY, b"b", b"", b"c", b"*3\r\n$1\r\n")
        + encode_command(b"ECHO", b"$-1\r\n$12345\r\n*1234567\r\n"),
        [[b"SET", b"k1", b"v\r\nwith\r\ncrlf\r\n"], [b"GET", b"k1"],
         [b"MSET", b"a", BINARY, b"b", b"", b"c", b"*3\r\n$1\r\n"],
         [b"ECHO", b"$-1\r\n$12345\r\n*1234567\r\n"]],
    ),
    "inline": (b"PING\r\nECHO hello\n", [[b"PING"], [b"ECHO", b"hello"]]),
    "inline_quoted": (b'SET k "a b"\r\nSET k2 \'c d\'\r\n',
                      [[b"SET", b"k", b"a b"], [b"SET", b"k2", b"c d"]]),
    "empty_lines": (b"\r\n\n  \r\nPING\r\n\r\n" + encode_command(b"PING") + b"\r\n",
                    [[b"PING"], [b"PING"]]),
    "empty_multibulk": (b"*0\r\n" + encode_command(b"GET", b"k") + b"*0\r\n*-1\r\n" + encode_command(b"PING"),
                        [[b"GET", b"k"], [b"PING"]]),
    "mixed": (encode_command(b"GET", b"k") + b"PING\r\n" + encode_command(b"DEL", b"k") + b"QUIT\r\n",
              [[b"GET", b"k"], [b"PING"], [b"DEL", b"k"], [b"QUIT"]]),
    "just_below_large_bulk": (encode_command(b"SET", b"k", JUST_SMALL) + encode_command(b"GET", b"k"),
                              [[b"SET", b"k", JUST_SMALL], [b"GET", b"k"]]),
    "large_bulk": (encode_command(b"SET", b"k", BIG, b"EX", b"10") + encode_command(b"GET", b"k")
                   + b"PING\r\n",
                   [[b"SET", b"k", BIG, b"EX", b"10"], [b"GET", b"k"], [b"PING"]]),
    "large_bulk_last_arg": (encode_command(b"SET", b"k", BIG) + encode_command(b"SET", b"k2", BIG),
                            [[b"SET", b"k", BIG], [b"SET", b"k2", BIG]]),
}
SMALL_MESSAGES = [name for name, (data, _) in MESSAGES.items() if len(data) < 2000]


@MODES
@pytest.mark.parametrize("name", list(MESSAGES))
def test_whole_input_parses_to_the_expected_commands(name, use_hiredis):
    data, expected = MESSAGES[name]
    expect_parse([data], expected, use_hiredis, where="one feed")


@MODES
@pytest.mark.parametrize("name", [name for name in MESSAGES if name != "large_bulk_last_arg"])
def test_two_feeds_split_at_every_offset_parse_the_same(name, use_hiredis):
    data, expected = MESSAGES[name]
    for cut in range(len(data) + 1):
        expect_parse([data[:cut], data[cut:]], expected, use_hiredis, where=f"split at byte {cut}")


@MODES
@pytest.mark.parametrize("name", ["large_bulk", "large_bulk_last_arg"])
def test_two_receives_around_a_large_bulk_through_the_sink(name, use_hiredis):
    # as the BufferedProtocol receives: payload bytes go into sink_view(), not through feed()
    data, expected = MESSAGES[name]
    cuts = set(range(0, 200)) | set(range(len(data) - 200, len(data) + 1)) | set(range(0, len(data), 97))
    for cut in sorted(cuts):
        expect_parse([data[:cut], data[cut:]], expected, use_hiredis, "sink", where=f"split at byte {cut}")


@MODES
@pytest.mark.parametrize("style", ["feed", "sink"])
@pytest.mark.parametrize("name", ["pipeline", "inline_quoted", "empty_lines", "empty_multibulk", "mixed",
                                  "large_bulk", "large_bulk_last_arg"])
def test_one_byte_feeds_parse_the_same(name, style, use_hiredis):
    data, expected = MESSAGES[name]
    expect_parse(pieces(data, 1), expected, use_hiredis, style, where="1-byte feeds")


@MODES
def test_all_messages_concatenated_split_at_every_small_offset(use_hiredis):
    # the small messages back to back, so each one also follows every other kind
    data = b"".join(MESSAGES[name][0] for name in SMALL_MESSAGES)
    expected = [cmd for name in SMALL_MESSAGES for cmd in MESSAGES[name][1]]
    for cut in range(len(data) + 1):
        expect_parse([data[:cut], data[cut:]], expected, use_hiredis, where=f"split at byte {cut}")


@MODES
def test_three_feeds_around_a_large_bulk(use_hiredis):
    data, expected = MESSAGES["large_bulk"]
    header = data.index(b"$%d\r\n" % len(BIG))
    for a in range(header - 3, header + 12):
        for b in (a + 1, a + 7, len(data) - 40, len(data) - 3):
            expect_parse([data[:a], data[a:b], data[b:]], expected, use_hiredis, where=f"splits at {a}, {b}")


# -- LargeBulk, attach and drop ----------------------------------------------

@MODES
def test_large_bulk_is_announced_with_its_command_so_far(use_hiredis):
    p = parser_for(use_hiredis)
    p.feed(encode_command(b"SET", b"key", BIG, b"NX")[:40])
    assert p.parsed() == []
    item = p.next_command()
    assert isinstance(item, LargeBulk)
    assert (item.args, item.index, item.length) == ([b"SET", b"key"], 2, len(BIG))


@MODES
def test_bulk_shorter_than_large_bulk_is_a_plain_argument(use_hiredis):
    p = parser_for(use_hiredis)
    p.feed(encode_command(b"SET", b"k", JUST_SMALL))
    out: list = []
    drain(p, out)
    assert out == [[b"SET", b"k", JUST_SMALL]]


@MODES
@pytest.mark.parametrize("large_bulk", [64, 1000])
def test_large_bulk_threshold_is_honoured_below_ten_thousand_bytes(large_bulk, use_hiredis):
    # the fast path must send a bulk of >= large_bulk bytes to the Python parser whatever
    # large_bulk is, or the value never lands in the caller's target buffer
    value = b"x" * large_bulk
    p = parser_for(use_hiredis, large_bulk=large_bulk)
    p.feed(encode_command(b"SET", b"k", value))
    first = p.parsed() or [p.next_command()]
    assert isinstance(first[0], LargeBulk), f"a {large_bulk}-byte bulk was parsed as {first!r}"
    assert first[0].length == large_bulk


@MODES
@pytest.mark.parametrize("style", ["feed", "sink"])
def test_dropped_large_bulk_leaves_marker_and_the_rest_parses(style, use_hiredis):
    data = encode_command(b"SET", b"k", BIG, b"EX", b"10") + encode_command(b"GET", b"k") + b"PING\r\n"
    expected = [[b"SET", b"k", Dropped(len(BIG)), b"EX", b"10"], [b"GET", b"k"], [b"PING"]]
    for cut in list(range(0, 60)) + list(range(len(data) - 60, len(data) + 1)) + [len(data) // 2]:
        expect_parse([data[:cut], data[cut:]], expected, use_hiredis, style, drop=True,
                     where=f"split at byte {cut}")
    expect_parse(pieces(data, 4096), expected, use_hiredis, style, drop=True, where="4 KiB feeds")


@MODES
def test_dropped_bulk_larger_than_scratch_buffer(use_hiredis):
    size = 600 * 1024  # more than one scratch buffer's worth
    data = encode_command(b"SET", b"k", b"z" * size) + encode_command(b"PING")
    for style in ("feed", "sink"):
        expect_parse(pieces(data, 100_000), [[b"SET", b"k", Dropped(size)], [b"PING"]], use_hiredis,
                     style, drop=True, where=f"{style}, 100 KB feeds")


@MODES
def test_attach_receives_payload_into_the_target_only(use_hiredis):
    p = parser_for(use_hiredis)
    data = encode_command(b"SET", b"k", BIG) + encode_command(b"PING")
    p.feed(data[:30])
    item = p.next_command()
    assert isinstance(item, LargeBulk)
    target = bytearray(len(BIG))
    p.attach(target, memoryview(target))
    assert p.next_command() is None
    p.feed(data[30:])
    cmd = p.next_command()
    assert cmd[0:2] == [b"SET", b"k"] and cmd[2] is target and target == BIG
    assert p.next_command() == [b"PING"]
    assert p.next_command() is None


# -- limits, with redis's error text -------------------------------------------

def _chunkings(data: bytes) -> list[list[bytes]]:
    return [[data], pieces(data, 4096), [data[:1], data[1:]]]


@MODES
def test_bulk_longer_than_max_bulk_len(use_hiredis):
    for chunks in _chunkings(b"*2\r\n$3\r\nSET\r\n$1001\r\n"):
        err = protocol_error(chunks, use_hiredis, max_bulk_len=1000)
        assert err.wire() == "ERR Protocol error: invalid bulk length"
    # exactly max_bulk_len is accepted
    value = b"v" * 1000
    expect_parse([encode_command(b"SET", value)], [[b"SET", value]], use_hiredis, max_bulk_len=1000,
                 where="bulk of exactly max_bulk_len")


@MODES
def test_bulk_longer_than_default_max_bulk_len(use_hiredis):
    err = protocol_error([b"*2\r\n$3\r\nSET\r\n$%d\r\n" % (512 * 1024 * 1024 + 1)], use_hiredis)
    assert err.wire() == "ERR Protocol error: invalid bulk length"


@MODES
@pytest.mark.parametrize("header", [b"$-1", b"$-2", b"$-5", b"$abc", b"$", b"$+3", b"$3 ", b"$99999999999",
                                    b"$" + b"9" * 5000, b"$-" + b"9" * 5000])
def test_invalid_bulk_length(header, use_hiredis):
    for chunks in _chunkings(b"*2\r\n$3\r\nGET\r\n" + header + b"\r\nfoo\r\n"):
        assert protocol_error(chunks, use_hiredis).wire() == "ERR Protocol error: invalid bulk length"


@MODES
@pytest.mark.parametrize("header", [b"*abc", b"*", b"*+1", b"*1x", b"*%d" % 2**31, b"*" + b"9" * 5000,
                                    b"*-9223372036854775809"], ids=["abc", "empty", "plus", "1x", "int-max+1",
                                                                    "5000-digits", "below-int64"])
def test_invalid_multibulk_length(header, use_hiredis):
    for chunks in _chunkings(header + b"\r\n$4\r\nPING\r\n"):
        assert protocol_error(chunks, use_hiredis).wire() == "ERR Protocol error: invalid multibulk length"


@MODES
@pytest.mark.parametrize("filler", [b"1", b"x"])
def test_multibulk_count_line_without_crlf_is_bounded(filler, use_hiredis):
    data = b"*" + filler * (MAX_INLINE + 1)
    for chunks in _chunkings(data):
        err = protocol_error(chunks, use_hiredis)
        assert err.wire() == "ERR Protocol error: too big mbulk count string"


@MODES
@pytest.mark.parametrize("filler", [b"1", b"x"])
def test_bulk_count_line_without_crlf_is_bounded(filler, use_hiredis):
    data = b"*2\r\n$3\r\nGET\r\n$" + filler * (MAX_INLINE + 1)
    for chunks in _chunkings(data):
        err = protocol_error(chunks, use_hiredis)
        assert err.wire() == "ERR Protocol error: too big bulk count string"


@MODES
def test_inline_request_without_newline_is_bounded(use_hiredis):
    for chunks in _chunkings(b"GET " + b"a" * MAX_INLINE):
        err = protocol_error(chunks, use_hiredis)
        assert err.wire() == "ERR Protocol error: too big inline request"


@MODES
def test_inline_request_of_exactly_max_inline_is_accepted(use_hiredis):
    line = b"ECHO " + b"a" * (MAX_INLINE - 5)
    assert len(line) == MAX_INLINE
    p = parser_for(use_hiredis)
    p.feed(line)
    assert p.next_command() is None
    p.feed(b"\r\n")
    assert p.next_command() == [b"ECHO", b"a" * (MAX_INLINE - 5)]


@MODES
@pytest.mark.parametrize("bad", [b"x", b"+", b":", b"*", b"-"])
def test_non_bulk_inside_a_multibulk(bad, use_hiredis):
    # followed by a complete and a partial command, so the fast path sees more than the bad one
    data = (b"*2\r\n$3\r\nGET\r\n" + bad + b"k\r\n" + encode_command(b"PING")
            + encode_command(b"GET", b"k")[:9])
    for chunks in _chunkings(data):
        err = protocol_error(chunks, use_hiredis)
        assert err.wire() == f"ERR Protocol error: expected '$', got '{bad.decode()}'"


@MODES
@pytest.mark.parametrize("line", [b'SET k "a b\r\n', b"SET k 'a\r\n", b'SET k "a"b\r\n', b"GET 'k'x\r\n"])
def test_unbalanced_quotes_inline(line, use_hiredis):
    for chunks in _chunkings(encode_command(b"PING") + line):
        err = protocol_error(chunks, use_hiredis)
        assert err.wire() == "ERR Protocol error: unbalanced quotes in request"


@MODES
def test_unauthenticated_multibulk_length(use_hiredis):
    data = b"*%d\r\n" % (UNAUTH_MULTIBULK_LEN + 1)
    err = protocol_error([data], use_hiredis, authenticated=False)
    assert err.wire() == "ERR Protocol error: unauthenticated multibulk length"
    # ten arguments are fine before AUTH
    cmd = [b"a"] * UNAUTH_MULTIBULK_LEN
    p = parser_for(use_hiredis)
    p.authenticated = False
    p.feed(encode_command(*cmd))
    out: list = []
    drain(p, out)
    assert out == [cmd]


@MODES
def test_unauthenticated_bulk_length(use_hiredis):
    data = b"*2\r\n$4\r\nAUTH\r\n$%d\r\n" % (UNAUTH_BULK_LEN + 1)
    err = protocol_error([data], use_hiredis, authenticated=False)
    assert err.wire() == "ERR Protocol error: unauthenticated bulk length"
    p = parser_for(use_hiredis, large_bulk=UNAUTH_BULK_LEN + 1)
    p.authenticated = False
    p.feed(encode_command(b"AUTH", b"p" * UNAUTH_BULK_LEN))
    assert p.next_command() == [b"AUTH", b"p" * UNAUTH_BULK_LEN]


@MODES
def test_limits_are_lifted_after_authentication(use_hiredis):
    p = parser_for(use_hiredis)
    p.authenticated = False
    p.feed(encode_command(b"AUTH", b"pw"))
    assert (p.parsed() or [p.next_command()]) == [[b"AUTH", b"pw"]]
    p.authenticated = True
    cmd = [b"MSET"] + [b"x"] * 20
    p.feed(encode_command(*cmd))
    out: list = []
    drain(p, out)
    assert out == [cmd]


@MODES
@pytest.mark.parametrize("unit", [b"\r\n", b"*0\r\n", b"*-1\r\n", b"\n"])
def test_many_skipped_empty_commands_do_not_exhaust_the_stack(unit, use_hiredis):
    # redis skips empty lines and empty multibulks in a loop; a pipeline of thousands is legal
    data = unit * 5000 + encode_command(b"PING")
    expect_parse([data], [[b"PING"]], use_hiredis, where=f"5000 x {unit!r}")


@MODES
@pytest.mark.parametrize("kind", [b">", b"~", b"%", b"|", b"+", b":", b"_", b"#", b",", b"="])
def test_resp3_type_bytes_after_a_command_are_inline_text(kind, use_hiredis):
    # redis reads a request that does not start with '*' as an inline command, even when it
    # follows a multibulk in the same packet; the fast path must not accept RESP3 aggregates
    data = encode_command(b"PING") + kind + b"1\r\n$4\r\nECHO\r\n"
    expect_parse([data], [[b"PING"], [kind + b"1"], [b"$4"], [b"ECHO"]], use_hiredis, where=repr(data))


@MODES
@pytest.mark.parametrize("block, cut", [
    (b"SET k " + b"a" * 100 + b"\r\n", 2),  # receives end inside an inline command
    (encode_command(b"SET", b"k", b"v" * 2000), 3),  # ... inside a multibulk count line
    (encode_command(b"SET", b"k", b"v" * 2000), 20),  # ... inside an argument
], ids=["inline", "count_line", "argument"])
def test_receive_buffer_does_not_grow_with_traffic(block, cut, use_hiredis):
    # the parser is never idle, yet what it keeps must stay bounded by a few commands
    # (or the compaction threshold), not grow with everything the connection received
    per_feed = max(1, 2000 // len(block))
    block *= per_feed
    step = block[cut:] + block[:cut]
    rounds = 768 * 1024 // len(step)
    p = parser_for(use_hiredis)
    p.feed(block[:cut])
    n = 0
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(rounds):
            p.feed(step)
            n += len(p.parsed())
            while p.next_command() is not None:
                n += 1
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert n == rounds * per_feed
    assert grown < 512 * 1024, f"the parser holds {grown} more bytes after 768 KiB of traffic"


@pytest.mark.parametrize("data", [
    b"*1\r\n$04\r\nPING\r\n", b"*01\r\n$4\r\nPING\r\n", b"*-0\r\n", b"*1\r\n$-0\r\n\r\n",
], ids=["bulk_leading_zero", "count_leading_zero", "count_minus_zero", "bulk_minus_zero"])
@MODES
def test_lengths_are_as_strict_as_redis_string2ll(data, use_hiredis):
    # redis's string2ll refuses leading zeros and "-0"; so does the parser's _parse_len contract
    kind = "multibulk" if data.startswith((b"*0", b"*-")) else "bulk"
    assert protocol_error([data], use_hiredis).wire() == f"ERR Protocol error: invalid {kind} length"


@pytest.mark.parametrize("mode", ["hiredis", "scan"])
def test_fast_path_parses_a_plain_pipeline(mode):
    # each fast path must actually take ordinary commands (SET/GET with plain values);
    # otherwise every byte goes through the slower Python parser
    cmds = [[b"SET", b"key:%d" % i, b"value %d" % i] for i in range(50)] + [[b"GET", b"key:1"]]
    p = parser_for(mode)
    p.feed(b"".join(encode_command(*c) for c in cmds))
    assert p.parsed() == cmds
    assert p.next_command() is None


# -- hypothesis: random commands, random splits --------------------------------

commands_st = st.lists(st.lists(st.binary(max_size=300), min_size=1, max_size=6), min_size=1, max_size=8)


@MODES
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cmds=commands_st, data=st.data())
def test_random_commands_round_trip_through_random_splits(cmds, data, use_hiredis):
    wire = b"".join(encode_command(*c) for c in cmds)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=6), label="cuts"))
    chunks = [wire[a:b] for a, b in zip([0] + cuts, cuts + [len(wire)])]
    expect_parse(chunks, cmds, use_hiredis, where=f"cuts at {cuts}")


@settings(max_examples=40, deadline=None)
@given(args=st.lists(st.one_of(st.binary(max_size=50), st.text(max_size=20),
                               st.integers(-10**12, 10**12)), min_size=1, max_size=6))
def test_encode_command_accepts_str_and_int(args):
    expected = [a if isinstance(a, bytes) else str(a).encode() if isinstance(a, int) else a.encode()
                for a in args]
    expect_parse([encode_command(*args)], [expected], use_hiredis=False, where=repr(args))


# -- split_args (redis sdssplitargs) ------------------------------------------

@pytest.mark.parametrize("line, expected", [
    (b"", []),
    (b"   \t ", []),
    (b"GET k", [b"GET", b"k"]),
    (b"  SET   k   v  ", [b"SET", b"k", b"v"]),
    (b'SET k "a b"', [b"SET", b"k", b"a b"]),
    (b'SET k ""', [b"SET", b"k", b""]),
    (b'SET "\\x41\\x42" "\\x4a"', [b"SET", b"AB", b"J"]),
    (b'SET k "\\x4"', [b"SET", b"k", b"x4"]),  # not two hex digits: the escaped char itself
    (b'SET k "\\xZZ"', [b"SET", b"k", b"xZZ"]),
    (b'SET k "l1\\nl2\\r\\t\\b\\a"', [b"SET", b"k", b"l1\nl2\r\t\b\a"]),
    (b'SET k "q\\"q"', [b"SET", b"k", b'q"q']),
    (b'SET k "back\\\\slash"', [b"SET", b"k", b"back\\slash"]),
    (b"SET k 'it\\'s'", [b"SET", b"k", b"it's"]),
    (b"SET k 'no \\n escape'", [b"SET", b"k", b"no \\n escape"]),
    (b"SET k 'a\"b'", [b"SET", b"k", b'a"b']),
    (b'SET k "x\'y"', [b"SET", b"k", b"x'y"]),
    (b'a"b c"', [b"ab c"]),  # a quote opens mid-token, as in redis
    (b"\\x41", [b"\\x41"]),  # escapes only inside double quotes
    (b'"a"\t"b"', [b"a", b"b"]),
    (b"auth\x0b0", [b"auth\x0b0"]),  # \v and \f are blanks between arguments, not inside one
    (b"\x0b\x0cGET\x0c k\x0bv", [b"GET\x0c", b"k\x0bv"]),
    (b'"a"\x0b"b"', [b"a", b"b"]),  # ...and may follow a closing quote
])
def test_split_args(line, expected):
    assert split_args(line) == expected


@pytest.mark.parametrize("line", [b'"abc', b"'abc", b'"a"b', b"'a'b", b'GET "k"x y', b'"\\"', b"'\\'"])
def test_split_args_unbalanced(line):
    assert split_args(line) is None


# -- replies -----------------------------------------------------------------

def enc(value, resp3: bool) -> bytes:
    out: list = []
    encode(value, resp3, out)
    return b"".join(bytes(c) for c in out)


@pytest.mark.parametrize("value, resp2, resp3", [
    (b"abc", b"$3\r\nabc\r\n", b"$3\r\nabc\r\n"),
    (bytearray(b"a\r\nb"), b"$4\r\na\r\nb\r\n", b"$4\r\na\r\nb\r\n"),
    (b"", b"$0\r\n\r\n", b"$0\r\n\r\n"),
    ("héllo", "$6\r\nhéllo\r\n".encode(), "$6\r\nhéllo\r\n".encode()),
    (None, b"$-1\r\n", b"_\r\n"),
    (OK, b"+OK\r\n", b"+OK\r\n"),
    (Status(b"QUEUED"), b"+QUEUED\r\n", b"+QUEUED\r\n"),
    (0, b":0\r\n", b":0\r\n"),
    (-42, b":-42\r\n", b":-42\r\n"),
    (2**63 - 1, b":9223372036854775807\r\n", b":9223372036854775807\r\n"),
    (True, b":1\r\n", b"#t\r\n"),
    (False, b":0\r\n", b"#f\r\n"),
    (1.5, b"$3\r\n1.5\r\n", b",1.5\r\n"),
    (float("inf"), b"$3\r\ninf\r\n", b",inf\r\n"),
    (float("-inf"), b"$4\r\n-inf\r\n", b",-inf\r\n"),
    (float("nan"), b"$3\r\nnan\r\n", b",nan\r\n"),
    ({b"a": 1, b"b": None}, b"*4\r\n$1\r\na\r\n:1\r\n$1\r\nb\r\n$-1\r\n",
     b"%2\r\n$1\r\na\r\n:1\r\n$1\r\nb\r\n_\r\n"),
    ({}, b"*0\r\n", b"%0\r\n"),
    ({b"x"}, b"*1\r\n$1\r\nx\r\n", b"~1\r\n$1\r\nx\r\n"),
    (frozenset(), b"*0\r\n", b"~0\r\n"),
    (Verbatim(b"# Server\r\n"), b"$10\r\n# Server\r\n\r\n", b"=14\r\ntxt:# Server\r\n\r\n"),
    ([], b"*0\r\n", b"*0\r\n"),
    ([b"a", [1, [None, OK]], (True,)],
     b"*3\r\n$1\r\na\r\n*2\r\n:1\r\n*2\r\n$-1\r\n+OK\r\n*1\r\n:1\r\n",
     b"*3\r\n$1\r\na\r\n*2\r\n:1\r\n*2\r\n_\r\n+OK\r\n*1\r\n#t\r\n"),
    (Raw(b"+already\r\n"), b"+already\r\n", b"+already\r\n"),
    (BigNumber(b"1234567999999999999999999999999999999"), b"$37\r\n1234567999999999999999999999999999999\r\n",
     b"(1234567999999999999999999999999999999\r\n"),
    (Attribute({b"key-popularity": [b"key:123", 90]}), b"",
     b"|1\r\n$14\r\nkey-popularity\r\n*2\r\n$7\r\nkey:123\r\n:90\r\n"),
    (Push((b"server-cpu-usage", 42)), b"*2\r\n$16\r\nserver-cpu-usage\r\n:42\r\n",
     b">2\r\n$16\r\nserver-cpu-usage\r\n:42\r\n"),
])
def test_encode_resp2_and_resp3(value, resp2, resp3):
    assert enc(value, False) == resp2
    assert enc(value, True) == resp3


def test_null_constants():
    assert (NULL2, NULL3) == (b"$-1\r\n", b"_\r\n")


@pytest.mark.parametrize("resp3", [False, True])
@pytest.mark.parametrize("err, wire", [
    (CommandError("unknown command 'foo'"), b"-ERR unknown command 'foo'\r\n"),
    (OutOfMemory("no room"), b"-OOM no room\r\n"),
    (NoHandle("gone"), b"-NOHANDLE gone\r\n"),
    (ChecksumMismatch("bad\r\ncrc\nhere"), b"-CHECKSUM bad  crc here\r\n"),
    (CommandError("Unsupported option \r\n"), b"-ERR Unsupported option \r\n"),  # trailing ones trimmed
    (CommandError("option '\r\n\n'"), b"-ERR option '   '\r\n"),
    (ProtocolError("invalid bulk length"), b"-ERR Protocol error: invalid bulk length\r\n"),
    (QuillError("plain"), b"-ERR plain\r\n"),
])
def test_errors_encode_with_their_prefix(err, wire, resp3):
    assert encode_error(err) == wire
    assert enc(err, resp3) == wire
    assert enc([err], resp3) == b"*1\r\n" + wire


@pytest.mark.parametrize("resp3", [False, True])
def test_block_reply_is_header_view_crlf(resp3):
    backing = bytearray(b"0123456789")
    view = memoryview(backing)[2:7]
    reply = Pinned(view, lambda: None)
    out: list = []
    encode(reply, resp3, out)
    assert len(out) == 3
    assert out[0] == b"$5\r\n"
    assert out[1] is view  # the pinned memory itself, never a copy
    assert out[2] == b"\r\n"


def test_encode_refuses_unknown_types():
    with pytest.raises(TypeError):
        enc(object(), False)


# -- issue 11: numbers of any length, bulks that claim more than they send, bytes in errors ----

@pytest.mark.parametrize("raw, value", [
    (b"0", 0), (b"-1", -1), (b"9223372036854775807", 2**63 - 1), (b"-9223372036854775808", -2**63),
    (b"9223372036854775808", None), (b"-9223372036854775809", None), (b"99999999999999999999", None),
    (b"0" * 21, None), (b"9" * 4301, None), (b"9" * 100_000, None), (b"-" + b"9" * 5000, None), (b"", None),
    (b"-", None), (b"-0", None), (b"01", None), (b"+1", None), (b"1 ", None), (b"\xd9\xa1", None),
], ids=lambda v: repr(v)[:24])
def test_parse_len_is_string2ll_and_never_raises(raw, value):
    from quilld.protocol.resp import _parse_len
    assert _parse_len(raw) == value
    assert _parse_len(bytearray(raw)) == value


def parse_accumulating(chunks, use_hiredis: str, **kw) -> tuple[list, RespParser]:
    """Parse with every LargeBulk answered by accumulate(), as the server answers a large
    argument that has no target of its own (anything but a value)."""
    p = parser_for(use_hiredis, **kw)
    out: list = []

    def take():
        while True:
            out.extend(list(c) for c in p.parsed())
            item = p.next_command()
            if item is None:
                return
            if isinstance(item, LargeBulk):
                p.accumulate()
                continue
            out.append(item)

    for chunk in chunks:
        p.feed(chunk)
        take()
    return out, p


@MODES
def test_accumulated_large_bulk_is_an_ordinary_argument_at_any_split(use_hiredis):
    big = bytes(range(256)) * 80 + b"\r\n$3\r\n*1"  # 20 KiB+: a large bulk
    data = encode_command(b"ECHO", big) + encode_command(b"PING") + encode_command(b"MSET", b"k" * 17000, b"v")
    expected = [[b"ECHO", big], [b"PING"], [b"MSET", b"k" * 17000, b"v"]]
    for step in (1, 7, 4096, 16384, len(data)):
        got, p = parse_accumulating(pieces(data, step), use_hiredis)
        assert got == expected, step
        assert all(type(a) is bytes for c in got for a in c)
        assert p.query_bytes() == 0 and p.pending_bytes() == 0


@MODES
def test_accumulating_commits_memory_only_as_bytes_arrive(use_hiredis):
    p = parser_for(use_hiredis)
    p.feed(b"*2\r\n$4\r\nECHO\r\n$536870912\r\n")
    item = p.next_command()
    assert isinstance(item, LargeBulk) and item.length == 536870912
    tracemalloc.start()
    try:
        p.accumulate()
        assert p.next_command() is None
        assert tracemalloc.get_traced_memory()[0] < 64 * 1024  # the header alone: nothing allocated
        for _ in range(4):
            p.feed(b"x" * 65536)
            assert p.next_command() is None
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert 4 * 65536 <= held < 4 * 65536 * 2 + 64 * 1024  # what arrived (the buffer's slack at most)
    assert 4 * 65536 <= p.query_bytes() < 4 * 65536 + 1024


def test_query_bytes_counts_what_an_unfinished_command_holds():
    p = RespParser(use_hiredis=False)
    p.feed(b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\nhel")
    assert p.next_command() is None
    held = p.query_bytes()
    assert held >= len(b"SET") + len(b"k") + len(b"$5\r\nhel")
    p.feed(b"lo\r\n$2\r\nEX\r\n")
    assert p.next_command() is None
    assert p.query_bytes() > held + 4  # the arguments parsed so far still count
    p.feed(b"$2\r\n10\r\n")
    assert p.next_command() == [b"SET", b"k", b"hello", b"EX", b"10"]
    assert p.query_bytes() == 0


@MODES
@pytest.mark.parametrize("data, got", [
    (b"*2\r\n*1\r\n$4\r\nPING\r\n", "*"), (b"*2\r\n:5\r\n", ":"), (b"*3\r\n$3\r\nGET\r\n*2\r\n", "*"),
    (b"*2\r\n$4\r\nECHO\r\n_\r\n", "_"),
], ids=["nested-array", "integer", "nested-after-bulk", "null"])
def test_a_non_bulk_element_is_refused_before_the_command_completes(data, got, use_hiredis):
    """redis refuses the command as soon as it sees the element; the fast path must not wait
    for a nested array to complete (nor for more bytes that never come)."""
    for prefix in (b"", encode_command(b"PING")):
        err = protocol_error([prefix + data], use_hiredis)
        assert err.wire() == f"ERR Protocol error: expected '$', got '{got}'"


@pytest.mark.parametrize("raw, quoted", [
    (b"plain", b"plain"), (b"\xff\xfe", b"\xff\xfe"), (b"caf\xc3\xa9", b"caf\xc3\xa9"),
    (b"ab\x00cd", b"ab"), (b"\xed\xb3\xbf", b"\xed\xb3\xbf"), (bytes(range(1, 256)), bytes(range(1, 256))),
], ids=["ascii", "not-utf8", "utf8", "nul", "utf8-surrogate", "every-byte"])
def test_error_text_quotes_client_bytes_raw(raw, quoted):
    from quilld.errors import echo
    assert encode_error(CommandError(f"unknown '{echo(raw)}'")) == (
        b"-ERR unknown '" + quoted.replace(b"\r", b" ").replace(b"\n", b" ") + b"'\r\n")
    assert echo(b"x" * 300 + raw, 128) == "x" * 128


# -- lines found as redis finds them: strchr() for the CR (or LF), which stops at a NUL --------

@MODES
@pytest.mark.parametrize("data, expected", [
    (b"*1\r\n$4\rxPING\r\n", [[b"PING"]]),  # the byte after the CR is skipped unread
    (b"*1\rx$4\r\nPING\r\n", [[b"PING"]]),
    (b"*1\r\n$1\r\x000\r\n", [[b"0"]]),
    (b"*1\x00\r\n$4\r\nPING\r\n", []),  # a NUL before the CR: no line yet, ever
    (b"*1\r\n$4\x00\r\nPING\r\n", []),
    (b"*1\r\n\x00abc\r\n", []),
    (b"PI\x00NG\r\nPING\r\n", []),
    (b"ECHO a\x00b\r\n", []),
    (b"*1\r", []),  # the CR is the last byte: wait for the one after it
    (b"*1\r\n$4\r", []),
], ids=["bulk-cr-x", "count-cr-x", "bulk-cr-nul", "nul-in-count", "nul-in-bulk-len", "nul-first",
        "nul-inline", "nul-inline-arg", "count-cr-last", "bulk-cr-last"])
def test_header_and_inline_lines_end_where_redis_ends_them(data, expected, use_hiredis):
    for chunks in _chunkings(data):
        p = parser_for(use_hiredis)
        out: list = []
        for chunk in chunks:
            p.feed(chunk)
            drain(p, out)
        assert out == expected, chunks


@MODES
@pytest.mark.parametrize("data, error", [
    (b"*1\x00" + b"1" * MAX_INLINE, "too big mbulk count string"),
    (b"*1\r\n$1\x00" + b"1" * MAX_INLINE, "too big bulk count string"),
    (b"PING\x00" + b"\r\n" * (MAX_INLINE // 2 + 1), "too big inline request"),
    (b"*1\r\n\xab\r\n", "expected '$', got '\udcab'"),  # the byte itself, raw on the wire
], ids=["count", "bulk-len", "inline", "raw-byte"])
def test_a_line_that_never_ends_for_a_nul_is_refused_past_64k(data, error, use_hiredis):
    err = protocol_error([data], use_hiredis)
    assert err.wire() == "ERR Protocol error: " + error
    if error.endswith("'\udcab'"):
        assert encode_error(err) == b"-ERR Protocol error: expected '$', got '\xab'\r\n"


@MODES
@pytest.mark.parametrize("partial, error", [
    (b"*2\r\n$4\r\nECHO\r\n$2\n0\r\x00", "invalid bulk length"),  # its line ends at the CR for redis
    (b"*2\r\n$4\r\nECHO\r\n$2\rx", None),  # `$2` then a skipped byte: two more bytes of payload awaited
    (b"*2\r\n$4\r\nECHO\r\n$2\r\x00ab\r\n", [b"ECHO", b"ab"]),
    (b"*2\rx$4\r\nECHO\r\n$1\r\na\r\n", [b"ECHO", b"a"]),
], ids=["bad-len-before-lf", "cr-then-byte", "cr-then-nul", "count-cr-x"])
def test_a_command_cut_by_a_read_is_judged_as_redis_judges_it(partial, error, use_hiredis):
    """A read that ends inside a command: the fast path must not wait for a CRLF where redis has
    already read the line (up to its first CR)."""
    p = parser_for(use_hiredis)
    out: list = []
    if isinstance(error, str):
        with pytest.raises(ProtocolError, match=error):
            p.feed(encode_command(b"PING") + partial)
            drain(p, out)
        return
    p.feed(encode_command(b"PING") + partial)
    drain(p, out)
    assert out == [[b"PING"]] + ([error] if error else [])


# -- framing in one place (issue 18.13) ------------------------------------------------------------

@pytest.mark.parametrize("resp3", [False, True])
@pytest.mark.parametrize("n", [0, 1, 5, 1023, 1024, 5000])
def test_the_codecs_framing_pieces_are_what_encode_writes(resp3, n):
    """ROUTE and COMMAND DOCS build their replies from these; encode() uses the same."""
    def enc(value):
        out = []
        resp.encode(value, resp3, out)
        return b"".join(out)

    items = list(range(n))
    assert enc(items) == resp.array_header(n) + b"".join(map(resp.integer, items))
    mapping = {i: i for i in items}
    assert enc(mapping) == resp.map_header(n, resp3) + b"".join(resp.integer(i) * 2 for i in items)
    assert enc(resp.OrderedSet(items)) == resp.set_header(n, resp3) + b"".join(map(resp.integer, items))
    assert enc(-n) == resp.integer(-n) == b":%d\r\n" % -n
    assert enc(None) == resp.NULL[resp3]
    for v in (n / 7, float("inf"), -float("inf"), float("nan")):
        assert enc(v) == resp.double(v, resp3)
    assert enc(b"x" * n) == resp.bulk(b"x" * n)
    cache = resp.BulkCache(size=2)
    assert cache("e%d" % n) == resp.bulk(b"e%d" % n) and cache("e%d" % n) is cache("e%d" % n)


def test_no_handler_writes_its_own_framing():
    """RESP framing lives in the codec: a handler that writes replies straight to bytes takes
    its headers and scalars from resp.py, it does not format `*%d`, `%%%d`, `~%d` or `$%d`."""
    import re
    from pathlib import Path

    commands = Path(resp.__file__).parent / "commands"
    framing = re.compile(rb'b"(\*|%%|~|\$|,|:)(%d|[0-9]+)\\r\\n')
    found = {p.name: framing.findall(p.read_bytes()) for p in commands.rglob("*.py")}
    assert not {name: hits for name, hits in found.items() if hits}
