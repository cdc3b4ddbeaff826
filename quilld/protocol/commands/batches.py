"""Batched block writes: many whole blocks in one command, one dispatch, one reply.

`MPUTBLK key crc32c bytes [key crc32c bytes ...]` is `PUT2PHASE PUT` for N blocks at once:
each block is received straight into its own arena block as it arrives (`large_target` in
blocks.py reserves one per block argument of 16 KiB or more), then each is checked against
its CRC32C and published whole. The reply is an array, per block in order: `+OK` (stored),
`+EXISTS` (the key was complete already: its value is kept, the bytes sent are dropped) or
that block's error (`-CHECKSUM ...`, `-OOM ...`); one block's error stores nothing of it and
does not stop the others. A block whose reservation fails while the command is received (the
arena full of what cannot go) fails the whole command with that error before anything of it
is stored, as a failing BEGIN stored nothing of a round.

The batched read needs no command of its own: `MGET key [key ...]` already answers every key in
one reply, each block written from the arena (pinned until sent), and a key only on SSD read
back first; quillclient's `get_many_into` reads it straight into the caller's buffers. Over the
unix socket the in-place forms are `SHM RESERVE` and `SHM COMMIT` (shm.py).
"""

from __future__ import annotations

from quilld.errors import CommandError, QuillError
from quilld.protocol.commands.common import acked, parse_int
from quilld.protocol.resp import OK, Status
from quilld.protocol.table import WRITE, CommandTable

EXISTS = Status(b"EXISTS")


def is_block_arg(index: int) -> bool:
    """Whether MPUTBLK's argument at `index` is a block (key crc32c bytes, repeated)."""
    return index >= 3 and index % 3 == 0


def crc_arg(raw) -> int:
    crc = parse_int(raw)
    if not 0 <= crc < 1 << 32:
        raise CommandError("CRC32C must be an unsigned 32-bit integer")
    return crc


def cmd_mputblk(c, args):
    if (len(args) - 1) % 3:
        raise CommandError("wrong number of arguments for 'mputblk' command")
    crcs = [crc_arg(args[i]) for i in range(2, len(args), 3)]  # all parsed before anything is stored
    puts, tag, user = c.puts, c.tag, c.user
    out: list = []
    for n, i in enumerate(range(1, len(args), 3)):
        try:
            out.append(OK if puts.put_whole(tag, bytes(args[i]), user, args[i + 2], crcs[n]) else EXISTS)
        except QuillError as e:  # this block only: the others go on (its reserved block is given back)
            out.append(e)
    store = c.keyspace
    return acked(store, out) if store.unsynced else out  # over values on SSD: once their deletion is durable


def register(t: CommandTable) -> None:
    t.add("mputblk", -4, WRITE, cmd_mputblk, keys=(1, -1, 3))
