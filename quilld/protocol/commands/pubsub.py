"""SUBSCRIBE and UNSUBSCRIBE, for the one channel quilld has: `__redis__:invalidate`.

quilld has no pub/sub (no PUBLISH). A RESP2 connection cannot receive pushes, so client-side
caching over RESP2 works as redis's does: a second connection subscribes to
`__redis__:invalidate` and the tracking one sends its invalidations there (`CLIENT TRACKING
ON REDIRECT <id>`, protocol/tracking.py), as pub/sub messages. These two commands are that
subscription, with redis's replies (one `subscribe`/`unsubscribe` frame per channel, with the
count of channels the connection is subscribed to: pushes in RESP3, arrays in RESP2). Any
other channel is refused (nothing would ever be published on it), the whole command unrun.
A RESP2 connection subscribed to it runs only (P|S)SUBSCRIBE, (P|S)UNSUBSCRIBE, PING (answered
`pong` as a message array), QUIT and RESET, as redis allows there (session.Subscribed).
"""

from __future__ import annotations

from quilld.errors import CommandError, echo
from quilld.protocol.replies import Push
from quilld.protocol.resp import Raw, encode
from quilld.protocol.table import CommandTable
from quilld.protocol.tracking import CHANNEL


def _frames(c, frames: list) -> Raw:
    out: list = []
    for frame in frames:
        encode(Push(frame), c.resp3, out)
    return Raw(b"".join(out))


def cmd_subscribe(c, args):
    others = [bytes(a) for a in args[1:] if bytes(a) != CHANNEL]
    if others:
        raise CommandError(f"quilld has no pub/sub: the only channel is {CHANNEL.decode()} (CLIENT TRACKING's "
                           f"invalidations, REDIRECT), not '{echo(others[0], 128)}'")
    frames = []
    for _ in args[1:]:
        c.channels.add(CHANNEL)
        frames.append((b"subscribe", CHANNEL, len(c.channels)))
    c.subscriptions_changed()
    return _frames(c, frames)


def cmd_unsubscribe(c, args):
    names = [bytes(a) for a in args[1:]] or sorted(c.channels)
    if not names:
        return _frames(c, [(b"unsubscribe", None, 0)])
    frames = []
    for name in names:
        c.channels.discard(name)
        frames.append((b"unsubscribe", name, len(c.channels)))
    c.subscriptions_changed()
    return _frames(c, frames)


def register(t: CommandTable) -> None:
    t.add("subscribe", -2, "", cmd_subscribe)
    t.add("unsubscribe", -1, "", cmd_unsubscribe)
