"""Gossip packets: SWIM messages to bytes and back, with optional HMAC-SHA256.

No sockets here. `swim.py` speaks in the message classes below; the shell
(`gossip.py`) turns them into bytes with a `Codec` and back.

A packet is one msgpack array, `[VERSION, TYPE, field, ...]`. When a shared
secret is configured, the body is followed by an 8-byte stamp (the sender's
clock in microseconds since the epoch, big-endian, strictly increasing per
sender) and the first `MAC_LEN` bytes of HMAC-SHA256(secret, MAC_CONTEXT +
body + stamp). The MAC is checked with `hmac.compare_digest` *before* the
body is parsed, so unauthenticated bytes never reach msgpack.

Replays. An authenticated packet is accepted once: its stamp must be within
`REPLAY_WINDOW` of this node's clock (so nodes' clocks must agree within it,
as NTP keeps them), and not one this node already accepted from the same
sender (its node id, which every message carries) within the window
(`ReplayGuard`). A replayed packet raises `Replayed` (`stale` when outside the
window). Without a secret there is no MAC and no stamp, so anyone who can
send a UDP packet can speak for any member: quilld refuses to gossip without
a secret anywhere but on loopback.

Decoding is strict: any wrong type, length, range or shape raises
`MalformedPacket` (a wrong or missing MAC raises its subclass
`AuthFailure`, a replay its subclass `Replayed`). The shell counts and
drops those; nothing else escapes.

Layouts (fields after VERSION and TYPE):

    PING       seq, target_id, source_id, updates
    ACK        seq, source_id, updates
    NACK       seq, source_id
    PING_REQ   seq, target_id, target_host, target_port, source_id, updates
    RUMOR      source_id, updates                  (updates only, e.g. a leave)
    PUSH_PULL  source_id, entries                  (TCP only: the full member table)

    update     [ALIVE, id, incarnation, host, port, meta]
               [SUSPECT | DEAD, id, incarnation, accuser_id]
               [LEFT, id, incarnation]
    entry      [id, host, port, incarnation, state, meta]

State codes on the wire: ALIVE 0, SUSPECT 1, DEAD 2, LEFT 3 (`STATE_CODES`).
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import struct
import time
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from collections.abc import Callable
from typing import Any, Union

import msgpack

VERSION = 1

# Limits. Packets stay below a 1500-byte Ethernet MTU with room for IP/UDP headers and
# tunnels (memberlist's UDPBufferSize is 1400); what we send is smaller than what we
# accept so a peer with slightly different accounting is not refused.
PACKET_BUDGET = 1200  # bytes of UDP payload we send, MAC included
MAX_DATAGRAM = 1400  # bytes of UDP payload we accept
MAX_FRAME = 8 * 1024 * 1024  # bytes of one TCP push/pull frame (~10k members with full meta)
MAX_ID_LEN = 64  # characters of a node id
MAX_HOST_LEN = 64  # characters of a host (an IPv6 literal is at most 45)
MAX_META_BYTES = 512  # encoded meta of one member; an ALIVE update must fit one packet
MAX_META_DEPTH = 4  # nesting of dicts/lists inside meta
MAX_UPDATES = 64  # updates in one packet (keeps the msgpack array header at 3 bytes)
MAX_ENTRIES = 10_000  # members in one push/pull
MAX_SEQ = 2**32 - 1
MAX_INCARNATION = 2**63 - 1
MAC_LEN = 16  # truncated HMAC-SHA256, as in RFC 4868's 128-bit truncations
MAC_CONTEXT = b"quilld-gossip-v2\0"  # domain separation: the secret may be reused elsewhere (v2: stamped)
STAMP_LEN = 8  # the sender's clock, microseconds since the epoch, between the body and the MAC
REPLAY_WINDOW = 30.0  # seconds a stamp may be off this node's clock (Kerberos allows 5 minutes of skew)
MAX_STAMPS_PER_SENDER = 4096  # stamps remembered per sender within the window (SWIM sends a few a second)
_STAMP = struct.Struct(">Q")


class MalformedPacket(Exception):
    """Bytes that are not a valid gossip packet: dropped and counted, never answered."""


class AuthFailure(MalformedPacket):
    """A missing or wrong MAC (wrong secret, no secret, or tampering)."""


class Replayed(MalformedPacket):
    """An authentic packet accepted before (a replay), or `stale`: stamped outside REPLAY_WINDOW
    of this node's clock (an old packet replayed, or clocks that disagree)."""

    def __init__(self, message: str, stale: bool, skew: float = 0.0) -> None:
        super().__init__(message)
        self.stale, self.skew = stale, skew


