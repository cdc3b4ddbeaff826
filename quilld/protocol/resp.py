"""Sans-IO RESP codec of the server: bytes in, commands out; reply values in, bytes out.

No sockets, no asyncio; its tests are plain functions on byte strings. The
other direction, commands out and replies in, is quillwire's (`wire/`):
`quillwire.encode.encode_command` / `pack_command` encode commands and
`quillwire.reply.ReplyReader` reads replies, for peer transfer, the client
library and the tests alike.

Parsing: `feed(data)` then call `next_command()` until it returns NEED_DATA.
It returns either a command (a list of `bytes` arguments) or a `LargeBulk`
when a bulk argument of at least `large_bulk` bytes is announced. The caller
answers a `LargeBulk` with `attach(target)`, a writable buffer of exactly that
length (an arena slot); the payload then lands in `target` with no
intermediate `bytes`. While a large bulk is being received, `sink_view()`
exposes the unfilled part of the target so a `BufferedProtocol` can receive
into it directly, and `sink_advance(n)` records what arrived. A large bulk
that has no target of its own is answered with `accumulate()`: it is then
received in the parser's buffer, which grows only as its bytes arrive (a
header alone commits no memory), and becomes an ordinary `bytes` argument.
`query_bytes()` tells how much a half-received command holds in memory, for
the caller's query-buffer limit.
"""

from __future__ import annotations

import re
from itertools import chain
from typing import Any, Callable

from quilld.errors import ProtocolError, QuillError
from quilld.model import Pinned
from quilld.protocol.replies import (  # re-exported: handlers take them from here
    OK,
    PONG,
    Attribute,
    BigNumber,
    OrderedSet,
    Push,
    Raw,
    Status,
    Verbatim,
    WithFds,
)

try:  # hiredis parses runs of small commands ~15x faster than Python; optional
    import hiredis
except ImportError:  # pragma: no cover - hiredis is a declared dependency
    hiredis = None  # type: ignore[assignment]

# Compiled with mypyc (quilld/native.py), this module parses runs of small commands itself
# (`RespParser._feed_scan`), faster than hiredis and the checks around it; as plain Python
# it hands them to hiredis.
COMPILED = not __file__.endswith(".py")

# Limits, with redis-server 7's precedent (src/server.h, src/networking.c).
MAX_INLINE = 64 * 1024  # PROTO_INLINE_MAX_SIZE: inline request or a header line without CRLF
MAX_MULTIBULK_LEN = 2**31 - 1  # INT_MAX, as redis; arguments only take memory as they arrive
MAX_INT_CHARS = 20  # LONG_STR_SIZE - 1: string2ll refuses longer numbers (and int() would refuse 4301+ digits)
CLIENT_QUERY_BUFFER_LIMIT = 1024 * 1024 * 1024  # client-query-buffer-limit default: see query_bytes()
ARG_OVERHEAD = 48  # what a parsed argument costs beyond its bytes (bytes object header, list slot)
MAX_BULK_LEN = 512 * 1024 * 1024  # proto-max-bulk-len default; also the largest block
UNAUTH_MULTIBULK_LEN = 10  # before AUTH, redis refuses larger commands
UNAUTH_BULK_LEN = 16384
LARGE_BULK = 16 * 1024  # bulks at least this long are received straight into a target buffer

NEED_DATA = None  # next_command() result while no complete command is buffered
_COMPACT_AT = 256 * 1024  # consumed bytes after which the receive buffer is compacted
_SCRATCH = 256 * 1024  # receive size while dropping a refused payload
_SKIPPED = object()  # _next() skipped an empty line or an empty multibulk

# What hiredis must not see, because redis would answer it differently or because the
# bytes must go elsewhere: a bulk long enough to be a large bulk or over the limit (the
# digit count is set per parser), a null bulk, a huge or negative multibulk count, a
# length with a leading zero, or a RESP reply type where a command or an argument should
# start (hiredis would accept `+OK` as an argument or `~1` as a command; redis refuses
# both). A match, even inside a value (a false alarm costs speed, never correctness),
# sends the bytes to the Python parser, which answers them exactly as redis does.
# Three patterns, each with a literal first byte, scan several times faster than one
# alternation.
_BULK_TEMPLATE = rb"\$(?:\d{%d}|-|0\d)"
_COUNT = re.compile(rb"\*(?:\d{7}|-|0\d)")
_REPLY_TYPE = re.compile(rb"\r\n[+~%|>=]")


