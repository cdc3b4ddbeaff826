"""Gossip packets: SWIM messages to bytes and back, with optional HMAC-SHA256.

No sockets here. `swim.py` speaks in the message classes below; the shell
(`gossip.py`) turns them into bytes with a `Codec` and back.

A packet is one msgpack array, `[VERSION, TYPE, field, ...]`. When a shared
secret is configured, the first `MAC_LEN` bytes of
HMAC-SHA256(secret, MAC_CONTEXT + body) follow the body. The MAC is checked
with `hmac.compare_digest` *before* the body is parsed, so unauthenticated
bytes never reach msgpack. There is no replay protection: a captured packet
can be replayed, and SWIM's incarnation precedence bounds what that can do
(an old ALIVE cannot undo a newer SUSPECT, DEAD or LEFT).

Decoding is strict: any wrong type, length, range or shape raises
`MalformedPacket` (a wrong or missing MAC raises its subclass
`AuthFailure`). The shell counts and drops those; nothing else escapes.

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
import hmac
from dataclasses import dataclass
from enum import Enum, IntEnum
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
MAC_CONTEXT = b"quilld-gossip-v1\0"  # domain separation: the secret may be reused elsewhere


class MalformedPacket(Exception):
    """Bytes that are not a valid gossip packet: dropped and counted, never answered."""


class AuthFailure(MalformedPacket):
    """A missing or wrong MAC (wrong secret, no secret, or tampering)."""


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
    return PACKET_BUDGET - MAC_LEN - len(_pack(_body(msg))) - 2


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
    """Encodes and decodes gossip packets under one (possibly empty) shared secret."""

    def __init__(self, secret: str | bytes = "") -> None:
        self._key = secret.encode() if isinstance(secret, str) else bytes(secret)

    @property
    def authenticated(self) -> bool:
        return bool(self._key)

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._key, MAC_CONTEXT + body, hashlib.sha256).digest()[:MAC_LEN]

    def encode(self, msg: Message) -> bytes:
        body = _pack(_body(msg))
        return body + self._mac(body) if self._key else body

    def _open(self, data: bytes, limit: int) -> list:
        if len(data) > limit:
            raise MalformedPacket(f"{len(data)} bytes, over the {limit}-byte limit")
        if self._key:
            if len(data) <= MAC_LEN:
                raise AuthFailure("packet too short to carry a MAC")
            body, mac = data[:-MAC_LEN], data[-MAC_LEN:]
            if not hmac.compare_digest(mac, self._mac(body)):
                raise AuthFailure("MAC mismatch")
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
        return obj

    def decode_datagram(self, data: bytes) -> Datagram:
        """A UDP packet's message; raises MalformedPacket (AuthFailure for MAC problems)."""
        obj = self._open(data, MAX_DATAGRAM)
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

    def decode_frame(self, data: bytes) -> PushPull:
        """A TCP push/pull frame's message; raises MalformedPacket (AuthFailure for MAC problems)."""
        obj = self._open(data, MAX_FRAME)
        if obj[1] != Type.PUSH_PULL or type(obj[1]) is not int or len(obj) != 4:
            raise MalformedPacket(f"expected a push/pull frame, got type {obj[1]!r}")
        rows = obj[3]
        if not isinstance(rows, list) or len(rows) > MAX_ENTRIES:
            raise MalformedPacket("push/pull entries must be a list of at most MAX_ENTRIES rows")
        return PushPull(_id(obj[2]), tuple(_entry(r) for r in rows))


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