@dataclass(slots=True)
class _Seen:
    stamps: set[int] = field(default_factory=set)
    order: list[int] = field(default_factory=list)  # the same stamps, a min-heap
    floor: int = 0  # stamps at or below it are refused (raised when the set overflows)


class ReplayGuard:
    """The stamps each sender used within the window: an authentic packet is accepted once.

    Sans-IO: the caller gives the time. Memory is bounded by the authenticated
    traffic of one window: at most `per_sender` stamps per sender (past it the
    oldest is forgotten and stamps up to it are refused), and a sender with no
    stamp left in the window is forgotten.
    """

    SWEEP_EVERY = 1024  # checks between sweeps of senders gone quiet

    def __init__(self, window: float = REPLAY_WINDOW, per_sender: int = MAX_STAMPS_PER_SENDER) -> None:
        self.window_us = int(window * 1_000_000)
        self.per_sender = per_sender
        self._senders: dict[str, _Seen] = {}
        self._checks = 0

    def check(self, sender: str, stamp: int, now: float) -> None:
        """Accept `stamp` from `sender` (remember it), or raise Replayed."""
        now_us = int(now * 1_000_000)
        low = now_us - self.window_us
        if not low <= stamp <= now_us + self.window_us:
            skew = (stamp - now_us) / 1e6
            raise Replayed(f"stamped {skew:+.1f} s off this node's clock", stale=True, skew=skew)
        seen = self._senders.get(sender)
        if seen is None:
            seen = self._senders[sender] = _Seen()
        self._expire(seen, low)
        if stamp <= seen.floor or stamp in seen.stamps:
            raise Replayed(f"a replay of a packet from {sender}", stale=False)
        seen.stamps.add(stamp)
        heapq.heappush(seen.order, stamp)
        if len(seen.order) > self.per_sender:
            oldest = heapq.heappop(seen.order)
            seen.stamps.discard(oldest)
            seen.floor = max(seen.floor, oldest)
        self._checks += 1
        if self._checks % self.SWEEP_EVERY == 0:
            self._sweep(low)

    @staticmethod
    def _expire(seen: _Seen, low: int) -> None:
        while seen.order and seen.order[0] < low:
            seen.stamps.discard(heapq.heappop(seen.order))

    def _sweep(self, low: int) -> None:
        for sender in list(self._senders):
            seen = self._senders[sender]
            self._expire(seen, low)
            if not seen.order:
                del self._senders[sender]

    def __len__(self) -> int:
        """Senders remembered."""
        return len(self._senders)


class State(str, Enum):
    """A member's state as SWIM sees it. LEFT is a graceful DEAD announced by the member.

    The value is the name shown to people (NODES, logs); on the wire it is `STATE_CODES[state]`.
    """

    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


STATES = (State.ALIVE, State.SUSPECT, State.DEAD, State.LEFT)  # wire code -> state
STATE_CODES = {state: code for code, state in enumerate(STATES)}


class Type(IntEnum):
    PING = 1
    ACK = 2
    NACK = 3
    PING_REQ = 4
    RUMOR = 5
    PUSH_PULL = 6


Addr = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Update:
    """One piece of membership news piggy-backed on a packet.

    `addr` and `meta` are set for ALIVE only; `source` (the accuser) for
    SUSPECT and DEAD only. `meta` must not be mutated once built.
    """

    kind: State
    node_id: str
    incarnation: int
    addr: Addr | None = None
    meta: dict | None = None
    source: str = ""