def _suspect_pattern(large_bulk: int, max_bulk_len: int):
    """A function telling whether bytes hold anything the fast path must not parse."""
    digits = len(str(min(large_bulk, max_bulk_len + 1)))
    bulk = re.compile(_BULK_TEMPLATE % digits).search
    count, reply_type = _COUNT.search, _REPLY_TYPE.search

    def suspect(data) -> bool:
        return bool(bulk(data) or count(data) or reply_type(data))

    return suspect


_NO_LINE = -1  # _line_end(): no end of line yet
_CR_LAST = -2  # _line_end(): the CR is the last byte received: its line ends once one more arrives


def _line_end(buf: bytearray, pos: int, end: int) -> int:
    """Where the header line at `pos` ends, found as redis finds it (strchr(p, '\\r')): its first
    CR, which must be followed by one more byte (skipped unread, as if it were the LF); no line
    while a NUL byte comes first, since strchr() stops there. Negative: no line yet."""
    cr = buf.find(b"\r", pos, end)
    if cr < 0 or buf.find(0, pos, cr) >= 0:
        return _NO_LINE
    return cr if cr + 1 < end else _CR_LAST


def _bulks_so_far(partial: bytes) -> bool:
    """Whether hiredis may go on holding this partial multibulk command: every header line so
    far reads the same to redis (`*<n>` or `$<len>`, then CRLF), every element is a bulk, and
    a header still arriving holds no NUL and no CR but a last one (redis judges those at once,
    hiredis would wait for a CRLF).

    Run only on the command a read ended in the middle of, so it stays off the common path.
    """
    pos, end = 0, len(partial)
    while pos < end:
        if pos and partial[pos] != 36:  # '$' (the first line is the count, '*')
            return False
        cr = partial.find(b"\r", pos)
        if cr < 0 or cr + 1 >= end:  # a header still arriving
            return partial.find(0, pos) < 0
        n = _parse_len(partial[pos + 1:cr])
        if partial[cr + 1] != 10 or n is None or n < 0:
            return False
        pos = cr + 2 + (n + 2 if pos else 0)
    return True


class LargeBulk:
    """A bulk argument of `length` bytes is coming for command `args` (argument `index`)."""

    __slots__ = ("args", "index", "length")

    def __init__(self, args: list, index: int, length: int) -> None:
        self.args = args
        self.index = index
        self.length = length


def shown_arg(a: Any) -> bytes:
    """An argument as MONITOR and SLOWLOG show it. A payload received straight into the
    arena (a SET value, a PUT2PHASE DATA chunk: see LargeBulk) is not copied back out:
    it is shown as `(N bytes received into the arena)`."""
    if isinstance(a, (bytes, bytearray, memoryview)):
        return bytes(a)
    return b"(%d bytes received into the arena)" % len(a)


_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1


def _parse_len(raw: bytes | bytearray) -> int | None:
    """Strict signed 64-bit decimal as redis's string2ll: optional '-', digits, no leading
    zero, no '+', at most 20 characters, within the 64-bit range; None otherwise."""
    if len(raw) > MAX_INT_CHARS:
        return None
    if raw.isdigit():
        if raw[:1] == b"0" and len(raw) != 1:
            return None
        value = int(raw)
    elif raw[:1] == b"-" and raw[1:].isdigit() and raw[1:2] != b"0":
        value = -int(raw[1:])
    else:
        return None
    return value if _INT64_MIN <= value <= _INT64_MAX else None


