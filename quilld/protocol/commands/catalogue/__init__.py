"""What COMMAND INFO and COMMAND DOCS tell about each command, by its full name (`client|list`).

The command table attaches a row's `Doc` when the family registers the command; a command
without one is still served, and answers COMMAND with what its row says. Each family's
commands have theirs here, split by redis's command groups (quilld's own in quillcache.py).
"""

from __future__ import annotations

from quilld.protocol.commands.catalogue.connection import CONNECTION
from quilld.protocol.commands.catalogue.generic import GENERIC
from quilld.protocol.commands.catalogue.pubsub import PUBSUB
from quilld.protocol.commands.catalogue.quillcache import QUILLCACHE
from quilld.protocol.commands.catalogue.server import SERVER
from quilld.protocol.commands.catalogue.strings import STRING
from quilld.protocol.commands.catalogue.transactions import TRANSACTIONS
from quilld.protocol.table import Doc

DOCS: dict[str, Doc] = {**CONNECTION, **STRING, **GENERIC, **SERVER, **QUILLCACHE, **TRANSACTIONS, **PUBSUB}