@dataclass(frozen=True, slots=True)
class Entry:
    """One member's row in a push/pull exchange."""

    node_id: str
    addr: Addr
    incarnation: int
    state: State
    meta: dict


@dataclass(frozen=True, slots=True)
class Ping:
    seq: int
    target: str  # the node id the sender expects at this address; others ignore the ping
    source: str
    updates: tuple[Update, ...] = ()


@dataclass(frozen=True, slots=True)
class Ack:
    seq: int
    source: str
    updates: tuple[Update, ...] = ()


@dataclass(frozen=True, slots=True)
class Nack:
    """A ping-req helper got no ack from the target (Lifeguard: proves the helper heard us)."""

    seq: int
    source: str


@dataclass(frozen=True, slots=True)
class PingReq:
    seq: int
    target: str
    addr: Addr  # where the helper should ping `target`
    source: str
    updates: tuple[Update, ...] = ()


@dataclass(frozen=True, slots=True)
class Rumor:
    source: str
    updates: tuple[Update, ...] = ()


@dataclass(frozen=True, slots=True)
class PushPull:
    source: str
    entries: tuple[Entry, ...] = ()


Message = Union[Ping, Ack, Nack, PingReq, Rumor, PushPull]
Datagram = Union[Ping, Ack, Nack, PingReq, Rumor]


# -- encoding -----------------------------------------------------------------

def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _update_row(u: Update) -> list:
    code = STATE_CODES[u.kind]
    if u.kind is State.ALIVE:
        return [code, u.node_id, u.incarnation, u.addr[0], u.addr[1], u.meta]
    if u.kind is State.LEFT:
        return [code, u.node_id, u.incarnation]
    return [code, u.node_id, u.incarnation, u.source]


def _body(msg: Message) -> list:
    ups = [_update_row(u) for u in getattr(msg, "updates", ())]
    if isinstance(msg, Ping):
        return [VERSION, Type.PING, msg.seq, msg.target, msg.source, ups]
    if isinstance(msg, Ack):
        return [VERSION, Type.ACK, msg.seq, msg.source, ups]
    if isinstance(msg, Nack):
        return [VERSION, Type.NACK, msg.seq, msg.source]
    if isinstance(msg, PingReq):
        return [VERSION, Type.PING_REQ, msg.seq, msg.target, msg.addr[0], msg.addr[1], msg.source, ups]
    if isinstance(msg, Rumor):
        return [VERSION, Type.RUMOR, msg.source, ups]
    if isinstance(msg, PushPull):
        rows = [[e.node_id, e.addr[0], e.addr[1], e.incarnation, STATE_CODES[e.state], e.meta]
                for e in msg.entries]
        return [VERSION, Type.PUSH_PULL, msg.source, rows]
    raise TypeError(f"not a gossip message: {type(msg).__name__}")


def update_size(u: Update) -> int:
    """Encoded bytes `u` adds to a packet's update list."""
    return len(_pack(_update_row(u)))


def room(msg: Datagram) -> int:
    """Bytes left for updates in `msg` (sent with no updates) under PACKET_BUDGET.

    The update list's array header grows from 1 to at most 3 bytes
    (MAX_UPDATES < 65536), so 2 bytes are held back for it.
    """
    return PACKET_BUDGET - STAMP_LEN - MAC_LEN - len(_pack(_body(msg))) - 2


def check_meta(meta: Any) -> int:
    """Raise ValueError unless `meta` can travel as a member's meta; return its encoded size."""
    try:
        _meta(meta)
        size = len(_pack(meta))
    except (MalformedPacket, TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"invalid member meta: {e}") from None
    if size > MAX_META_BYTES:
        raise ValueError(f"member meta is {size} bytes encoded, over the {MAX_META_BYTES}-byte limit")
    return size