class RespParser:
    """Incremental parser of client commands (multibulk and inline)."""

    def __init__(self, max_bulk_len: int = MAX_BULK_LEN, large_bulk: int = LARGE_BULK,
                 use_hiredis: bool = True, scan: bool | None = None) -> None:
        """`use_hiredis`: a fast path for runs of small commands (False: the Python parser reads
        everything); `scan`: that fast path is `_feed_scan` rather than hiredis (default: when
        this module is compiled, or hiredis is missing)."""
        self.max_bulk_len = max_bulk_len
        self.large_bulk = large_bulk
        self.authenticated = True  # the shell clears this while AUTH is required
        self._buf = bytearray()
        self._pos = 0
        self._args: list | None = None  # command being assembled
        self._remaining = 0  # bulks still expected for it
        self.receiving = False  # a large bulk is arriving (into _sink, or dropped if _sink is None); read-only
        self._sink: memoryview | None = None
        self._sink_obj: Any = None  # what stands for the bulk in the arguments
        self._sink_len = 0
        self._sink_filled = 0
        self._skip_crlf = False  # the CRLF after a large bulk is still to come
        self._scratch: memoryview | None = None
        self._announced = 0  # length of the last LargeBulk announced
        self._plain = -1  # length of a large bulk being received into _buf (accumulate()), or -1
        self._args_bytes = 0  # what the arguments of the command being assembled hold
        # Fast path, while the Python parser is idle: the scan of canonical commands
        # (_feed_scan), or hiredis when nothing suspect arrives (_feed_hiredis).
        if scan is None:
            scan = COMPILED or hiredis is None
        self._scan = use_hiredis and scan
        self._use_hiredis = use_hiredis and not scan and hiredis is not None
        self._small_max = min(large_bulk - 1, max_bulk_len)  # the longest bulk the scan takes
        self._suspect = _suspect_pattern(large_bulk, max_bulk_len)
        self._reader: Any = hiredis.Reader() if self._use_hiredis else None
        self._tail = b""  # bytes of the partial command the fast path is holding
        self._queue: list = []  # commands the fast path parsed, not yet handed out

    # -- input -------------------------------------------------------------
    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if ((self._scan or self._use_hiredis) and self.authenticated and self._args is None
                and not self.receiving and not self._skip_crlf and self._pos >= len(self._buf)):
            # the Python parser is idle: the fast path may take over
            if self._scan:
                self._feed_scan(bytes(data))
            else:
                self._feed_hiredis(data)
            return
        if self.receiving:
            data = memoryview(data)
            while data and self.receiving:
                view: Any = self.sink_view()
                take = min(len(view), len(data))
                view[:take] = data[:take]
                data = data[take:]
                self.sink_advance(take)
            if not data:
                return
        self._buf += data

    def _feed_scan(self, data: bytes) -> None:
        """Parse the canonical commands at the start of the input, in order: `*<n>` then n times
        `$<len>` and a bulk shorter than a large one, each line ended by CRLF, n > 0 and every
        number without a leading zero. At the first byte that is anything else (an inline
        command, a large or refused bulk, a malformed line, ...), that command and the rest go
        to the Python parser, which answers them exactly as redis does; a command still arriving
        is kept (`_tail`) until it is complete, or handed over too once it passes MAX_INLINE.
        Only digits are read byte by byte; a bulk's bytes are sliced out whole."""
        stream = self._tail + data if self._tail else data
        end = len(stream)
        small = self._small_max
        queue = self._queue
        pos = 0
        while pos < end:
            start = pos
            if stream[pos] != 42:  # '*'
                self._to_python(stream[start:])
                return
            pos += 1
            n = 0
            first = pos
            while pos < end and 48 <= stream[pos] <= 57 and pos - first < 7:
                n = n * 10 + stream[pos] - 48
                pos += 1
            if pos + 1 >= end:  # the count line is still arriving
                self._hold(stream, start, end)
                return
            if pos == first or stream[first] == 48 or stream[pos] != 13 or stream[pos + 1] != 10:
                self._to_python(stream[start:])
                return
            pos += 2
            args = []
            while n:
                if pos >= end:
                    self._hold(stream, start, end)
                    return
                if stream[pos] != 36:  # '$'
                    self._to_python(stream[start:])
                    return
                pos += 1
                size = 0
                first = pos
                while pos < end and 48 <= stream[pos] <= 57 and pos - first < 7:
                    size = size * 10 + stream[pos] - 48
                    pos += 1
                if pos + 1 >= end:
                    self._hold(stream, start, end)
                    return
                if (pos == first or (stream[first] == 48 and pos - first > 1) or size > small
                        or stream[pos] != 13 or stream[pos + 1] != 10):
                    self._to_python(stream[start:])
                    return
                pos += 2
                stop = pos + size
                if stop + 2 > end:
                    self._hold(stream, start, end)
                    return
                if stream[stop] != 13 or stream[stop + 1] != 10:
                    self._to_python(stream[start:])
                    return
                args.append(stream[pos:stop])
                pos = stop + 2
                n -= 1
            queue.append(args)
        self._tail = b""

    def _hold(self, stream: bytes, start: int, end: int) -> None:
        """The command at `start` is still arriving: keep it, or hand it to the Python parser once
        it is long (a long command, or a header line that never ends: it enforces the limits)."""
        if end - start > MAX_INLINE:
            self._to_python(stream[start:])
        else:
            self._tail = stream[start:]

    def _feed_hiredis(self, data: bytes | bytearray | memoryview) -> None:
        tail = self._tail
        suspect = self._suspect
        if (suspect(data) or (tail and suspect(tail[-12:] + bytes(data[:12])))
                or (not tail and data[:1] != b"*")):
            self._to_python(tail + bytes(data))
            return
        reader = self._reader
        reader.feed(data)
        cmds = []
        try:
            while (cmd := reader.gets()) is not False:
                cmds.append(cmd)
        except hiredis.ProtocolError:
            self._to_python(tail + bytes(data))
            return
        try:  # every command must be a non-empty array of bulk strings (no nested arrays)
            for c in cmds:
                if c.__class__ is not list or not c:
                    raise TypeError
            b"".join(chain.from_iterable(cmds))
        except TypeError:
            self._to_python(tail + bytes(data))  # the Python parser judges
            return
        if not reader.has_data():
            # Everything was consumed: either hiredis is idle, or a command stopped right
            # after one of its arguments. An empty array tells: alone it parses at once.
            reader.feed(b"*0\r\n")
            try:
                idle = reader.gets() == []
            except hiredis.ProtocolError:  # it was inside a header line: not idle
                idle = False
            if idle:
                self._tail = b""
                if self._queue:
                    self._queue.extend(cmds)
                else:
                    self._queue = cmds
                return
        # hiredis holds part of a command: find where it starts by counting what the
        # complete commands took (their canonical encoding), and keep those bytes.
        try:
            lens: list[Any] = [len(a) if a.__class__ is bytes else None for c in cmds for a in c]
            used = (sum(lens) + 5 * len(lens) + sum(map(len, map(str, lens)))
                    + 3 * len(cmds) + sum(map(len, map(str, map(len, cmds)))))
        except TypeError:  # an argument that is not a bulk string: let the Python parser judge
            self._to_python(tail + bytes(data))
            return
        stream = tail + bytes(data)
        if used > len(stream) or len(stream) - used > MAX_INLINE:
            # a long partial command (or a header line that never ends): the Python
            # parser receives it, and enforces redis's line limits on it
            self._to_python(stream[used:] if used <= len(stream) else stream)
            if used <= len(stream):
                self._queue.extend(cmds)
            return
        partial = stream[used:]
        if not _bulks_so_far(partial):
            # hiredis would wait for the end of a nested array (or a reply type) where redis
            # refuses the command at once: the Python parser answers it now, as redis does
            self._to_python(partial)
            self._queue.extend(cmds)
            return
        self._tail = partial
        self._reader = hiredis.Reader()  # a fresh reader holding exactly the partial command
        self._reader.feed(self._tail)
        self._queue.extend(cmds)

    def _to_python(self, data: bytes) -> None:
        """Hand the bytes (from the start of a command) to the Python parser."""
        if self._use_hiredis:
            self._reader = hiredis.Reader()
        self._tail = b""
        if self._pos >= len(self._buf):
            self._buf.clear()
            self._pos = 0
        self._buf += data

    def sink_view(self) -> memoryview | None:
        """Where the large bulk being received goes next, or None when not receiving one."""
        if not self.receiving:
            return None
        if self._sink is not None:
            return self._sink[self._sink_filled:]
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_SCRATCH))
        return self._scratch[:min(_SCRATCH, self._sink_len - self._sink_filled)]

    def sink_progress(self) -> int:
        """Bytes of the large bulk being received so far (-1 when none is being received)."""
        return self._sink_filled if self.receiving else -1

    def sink_advance(self, n: int) -> None:
        """`n` bytes were written into `sink_view()` by the caller."""
        self._sink_filled += n
        if self._sink_filled >= self._sink_len:
            args: Any = self._args  # the command the bulk belongs to (never None here)
            args.append(self._sink_obj)
            self._remaining -= 1
            self._sink = self._sink_obj = None
            self.receiving = False
            self._skip_crlf = True

    def pending_bytes(self) -> int:
        """Bytes received and not yet consumed."""
        return len(self._buf) - self._pos + len(self._tail)

    def query_bytes(self) -> int:
        """Memory the client's unfinished input holds: bytes buffered and not yet consumed, plus
        the arguments already parsed for the command being assembled (redis's query buffer; a
        bulk received into a caller's target is not counted: the target bounds it)."""
        return len(self._buf) - self._pos + len(self._tail) + self._args_bytes

    def attach(self, target: Any, view: memoryview | None = None) -> None:
        """Receive the announced LargeBulk into `view` (default: `target`'s buffer).

        `target` takes the bulk's place in the command's arguments.
        """
        view = memoryview(target) if view is None else view
        self._start_sink(target, view, len(view))

    def head(self, n: int) -> bytes:
        """The first `n` bytes of the unconsumed input (for a log line)."""
        if self._tail:
            return self._tail[:n]
        return bytes(self._buf[self._pos:self._pos + n])

    def accumulate(self) -> None:
        """Receive the announced LargeBulk into the parser's own buffer, as an ordinary argument.

        Nothing is allocated up front: the buffer grows with the bytes that actually arrive.
        """
        self._plain = self._announced

    def drop(self, marker: Any, length: int) -> None:
        """Read the announced LargeBulk of `length` bytes and throw it away.

        `marker` (typically the error to answer with) takes its place in the arguments.
        """
        self._start_sink(marker, None, length)

    def _start_sink(self, obj: Any, view: memoryview | None, length: int) -> None:
        self._sink = view
        self._sink_obj = obj
        self._sink_len = length
        self._sink_filled = 0
        self.receiving = True
        avail = len(self._buf) - self._pos
        if avail:  # bytes already buffered after the header belong to the payload
            take = min(avail, length)
            if view is not None:
                view[:take] = self._buf[self._pos:self._pos + take]
            self._pos += take
            self.sink_advance(take)
        elif length == 0:
            self.sink_advance(0)

    def abandon(self) -> list:
        """Everything a half-received command holds (its args and any large-bulk target)."""
        held = list(self._args or [])
        if self.receiving and self._sink_obj is not None:
            held.append(self._sink_obj)
        self._sink = self._sink_obj = None
        self.receiving = False
        self._args = None
        self._plain = -1
        self._args_bytes = 0
        self._buf = bytearray()  # the connection is gone: nothing buffered is kept
        self._pos = 0
        self._tail = b""
        self._queue = []
        return held

    # -- commands ----------------------------------------------------------
    def parsed(self) -> list:
        """Every command the fast path has already parsed (may be empty); then use next_command()."""
        cmds = self._queue
        if cmds:
            self._queue = []
        return cmds

    def buffered(self) -> bool:
        """Whether next_command() may have anything to return."""
        return bool(self._queue) or self._pos < len(self._buf) or self.receiving

    def next_command(self) -> list | LargeBulk | None:
        """The next complete command, a LargeBulk announcement, or NEED_DATA.

        Raises ProtocolError on malformed input; the connection must then be closed.
        """
        if self._queue:
            return self._queue.pop(0)
        while (item := self._next()) is _SKIPPED:
            pass
        return item

    def _next(self) -> Any:  # a command, a LargeBulk, NEED_DATA or _SKIPPED
        if self.receiving:
            return NEED_DATA
        buf = self._buf
        pos = self._pos
        end = len(buf)
        if self._skip_crlf:
            if end - pos < 2:
                return NEED_DATA
            pos += 2  # redis skips the CRLF after a bulk without checking it
            self._skip_crlf = False
        args = self._args
        if args is None:
            if pos >= end:
                self._reset_buffer()
                return NEED_DATA
            if buf[pos] != 42:  # not '*': an inline command
                self._pos = pos
                return self._inline()
            nl = _line_end(buf, pos, end)
            if nl < 0:
                if nl == _NO_LINE and end - pos > MAX_INLINE:
                    raise ProtocolError("too big mbulk count string")
                self._pos = pos
                self._maybe_compact()
                return NEED_DATA
            n = _parse_len(buf[pos + 1:nl])
            if n is None or n > MAX_MULTIBULK_LEN:
                raise ProtocolError("invalid multibulk length")
            if not self.authenticated and n > UNAUTH_MULTIBULK_LEN:
                raise ProtocolError("unauthenticated multibulk length")
            pos = nl + 2
            if n <= 0:  # '*0' and '*-1' are skipped, as redis does
                self._pos = pos
                return _SKIPPED
            args = self._args = []
            self._args_bytes = 0
            self._remaining = n
        remaining = self._remaining
        held = self._args_bytes
        max_bulk = self.max_bulk_len if self.authenticated else UNAUTH_BULK_LEN
        while remaining:
            if self._plain >= 0:  # a large bulk without a target: taken once it has all arrived
                stop = pos + self._plain
                if stop + 2 > end:
                    break
                with memoryview(buf) as view:  # one copy, not a bytearray slice and then bytes
                    args.append(bytes(view[pos:stop]))
                held += self._plain + ARG_OVERHEAD
                self._plain = -1
                remaining -= 1
                del buf[:stop + 2]  # give the long buffer back now, not at the next compaction
                pos, end = 0, len(buf)
                continue
            if pos >= end:
                break
            nl = _line_end(buf, pos, end)  # redis finds the line before it looks at its first byte
            if nl < 0:
                if nl == _NO_LINE and end - pos > MAX_INLINE:
                    raise ProtocolError("too big bulk count string")
                break
            if buf[pos] != 36:  # '$'; redis quotes the byte as it is ('%c')
                raise ProtocolError(f"expected '$', got '{bytes((buf[pos],)).decode('utf-8', 'surrogateescape')}'")
            n = _parse_len(buf[pos + 1:nl])
            if n is None or n < 0 or n > max_bulk:
                raise ProtocolError("unauthenticated bulk length" if not self.authenticated
                                    and n is not None and n > 0 else "invalid bulk length")
            start = nl + 2
            if n >= self.large_bulk:
                self._pos = start
                self._remaining = remaining
                self._args_bytes = held
                self._announced = n
                return LargeBulk(args, len(args), n)
            stop = start + n
            if stop + 2 > end:
                break
            args.append(bytes(buf[start:stop]))
            held += n + ARG_OVERHEAD
            pos = stop + 2
            remaining -= 1
        self._pos = pos
        self._remaining = remaining
        if remaining:
            self._args_bytes = held
            self._maybe_compact()
            return NEED_DATA
        self._args = None
        self._args_bytes = 0
        return args

    def _inline(self) -> Any:  # a command, NEED_DATA or _SKIPPED
        buf = self._buf
        pos = self._pos
        nl = buf.find(b"\n", pos)
        if nl >= 0 and buf.find(0, pos, nl) >= 0:
            nl = -1  # redis looks for the LF with strchr(), which stops at a NUL byte: no line yet
        if nl < 0:
            if len(buf) - pos > MAX_INLINE:
                raise ProtocolError("too big inline request")
            self._maybe_compact()
            return NEED_DATA
        line = bytes(buf[pos:nl])
        self._pos = nl + 1
        if line.endswith(b"\r"):
            line = line[:-1]
        args = split_args(line)
        if args is None:
            raise ProtocolError("unbalanced quotes in request")
        if not args:  # an empty line is skipped, as redis does
            return _SKIPPED
        return args

    def _maybe_compact(self) -> None:
        if self._pos > _COMPACT_AT or (self._pos and self._pos == len(self._buf)):
            del self._buf[:self._pos]
            self._pos = 0

    def _reset_buffer(self) -> None:
        if self._buf:
            self._buf.clear()
        self._pos = 0


