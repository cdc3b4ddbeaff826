"""Sans-IO RESP reply reader that lands bulk payloads in buffers the caller names.

Bytes go in with `feed(data)`, or without a copy: `get_buffer(sizehint)` is
where the next bytes should be received (`sock.recv_into(...)`) and
`buffer_updated(n)` says how many arrived (asyncio's `BufferedProtocol`
vocabulary). Then `next_event()` returns, until it returns NEED_DATA:

- a complete reply: `bytes` (bulk), `Status` (`+OK`, a bytes subclass),
  `int`, `None` (`$-1`, `*-1`, `_`), `ReplyError` (`-ERR ...`, returned as a
  value, not raised, as hiredis does), or a `list` of those (arrays, nested);
- a `Bulk` announcement when the header of a bulk of at least `large_bulk`
  bytes arrives (every bulk with the default `large_bulk=0`; none with
  `None`). The caller answers with `attach(view)`: the payload then lands in
  `view` with no intermediate `bytes`, and while it arrives `get_buffer()` IS
  the unfilled part of `view`, so `recv_into` writes straight into it (the
  same idea as the sink of quilld's command parser, `RespParser`). Or it
  answers with `drop(marker)` (read and throw the payload away; `marker` takes
  its place in the reply) or `take()` (receive it as `bytes` after all).
  In an array, the announcement says where the bulk sits (`depth`, the
  enclosing array's `items` so far and its `count`), so `*2 :crc $len payload`
  can be checked before a byte of payload is written anywhere.

The CRLF after every payload is checked. Anything that is not a valid reply
raises `ProtocolError` (a ValueError); the reader, like the connection it
reads, cannot be used after that.
"""

from __future__ import annotations

from typing import Any

# Limits, with their precedent.
MAX_LINE = 64 * 1024  # redis's PROTO_INLINE_MAX_SIZE: a header, status or error line without its CRLF
MAX_BULK_LEN = 512 * 1024 * 1024  # redis's proto-max-bulk-len default (quilld's too): the most the
#                                   reader allocates for one bulk it receives itself (not announced);
#                                   an announced bulk goes to the caller's memory, the caller judges it
MAX_ARRAY_LEN = 1024 * 1024 * 1024  # quilld's MAX_MULTIBULK_LEN: 2**30 elements (redis: up to INT_MAX)
MAX_DEPTH = 7  # hiredis before 1.0: "No support for nested multi bulk replies with depth > 7"
MAX_INT_DIGITS = 19  # lengths and integers are signed 64-bit, as redis's string2ll and hiredis read them
BUFFER_SIZE = 128 * 1024  # the reader's own buffer for header lines and small replies (> MAX_LINE)


class _NeedData:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = _NeedData()  # next_event() result while no complete event is buffered (None is a nil reply)


class ProtocolError(ValueError):
    """The bytes are not a valid RESP reply; the connection must be closed."""


class Status(bytes):
    """A simple string reply (`+OK`)."""