class Codec:
    """Encodes and decodes gossip packets under one (possibly empty) shared secret.

    With a secret, each encoded packet is stamped from `clock` (wall time, seconds) and
    each decoded one must pass this codec's `ReplayGuard`: one Codec per node.
    """

    def __init__(self, secret: str | bytes = "", clock: Callable[[], float] = time.time) -> None:
        self._key = secret.encode() if isinstance(secret, str) else bytes(secret)
        self._clock = clock
        self._last_stamp = 0
        self.guard = ReplayGuard()

    @property
    def authenticated(self) -> bool:
        return bool(self._key)

    def _mac(self, signed: bytes) -> bytes:
        return hmac.new(self._key, MAC_CONTEXT + signed, hashlib.sha256).digest()[:MAC_LEN]

    def _seal(self, body: bytes) -> bytes:
        """`body` stamped and MAC'd (with a secret)."""
        self._last_stamp = max(int(self._clock() * 1_000_000), self._last_stamp + 1)
        signed = body + _STAMP.pack(self._last_stamp)
        return signed + self._mac(signed)

    def encode(self, msg: Message) -> bytes:
        body = _pack(_body(msg))
        return self._seal(body) if self._key else body

    def _fresh(self, msg: Message, stamp: int | None) -> Message:
        if stamp is not None:
            self.guard.check(msg.source, stamp, self._clock())
        return msg

    def _open(self, data: bytes, limit: int) -> tuple[list, int | None]:
        if len(data) > limit:
            raise MalformedPacket(f"{len(data)} bytes, over the {limit}-byte limit")
        stamp = None
        if self._key:
            if len(data) <= STAMP_LEN + MAC_LEN:
                raise AuthFailure("packet too short to carry a stamp and a MAC")
            signed, mac = data[:-MAC_LEN], data[-MAC_LEN:]
            if not hmac.compare_digest(mac, self._mac(signed)):
                raise AuthFailure("MAC mismatch")
            body, (stamp,) = signed[:-STAMP_LEN], _STAMP.unpack(signed[-STAMP_LEN:])
        else:
            body = data
        try:
            obj = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
        except Exception as e:  # msgpack raises several types (ExtraData, FormatError, ValueError, ...)
            raise MalformedPacket(f"not msgpack: {type(e).__name__}") from None
        if not isinstance(obj, list) or len(obj) < 2:
            raise MalformedPacket("not a [version, type, ...] array")
        if obj[0] != VERSION or type(obj[0]) is not int:
            raise MalformedPacket(f"unsupported version {obj[0]!r}")
        return obj, stamp

    def decode_datagram(self, data: bytes) -> Datagram:
        """A UDP packet's message; raises MalformedPacket (AuthFailure for MAC problems, Replayed
        for a replay)."""
        obj, stamp = self._open(data, MAX_DATAGRAM)
        return self._fresh(_datagram(obj), stamp)

    def decode_frame(self, data: bytes) -> PushPull:
        """A TCP push/pull frame's message; raises MalformedPacket (AuthFailure for MAC problems,
        Replayed for a replay)."""
        obj, stamp = self._open(data, MAX_FRAME)
        if obj[1] != Type.PUSH_PULL or type(obj[1]) is not int or len(obj) != 4:
            raise MalformedPacket(f"expected a push/pull frame, got type {obj[1]!r}")
        rows = obj[3]
        if not isinstance(rows, list) or len(rows) > MAX_ENTRIES:
            raise MalformedPacket("push/pull entries must be a list of at most MAX_ENTRIES rows")
        return self._fresh(PushPull(_id(obj[2]), tuple(_entry(r) for r in rows)), stamp)