_ESCAPES = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("b"): b"\b", ord("a"): b"\a"}
_HEX = b"0123456789abcdefABCDEF"


def split_args(line: bytes) -> list[bytes] | None:
    """Split an inline command as redis's sdssplitargs does; None on unbalanced quotes.

    Blanks between arguments are isspace() (space, \\t, \\n, \\v, \\f, \\r), but an unquoted
    argument ends only at space, \\t, \\n, \\r: `a\\vb` is one argument.
    """
    args: list[bytes] = []
    i, n = 0, len(line)
    while True:
        while i < n and line[i] in b" \n\r\t\v\f":
            i += 1
        if i >= n:
            return args
        cur = bytearray()
        quote = 0
        while i < n:
            c = line[i]
            if quote == 34:  # inside "..."
                if c == 92 and i + 3 < n and line[i + 1] == 120 and line[i + 2] in _HEX and line[i + 3] in _HEX:
                    cur.append(int(line[i + 2:i + 4], 16))
                    i += 4
                    continue
                if c == 92 and i + 1 < n:
                    cur += _ESCAPES.get(line[i + 1], bytes([line[i + 1]]))
                    i += 2
                    continue
                if c == 34:
                    if i + 1 < n and line[i + 1] not in b" \n\r\t\v\f":
                        return None  # closing quote must be followed by a space
                    i += 1
                    quote = 0
                    break
                cur.append(c)
            elif quote == 39:  # inside '...'
                if c == 92 and i + 1 < n and line[i + 1] == 39:
                    cur.append(39)
                    i += 2
                    continue
                if c == 39:
                    if i + 1 < n and line[i + 1] not in b" \n\r\t\v\f":
                        return None
                    i += 1
                    quote = 0
                    break
                cur.append(c)
            else:
                if c in b" \n\r\t\x00":  # sdssplitargs ends a token only at these (not \v, \f)
                    break
                if c in (34, 39):
                    quote = c
                else:
                    cur.append(c)
            i += 1
        if quote:
            return None
        args.append(bytes(cur))


