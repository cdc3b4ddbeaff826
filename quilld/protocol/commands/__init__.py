"""Command families, one module each; `build_table()` assembles the command table."""

from quilld.protocol.commands import (acl, admin, batches, bits, blocks, client, cluster, command_docs, config_cmd,
                                     connection, debug, dump, keys, multi, observe, pubsub, route, shm, strings)
from quilld.protocol.commands.catalogue import DOCS
from quilld.protocol.table import CommandTable


def build_table() -> CommandTable:
    """Every family's rows, each with what COMMAND tells about it (catalogue/)."""
    table = CommandTable(DOCS)
    for family in (connection, client, strings, bits, keys, dump, blocks, batches, route, admin, acl, config_cmd,
                   command_docs, observe, cluster, shm, debug, multi, pubsub):
        family.register(table)
    table.release_args = blocks.release_args  # for the queued commands of a transaction that ends unrun
    return table
