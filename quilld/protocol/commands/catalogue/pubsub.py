"""The pub/sub commands quilld serves (SUBSCRIBE, UNSUBSCRIBE: the tracking channel only):
redis 7.0.15's command metadata (src/commands/*.json)."""

from __future__ import annotations

from quilld.protocol.table import Arg as A
from quilld.protocol.table import Doc as D

PUBSUB = {
    "subscribe": D(
        "Listen for messages published to the given channels", "2.0.0", "pubsub",
        complexity="O(N) where N is the number of channels to subscribe to.",
        flags="pubsub noscript loading stale",
        args=(A("channel", "string", flags="multiple"),),
    ),
    "unsubscribe": D(
        "Stop listening for messages posted to the given channels", "2.0.0", "pubsub",
        complexity="O(N) where N is the number of clients already subscribed to a channel.",
        flags="pubsub noscript loading stale",
        args=(A("channel", "string", flags="optional multiple"),),
    ),
}