# -- replies ---------------------------------------------------------------

NULL2 = b"$-1\r\n"
NULL3 = b"_\r\n"
NULL = (NULL2, NULL3)  # by protocol: NULL[resp3]

# -- framing, in one place: encode() below and the handlers that write their replies straight
# to bytes (ROUTE, COMMAND DOCS) take their headers and scalars from here. Headers of the
# sizes replies mostly have are encoded once, at import.
_CACHED_HEADERS = 1024
_ARRAY = tuple(b"*%d\r\n" % n for n in range(_CACHED_HEADERS))
_MAP3 = tuple(b"%%%d\r\n" % n for n in range(_CACHED_HEADERS))
_SET3 = tuple(b"~%d\r\n" % n for n in range(_CACHED_HEADERS))
_INT = tuple(b":%d\r\n" % n for n in range(_CACHED_HEADERS))


def array_header(n: int) -> bytes:
    """`*n`: an array of n items (either protocol)."""
    return _ARRAY[n] if n < _CACHED_HEADERS else b"*%d\r\n" % n


def map_header(pairs: int, resp3: bool) -> bytes:
    """A map of `pairs` entries: `%pairs` in RESP3, a flat array of 2*pairs items in RESP2."""
    if resp3:
        return _MAP3[pairs] if pairs < _CACHED_HEADERS else b"%%%d\r\n" % pairs
    return array_header(2 * pairs)


