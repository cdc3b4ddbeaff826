"""quillwire: the RESP codec that QuillCache's clients share, sans-IO.

Two modules, both taking bytes in and giving bytes (or values) out, with no
sockets and no asyncio:

- `quillwire.encode`: `pack_command` / `encode_command`, the request encoder.
  Arguments of `LARGE_ARG` bytes or more stay the caller's own memoryviews.
- `quillwire.reply`: `ReplyReader`, which reads replies and, when a bulk
  header arrives, lets the caller name the buffer its payload lands in
  (`attach`), with `get_buffer` / `buffer_updated` so a socket can
  `recv_into` that buffer directly.

Why a separate distribution (`wire/` in the repository): the two users of this
code are quilld's peer client (server side, `quillcache`) and the Python
client library (`quillcache-client`), and the client must not depend on the
server, which pulls uvloop, aiohttp, numpy and the rest. A module copied into
both would drift (it did: there were three encoders). A tiny, pure-Python,
dependency-free package that both declare as a dependency is the one place
both can import without either importing the other. It never requires
hiredis: hiredis cannot receive a payload into a caller's buffer, which is
what this reader is for; code that only wants general replies fast can keep
using hiredis directly (quilld's `PeerConnection.call` does).

quilld's *command* parser (`quilld.protocol.resp.RespParser`) is not here:
it is the server's, with redis-compatible error text and AUTH limits.
"""

from quillwire.encode import LARGE_ARG, as_readable, encode_command, pack_command
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

__all__ = [
    "LARGE_ARG", "as_readable", "encode_command", "pack_command",
    "MAX_ARRAY_LEN", "MAX_BULK_LEN", "MAX_DEPTH", "MAX_LINE", "NEED_DATA",
    "Bulk", "ProtocolError", "ReplyError", "ReplyReader", "Status",
]