def _datagram(obj: list) -> Datagram:
    t = obj[1] if type(obj[1]) is int else None
    if t == Type.PING and len(obj) == 6:
        return Ping(_seq(obj[2]), _id(obj[3]), _id(obj[4]), _updates(obj[5]))
    if t == Type.ACK and len(obj) == 5:
        return Ack(_seq(obj[2]), _id(obj[3]), _updates(obj[4]))
    if t == Type.NACK and len(obj) == 4:
        return Nack(_seq(obj[2]), _id(obj[3]))
    if t == Type.PING_REQ and len(obj) == 8:
        return PingReq(_seq(obj[2]), _id(obj[3]), _addr(obj[4], obj[5]), _id(obj[6]), _updates(obj[7]))
    if t == Type.RUMOR and len(obj) == 4:
        return Rumor(_id(obj[2]), _updates(obj[3]))
    raise MalformedPacket(f"unknown datagram type {t!r} with {len(obj)} fields")


# -- strict field validation --------------------------------------------------

def _int(v: Any, lo: int, hi: int, what: str) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise MalformedPacket(f"{what} must be an integer in {lo}..{hi}")
    return v


def _str(v: Any, max_len: int, what: str) -> str:
    if type(v) is not str or not 0 < len(v) <= max_len:
        raise MalformedPacket(f"{what} must be a non-empty string of at most {max_len} characters")
    return v


def _seq(v: Any) -> int:
    return _int(v, 0, MAX_SEQ, "seq")


def _id(v: Any) -> str:
    return _str(v, MAX_ID_LEN, "node id")


def _inc(v: Any) -> int:
    return _int(v, 0, MAX_INCARNATION, "incarnation")


def _addr(host: Any, port: Any) -> Addr:
    return _str(host, MAX_HOST_LEN, "host"), _int(port, 1, 65535, "port")


_SCALARS = (type(None), bool, int, float, str, bytes)


def _meta(v: Any) -> dict:
    if type(v) is not dict:
        raise MalformedPacket("meta must be a map")
    _meta_value(v, 0)
    return v


def _wire_meta(v: Any) -> dict:
    """Meta as received: well-formed and within MAX_META_BYTES once re-encoded."""
    _meta(v)
    if len(_pack(v)) > MAX_META_BYTES:
        raise MalformedPacket(f"meta over {MAX_META_BYTES} bytes")
    return v


def _meta_value(v: Any, depth: int) -> None:
    if type(v) in _SCALARS:
        return
    if depth >= MAX_META_DEPTH:
        raise MalformedPacket(f"meta nested deeper than {MAX_META_DEPTH}")
    if type(v) is list:
        for x in v:
            _meta_value(x, depth + 1)
    elif type(v) is dict:
        for k, x in v.items():
            if type(k) is not str:
                raise MalformedPacket("meta keys must be strings")
            _meta_value(x, depth + 1)
    else:
        raise MalformedPacket(f"meta value of type {type(v).__name__} is not allowed")


def _updates(v: Any) -> tuple[Update, ...]:
    if type(v) is not list or len(v) > MAX_UPDATES:
        raise MalformedPacket(f"updates must be a list of at most {MAX_UPDATES}")
    return tuple(_update(r) for r in v)


def _update(r: Any) -> Update:
    if type(r) is not list or not r:
        raise MalformedPacket("an update must be a non-empty list")
    code = r[0]
    kind = STATES[code] if type(code) is int and 0 <= code < len(STATES) else None
    if kind is State.ALIVE and len(r) == 6:
        return Update(kind, _id(r[1]), _inc(r[2]), _addr(r[3], r[4]), _wire_meta(r[5]))
    if kind in (State.SUSPECT, State.DEAD) and len(r) == 4:
        return Update(kind, _id(r[1]), _inc(r[2]), source=_id(r[3]))
    if kind is State.LEFT and len(r) == 3:
        return Update(kind, _id(r[1]), _inc(r[2]))
    raise MalformedPacket(f"bad update of kind {code!r} with {len(r)} fields")


def _entry(r: Any) -> Entry:
    if type(r) is not list or len(r) != 6:
        raise MalformedPacket("a push/pull entry must be a 6-field list")
    state = STATES[_int(r[4], 0, len(STATES) - 1, "state")]
    return Entry(_id(r[0]), _addr(r[1], r[2]), _inc(r[3]), state, _wire_meta(r[5]))