def set_header(n: int, resp3: bool) -> bytes:
    """A set of n items: `~n` in RESP3, an array in RESP2."""
    if resp3:
        return _SET3[n] if n < _CACHED_HEADERS else b"~%d\r\n" % n
    return array_header(n)


def integer(n: int) -> bytes:
    return _INT[n] if 0 <= n < _CACHED_HEADERS else b":%d\r\n" % n


def bulk_header(n: int) -> bytes:
    """`$n`: what comes before a bulk string of n bytes (then the bytes and CRLF)."""
    return b"$%d\r\n" % n


def bulk(b: bytes) -> bytes:
    """A bulk string."""
    return b"$%d\r\n%b\r\n" % (len(b), b)


def double(v: float, resp3: bool) -> bytes:
    """A double: RESP3 `,`, a bulk string of its digits in RESP2 (inf, -inf and nan as redis writes them)."""
    text = repr(v).encode() if v == v and abs(v) != float("inf") else (
        b"nan" if v != v else (b"inf" if v > 0 else b"-inf"))
    return b",%b\r\n" % text if resp3 else b"$%d\r\n%b\r\n" % (len(text), text)


class EncodedById:
    """Encoded bytes of shared, immutable objects (a router's candidates and plan steps), found
    by `id` with no hashing of the object. Each object is kept while its bytes are, so its id
    cannot be reused by another object meanwhile; the whole cache is dropped when it fills."""

    __slots__ = ("encoder", "size", "alive", "by_protocol")

    def __init__(self, encoder: Callable[[Any, bool], bytes], size: int = 4096) -> None:
        self.encoder = encoder  # (object, resp3) -> bytes
        self.size = size
        self.alive: dict[int, object] = {}
        self.by_protocol: tuple[dict[int, bytes], dict[int, bytes]] = ({}, {})

    def many(self, objects: list, resp3: bool) -> list[bytes]:
        table = self.by_protocol[resp3]
        parts: list[Any] = list(map(table.get, map(id, objects)))
        if not all(parts):  # an object seen for the first time (no encoding is empty)
            for i, part in enumerate(parts):
                if part is None:
                    parts[i] = self.one(objects[i], resp3)
        return parts

    def one(self, obj: Any, resp3: bool) -> bytes:
        table = self.by_protocol[resp3]
        out = table.get(id(obj))
        if out is None:
            if len(self.alive) >= self.size:
                self.alive.clear()
                for t in self.by_protocol:
                    t.clear()
            self.alive[id(obj)] = obj
            out = table[id(obj)] = self.encoder(obj, resp3)
        return out


