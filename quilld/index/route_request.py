"""A ROUTE request, typed: its fields, their checks and limits, and routing it in a caller's scope.

RESP (`ROUTE {json}` or `ROUTE key value ...`) and the admin API
(`POST /v1/route`) both turn what they received into a mapping of field name
to value and hand it to `RouteRequest.parse`; the caller's identity (scope and
tag) is theirs to supply. Fields:

- `blocks`: engine block hashes (ints, or decimal or hex strings), or
- `tokens` (+ `block_size`, default 16): token ids, chained into block hashes
  with `chain_hashes`, as quilld's clients and gateway hash them;
- `decode_tokens`: the tokens the request may generate (counted in blocks);
- `session`: requests of one session stay on one engine while it is eligible;
- `acquire`: 1/true/yes takes an in-flight lease on the chosen engine (and, for a
  disaggregated pair, a prefill lease on the prefill engine).

When the model's engines have roles, the decision carries the prefill-decode pair
(index/pairing.py); a model whose engines are all prefill engines is an error
(`NoDecodeEngine`).

Errors are `CommandError`s (ERR on RESP, 400 on HTTP) with stable texts.

RESP also takes the hashes alone, with no JSON to decode: as decimal (or hex)
arguments (`hashes_from_args`) or as one bulk of packed little-endian unsigned
64-bit ints (`hashes_from_packed`); the protocol turns its option words into the
other fields and builds the `RouteRequest` itself.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from quilld.errors import CommandError
from quilld.index.control import ControlPlane, chain_hashes
from quilld.index.residency import BlockHash
from quilld.index.router import Decision
from quilld.model import IdentityScope

# At most this many blocks per request: 1M tokens in blocks of 16, beyond any context
# window; the score walks every block for every engine.
MAX_BLOCKS = 1 << 16
# At most this many bytes in one argument of a ROUTE (its JSON, a PACKED bulk, a list of key
# value pairs): 65,536 hashes in any form fit, and so do some 200,000 token ids; a longer prompt
# is hashed by the client (ROUTE PACKED). Refused before it is read: nothing larger is decoded.
MAX_REQUEST_BYTES = 2 * 1024 * 1024
# A request with more bytes than this is decoded, checked and hashed in a worker thread, off the
# event loop (the walk is Python: the interpreter lets the loop run every few milliseconds).
LARGE_REQUEST = 64 * 1024
DEFAULT_BLOCK_SIZE = 16
MAX_TOKEN = (1 << 32) - 1  # chain_hashes packs each token id in 4 bytes
FIELDS = frozenset({"blocks", "tokens", "block_size", "decode_tokens", "session", "acquire"})
_YES = ("1", "true", "yes")
_NOT_INTEGERS = "ROUTE: tokens, block_size and decode_tokens must be integers"


def parse_block_hash(v: Any) -> BlockHash:
    """An engine block hash from a request: an int, or a decimal or hex string."""
    if isinstance(v, bool):
        raise CommandError("block hashes are integers or hex strings")
    if isinstance(v, int):
        if -(1 << 63) <= v < 1 << 64:
            return v
        raise CommandError("block hashes that are integers must fit in 64 bits")
    if isinstance(v, str):
        s = v.strip()
        if _DECIMAL.fullmatch(s):  # ASCII digits only ("²" is a digit to str.isdigit), at most 20 of them
            value = int(s)
            if -(1 << 63) <= value < 1 << 64:
                return value
            raise CommandError("block hashes that are integers must fit in 64 bits")
        try:
            return bytes.fromhex(s.removeprefix("0x"))
        except ValueError:
            pass
    shown = repr(v) if len(repr(v)) <= 80 else repr(v)[:77] + "..."
    raise CommandError(f"bad block hash {shown}: an integer or a hex string")


_DECIMAL = re.compile(r"-?[0-9]{1,20}")
_U64 = (1 << 64) - 1
_INTS = {int}


def hashes_from_args(args: list[bytes]) -> list[BlockHash]:
    """Block hashes given one per argument: unsigned decimals (the fast path, checked in C),
    else each as `parse_block_hash` takes a string (signed decimal or hex)."""
    if not args:
        return []
    joined = b"".join(args)
    if joined.isdigit() and min(map(len, args)) >= 1 and max(map(len, args)) <= 20:  # ASCII digits only
        values = list(map(int, args))
        if max(values) <= _U64:
            return values
    out = []
    for i, raw in enumerate(args):
        try:
            s = bytes(raw).decode("ascii")
        except UnicodeDecodeError:
            s = None
        if not s or not s.strip():
            raise CommandError(f"ROUTE: hash {i + 1} is not an integer or a hex string")
        try:
            out.append(parse_block_hash(s))
        except CommandError as e:
            raise CommandError(f"ROUTE: hash {i + 1}: {e.message}") from None
    return out


def hashes_from_packed(data: bytes) -> list[int]:
    """Block hashes packed as little-endian unsigned 64-bit ints, 8 bytes each."""
    n, rest = divmod(len(data), 8)
    if rest:
        raise CommandError(f"ROUTE PACKED: {len(data)} bytes is not a whole number of 8-byte hashes")
    if n > MAX_BLOCKS:
        raise CommandError(f"ROUTE: at most {MAX_BLOCKS} blocks")
    return list(struct.unpack(f"<{n}Q", data))


@dataclass(frozen=True, slots=True)
class RouteRequest:
    blocks: list[BlockHash]  # never mutated once parsed
    block_size: int = DEFAULT_BLOCK_SIZE
    decode_tokens: int = 0
    session: str | None = None
    acquire: bool = False

    @property
    def decode_blocks(self) -> float:
        """The decode tokens in blocks, as the cost function counts them."""
        return self.decode_tokens / max(self.block_size, 1)

    @classmethod
    def parse(cls, req: Mapping[str, Any]) -> RouteRequest:
        """Check a request's fields (from JSON, or RESP key value pairs as strings)."""
        unknown = set(req) - FIELDS
        if unknown:
            raise CommandError(f"ROUTE: unknown field(s) {', '.join(sorted(unknown))}")
        try:
            block_size = int(req.get("block_size", DEFAULT_BLOCK_SIZE))
            if "tokens" in req:
                if block_size <= 0:
                    raise ValueError("block_size")
                if _count(req["tokens"]) // block_size > MAX_BLOCKS:  # checked before walking them
                    raise CommandError(f"ROUTE: at most {MAX_BLOCKS} blocks")
                tokens = [int(t) for t in req["tokens"]]
                blocks = None
            else:
                tokens = None
                raw = req.get("blocks", [])
                if _count(raw) > MAX_BLOCKS:
                    raise CommandError(f"ROUTE: at most {MAX_BLOCKS} blocks")
                if type(raw) is list and raw and set(map(type, raw)) == _INTS and \
                        min(raw) >= -(1 << 63) and max(raw) <= _U64:  # JSON's ints, checked in C
                    blocks = list(raw)
                else:
                    blocks = [parse_block_hash(h) for h in raw]
            decode = int(req.get("decode_tokens", 0))
        except (TypeError, ValueError):
            raise CommandError(_NOT_INTEGERS) from None
        if tokens is not None:
            if not all(0 <= t <= MAX_TOKEN for t in tokens):
                raise CommandError(f"ROUTE: tokens must be integers from 0 to {MAX_TOKEN}")
            blocks = chain_hashes(tokens, block_size)
        if len(blocks) > MAX_BLOCKS:
            raise CommandError(f"ROUTE: at most {MAX_BLOCKS} blocks")
        session = req.get("session") or None
        return cls(blocks, block_size, decode, str(session) if session else None,
                   str(req.get("acquire", "")).lower() in _YES)


def _count(items: Any) -> int:
    """How many items a request's list holds (0 for what is not a list: its walk refuses it)."""
    return len(items) if isinstance(items, (list, tuple)) else 0


def route(control: ControlPlane, scope: IdentityScope, tag: bytes, req: RouteRequest) -> Decision:
    """Route `req` for a caller of `scope` (whose scope tag is `tag`)."""
    return control.route(scope, tag, req.blocks, req.decode_blocks, req.session, req.acquire,
                         float(max(req.block_size, 1)))
