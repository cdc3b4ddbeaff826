"""Command families, one module each; `build_table()` assembles the command table."""

from quilld.protocol.commands import admin, bits, blocks, cluster, connection, keys, route, strings
from quilld.protocol.table import CommandTable


def build_table() -> CommandTable:
    table = CommandTable()
    for family in (connection, strings, bits, keys, blocks, route, admin, cluster):
        family.register(table)
    return table
