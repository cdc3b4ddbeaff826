"""The transaction commands' rows: MULTI, EXEC, DISCARD, WATCH, UNWATCH.

Taken from redis 7.0.15's command metadata (src/commands/*.json): what COMMAND INFO and
COMMAND DOCS answer for these commands, as redis answers it.
"""

from __future__ import annotations

from quilld.protocol.table import Arg as A
from quilld.protocol.table import Doc as D
from quilld.protocol.table import KeySpec as K

G = "transactions"

TRANSACTIONS = {
    "multi": D(
        "Mark the start of a transaction block", "1.2.0", G,
        complexity="O(1)",
        flags="noscript loading stale fast allow_busy",
        acl="transaction",
    ),
    "exec": D(
        "Execute all commands issued after MULTI", "1.2.0", G,
        complexity="Depends on commands in the transaction",
        flags="noscript loading stale skip_slowlog",
        acl="transaction",
    ),
    "discard": D(
        "Discard all commands issued after MULTI", "2.0.0", G,
        complexity="O(N), when N is the number of queued commands",
        flags="noscript loading stale fast allow_busy",
        acl="transaction",
    ),
    "watch": D(
        "Watch the given keys to determine execution of the MULTI/EXEC block", "2.2.0", G,
        complexity="O(1) for every key.",
        flags="noscript loading stale fast allow_busy",
        acl="transaction",
        keys=(K("RO", index=1, range=(-1, 1, 0)),),
        args=(A("key", "key", key_spec=0, flags="multiple"),),
    ),
    "unwatch": D(
        "Forget about all watched keys", "2.2.0", G,
        complexity="O(1)",
        flags="noscript loading stale fast allow_busy",
        acl="transaction",
    ),
}