class BulkCache:
    """Bulk strings of texts that recur in replies (engine ids, URLs, field names), each encoded
    once; at most `size` are kept (all dropped when it fills)."""

    __slots__ = ("size", "_of")

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._of: dict[str, bytes] = {}

    def __call__(self, text: str) -> bytes:
        out = self._of.get(text)
        if out is None:
            if len(self._of) >= self.size:
                self._of.clear()
            out = self._of[text] = bulk(text.encode())
        return out


def encode_error(err: QuillError) -> bytes:
    """The one place a typed error becomes `-PREFIX message`.

    Client bytes quoted in the message (`errors.echo`) go back raw. As redis's
    addReplyErrorFormat: CRs and LFs at the end are trimmed, the others become spaces.
    """
    text = err.wire().rstrip("\r\n").replace("\r", " ").replace("\n", " ")
    return b"-" + text.encode("utf-8", "surrogateescape") + b"\r\n"


def encode(value: Any, resp3: bool, out: list) -> None:
    """Append the encoding of `value` to `out` (a list of byte chunks).

    bytes -> bulk; Status -> simple string; int -> integer; None -> null;
    list/tuple -> array; dict -> map; set, OrderedSet -> set; float -> double;
    bool -> boolean; Verbatim -> verbatim text; QuillError -> error;
    BigNumber -> big number; Attribute -> attribute frame (nothing in RESP2);
    Push -> push frame; Raw -> as is; Pinned -> bulk header, the view, CRLF.
    """
    t = type(value)
    if t is bytes or t is bytearray:
        out.append(b"$%d\r\n%b\r\n" % (len(value), value))
    elif t is Status:
        out.append(b"+%b\r\n" % value)
    elif t is int:
        out.append(_INT[value] if 0 <= value < _CACHED_HEADERS else b":%d\r\n" % value)
    elif value is None:
        out.append(NULL3 if resp3 else NULL2)
    elif t is list or t is tuple:
        n = len(value)
        out.append(_ARRAY[n] if n < _CACHED_HEADERS else b"*%d\r\n" % n)
        for item in value:
            encode(item, resp3, out)
    elif t is str:
        raw = value.encode()
        out.append(b"$%d\r\n%b\r\n" % (len(raw), raw))
    elif t is Raw:
        out.append(value)
    elif isinstance(value, QuillError):
        out.append(encode_error(value))
    elif t is dict:
        out.append(map_header(len(value), resp3))
        for k, v in value.items():
            encode(k, resp3, out)
            encode(v, resp3, out)
    elif t is bool:
        out.append((b"#t\r\n" if value else b"#f\r\n") if resp3 else (b":1\r\n" if value else b":0\r\n"))
    elif t is float:
        out.append(double(value, resp3))
    elif t is set or t is frozenset or t is OrderedSet:
        out.append(set_header(len(value), resp3))
        for item in value:
            encode(item, resp3, out)
    elif t is Verbatim:
        if resp3:
            out.append(b"=%d\r\ntxt:%b\r\n" % (len(value) + 4, value))
        else:
            out.append(b"$%d\r\n%b\r\n" % (len(value), value))
    elif t is BigNumber:
        out.append(b"(%b\r\n" % value if resp3 else b"$%d\r\n%b\r\n" % (len(value), value))
    elif t is Attribute:
        if resp3:
            out.append(b"|%d\r\n" % len(value))
            for k, v in value.items():
                encode(k, resp3, out)
                encode(v, resp3, out)
    elif t is Push:
        out.append((b">%d\r\n" if resp3 else b"*%d\r\n") % len(value))
        for item in value:
            encode(item, resp3, out)
    elif t is Pinned:
        out.append(b"$%d\r\n" % len(value.view))
        out.append(value.view)
        out.append(b"\r\n")
    elif isinstance(value, bytes):  # other bytes subclasses
        out.append(b"$%d\r\n%b\r\n" % (len(value), value))
    else:
        raise TypeError(f"cannot encode reply of type {t.__name__}")