class ReplyError(Exception):
    """An error reply, `-PREFIX message`; `message` is the text after the `-`."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Bulk:
    """A bulk of `length` bytes is coming: answer with `attach(view)`, `drop()` or `take()`.

    `depth` is 0 when the bulk is the whole reply; otherwise `items` holds the
    elements of the innermost enclosing array received so far (the bulk is
    `items[len(items)]`, i.e. `index`) and `count` that array's length.
    """

    __slots__ = ("length", "depth", "items", "count")

    def __init__(self, length: int, depth: int, items: list | None, count: int | None) -> None:
        self.length = length
        self.depth = depth
        self.items = items
        self.count = count

    @property
    def index(self) -> int | None:
        return None if self.items is None else len(self.items)

    def __repr__(self) -> str:
        where = "" if self.items is None else f" at {self.index} of {self.count}, depth {self.depth}"
        return f"<Bulk {self.length} bytes{where}>"


def _parse_int(raw: bytes | bytearray) -> int | None:
    """Strict decimal in signed 64-bit range: optional '-', digits, no leading zero, no '+', no '-0'."""
    negative = raw[:1] == b"-"
    digits = raw[1:] if negative else raw
    if (not digits.isdigit() or len(digits) > MAX_INT_DIGITS
            or (digits[:1] == b"0" and (len(digits) > 1 or negative))):
        return None
    n = int(raw)
    return n if -(1 << 63) <= n < (1 << 63) else None


def _writable(view) -> memoryview:
    mv = memoryview(view)
    if mv.format != "B" or mv.ndim != 1 or not mv.c_contiguous:
        if not mv.c_contiguous:
            raise ValueError("attach() needs a C-contiguous buffer")
        mv = mv.cast("B")
    if mv.readonly:
        raise TypeError("attach() needs a writable buffer")
    return mv


class ReplyReader:
    """Incremental reader of RESP2 replies (plus RESP3's `_` null), several per stream."""

    def __init__(self, large_bulk: int | None = 0, *, max_bulk_len: int = MAX_BULK_LEN,
                 max_array_len: int = MAX_ARRAY_LEN, buffer_size: int = BUFFER_SIZE) -> None:
        if buffer_size < MAX_LINE + 2:
            raise ValueError(f"buffer_size must hold a line of MAX_LINE ({MAX_LINE}) bytes and its CRLF")
        self._large_bulk = large_bulk
        self._announce_from = 1 << 64 if large_bulk is None else large_bulk
        self.max_bulk_len = max_bulk_len
        self.max_array_len = max_array_len
        self._buf = bytearray(buffer_size)
        self._mv = memoryview(self._buf)
        self._start = self._end = 0  # buffered, not yet consumed: _buf[_start:_end]
        self._stack: list[list] = []  # open arrays, outermost first: [items, count]
        self._announced: Bulk | None = None  # waiting for attach() / drop() / take()
        self._sink: memoryview | None = None  # where the arriving payload goes (None: dropped)
        self._sinks: list[memoryview] = []  # where it goes next, once _sink is full (attach of a list)
        self._sink_pos = 0
        self._sink_left = 0  # payload bytes still to come
        self._crlf_due = False  # a payload is (being) received; its CRLF comes next
        self._value: Any = None  # what stands for that bulk in the reply
        self._own = False  # _value is the reader's own bytearray, handed out as bytes

    @property
    def large_bulk(self) -> int | None:
        """Bulks of at least this many bytes are announced (None: none is)."""
        return self._large_bulk

    # -- input -------------------------------------------------------------

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next received bytes go; pass its filled length to `buffer_updated`.

        While a payload is arriving this is the unfilled part of the attached
        view (whatever `sizehint`); otherwise free space in the reader's own
        buffer, at most `sizehint` bytes if it is positive (so a read for a
        header takes little of the payload that follows it).
        """
        if self._sink_left:
            if self._sink is not None:
                return self._sink[self._sink_pos:]
            return self._mv[:min(self._sink_left, len(self._buf))]  # dropped: the buffer is empty now
        start, end, cap = self._start, self._end, len(self._buf)
        if start == end:
            start = end = self._start = self._end = 0
        want = cap - end if sizehint is None or sizehint <= 0 else sizehint
        if cap - end < want and start:  # compact: what is pending moves to the front
            n = end - start
            self._buf[:n] = self._mv[start:end]
            start, end = self._start, self._end = 0, n
        if end == cap:  # full of input nobody has read yet (feed() ahead of next_event()): grow
            bigger = bytearray(max(2 * cap, end + want))
            bigger[:end] = self._mv[:end]
            self._buf, self._mv = bigger, memoryview(bigger)
            cap = len(bigger)
        return self._mv[end:min(cap, end + want)]

    def buffer_updated(self, nbytes: int) -> None:
        """`nbytes` were written at the start of the last `get_buffer()`."""
        if self._sink_left:
            if nbytes > self._sink_left:
                raise ValueError("more bytes than get_buffer() offered")
            self._sink_pos += nbytes
            self._sink_left -= nbytes
            if not self._sink_left:  # the payload is in: only its CRLF is still due
                self._sink = None
                if self._own:
                    self._value, self._own = bytes(self._value), False
            elif self._sinks and self._sink_pos == len(self._sink):  # this buffer is full: the next one
                self._sink, self._sink_pos = self._sinks.pop(0), 0
        else:
            self._end += nbytes

    def feed(self, data) -> None:
        """Copy `data` in (bytes, bytearray, memoryview)."""
        data = memoryview(data).cast("B")
        while data:
            view = self.get_buffer(len(data))
            take = min(len(view), len(data))
            view[:take] = data[:take]
            self.buffer_updated(take)
            data = data[take:]

    # -- state -------------------------------------------------------------

    @property
    def receiving(self) -> bool:
        """A payload is arriving (into an attached view, or being dropped)."""
        return self._sink_left > 0

    @property
    def buffered(self) -> int:
        """Bytes received and not consumed yet (payload being received excluded)."""
        return self._end - self._start

    @property
    def idle(self) -> bool:
        """Between replies with nothing buffered: the stream may be reused as it is."""
        return (self._start == self._end and not self._stack and self._announced is None
                and not self._crlf_due and not self._sink_left)

    # -- answers to a Bulk announcement ------------------------------------

    def _answering(self) -> Bulk:
        bulk = self._announced
        if bulk is None:
            raise RuntimeError("no bulk is announced")
        return bulk

    def attach(self, view) -> None:
        """Receive the announced bulk into `view` (writable, at least that long; the payload
        fills its first `length` bytes). `view` itself stands for the bulk in the reply.

        `view` may be a list of buffers: the payload is scattered over them, in order (the
        first `len(b0)` bytes into b0, the next into b1...), straight from the stream."""
        bulk = self._announced
        if bulk is None:
            raise RuntimeError("no bulk is announced")
        n = bulk.length
        views = [_writable(v) for v in view] if isinstance(view, list) else [_writable(view)]
        total = sum(len(v) for v in views)
        if total < n:
            raise ValueError(f"the bulk is {n} bytes but the buffer holds {total}")
        self._announced = None
        sinks, left = [], n
        for v in views:  # the front of the buffers, `n` bytes, no empty piece
            if left and len(v):
                sinks.append(v if len(v) <= left else v[:left])
                left -= len(sinks[-1])
        if len(sinks) <= 1:
            self._receive(sinks[0] if sinks else memoryview(bytearray(0)), n, view)
            return
        self._receive_scattered(sinks, n, view)

    def _receive_scattered(self, sinks: list[memoryview], n: int, value: Any) -> None:
        """_receive over several buffers: what is buffered first, the rest as it arrives."""
        start = self._start
        for i, v in enumerate(sinks):
            take = min(len(v), self._end - start)
            if take:
                v[:take] = self._mv[start:start + take]
                start += take
            if take < len(v):  # the stream fills the rest
                self._start = start
                self._sink, self._sink_pos, self._sinks = v, take, sinks[i + 1:]
                self._sink_left = n - sum(len(s) for s in sinks[:i]) - take
                break
        else:
            self._start = start
        self._value = value
        self._own = False
        self._crlf_due = True

    def drop(self, marker: Any = None) -> None:
        """Read the announced bulk and throw it away; `marker` stands for it in the reply."""
        n = self._answering().length
        self._announced = None
        self._receive(None, n, marker)

    def take(self) -> None:
        """Receive the announced bulk as `bytes`, as if it had not been announced."""
        n = self._answering().length
        if n > self.max_bulk_len:
            raise ProtocolError(f"bulk of {n} bytes is over the reader's limit of {self.max_bulk_len}")
        self._announced = None
        self._take(n)

    def _take(self, n: int) -> None:
        start = self._start
        if self._end - start >= n:  # all there: no bytearray in between
            self._start = start + n
            self._value, self._own, self._crlf_due = bytes(self._mv[start:start + n]), False, True
            return
        own = bytearray(n)
        self._receive(memoryview(own), n, own)
        self._own = True

    def _receive(self, view: memoryview | None, n: int, value: Any) -> None:
        """Start receiving an n-byte payload into `view` (None: dropped), first from the buffer."""
        start = self._start
        take = self._end - start
        if take > n:
            take = n
        if take:
            if view is not None:
                view[:take] = self._mv[start:start + take]
            self._start = start + take
        if take < n:
            self._sink = view
            self._sink_pos = take
            self._sink_left = n - take
        self._value = value
        self._own = False
        self._crlf_due = True

    # -- events ------------------------------------------------------------

    def next_event(self) -> Any:
        """The next complete reply, a `Bulk` announcement, or NEED_DATA."""
        if self._announced is not None:
            raise RuntimeError("answer the Bulk announcement with attach(), drop() or take() first")
        buf = self._buf
        stack = self._stack
        while True:
            if self._sink_left:
                return NEED_DATA
            start = self._start
            if self._crlf_due:
                if self._end - start < 2:
                    return NEED_DATA
                if buf[start] != 13 or buf[start + 1] != 10:
                    raise ProtocolError("bulk reply not followed by CRLF")
                self._start = start + 2
                self._crlf_due = False
                value, self._value = self._value, None
            else:
                nl = buf.find(b"\r\n", start, self._end)
                if nl < 0:
                    if self._end - start > MAX_LINE:
                        raise ProtocolError(f"reply line longer than {MAX_LINE} bytes")
                    return NEED_DATA
                if nl - start > MAX_LINE:
                    raise ProtocolError(f"reply line longer than {MAX_LINE} bytes")
                kind = buf[start]
                line = buf[start + 1:nl]
                self._start = nl + 2
                if kind == 36:  # '$'
                    if line.isdigit() and len(line) < MAX_INT_DIGITS and (line[0] != 48 or len(line) == 1):
                        n = int(line)  # the common case, in short
                    else:
                        n = _parse_int(line)
                        if n is None or n < -1:
                            raise ProtocolError(f"invalid bulk length {bytes(line[:40])!r}")
                    if n == -1:
                        value = None
                    elif n >= self._announce_from:
                        if stack:
                            items, count = stack[-1]
                            bulk = Bulk(n, len(stack), items, count)
                        else:
                            bulk = Bulk(n, 0, None, None)
                        self._announced = bulk
                        return bulk
                    elif n > self.max_bulk_len:
                        raise ProtocolError(f"bulk of {n} bytes is over the reader's limit of {self.max_bulk_len}")
                    else:
                        self._take(n)
                        continue  # its CRLF (and its payload, if not all here yet)
                elif kind == 42:  # '*'
                    n = _parse_int(line)
                    if n is None or n < -1 or n > self.max_array_len:
                        raise ProtocolError(f"invalid array length {bytes(line[:40])!r}")
                    if n > 0:
                        if len(stack) >= MAX_DEPTH:
                            raise ProtocolError(f"arrays nested deeper than {MAX_DEPTH}")
                        stack.append([[], n])
                        continue
                    value = None if n < 0 else []
                elif kind == 58:  # ':'
                    value = _parse_int(line)
                    if value is None:
                        raise ProtocolError(f"invalid integer {bytes(line[:40])!r}")
                elif kind == 43:  # '+'
                    value = Status(line)  # a bytes subclass, from the bytearray
                elif kind == 45:  # '-'
                    value = ReplyError(line.decode("utf-8", "replace"))
                elif kind == 95 and not line:  # '_': RESP3 null
                    value = None
                else:
                    raise ProtocolError(f"unexpected reply {bytes(buf[start:min(nl, start + 40)])!r}")
            # a value is complete: it goes into its array, or it is the reply
            while stack:
                top = stack[-1]
                top[0].append(value)
                if len(top[0]) < top[1]:
                    break
                stack.pop()
                value = top[0]
            else:
                return value
