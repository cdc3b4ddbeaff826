"""Command families, one module each; `build_table()` assembles the command table."""

from quilld.protocol.table import CommandTable


def build_table() -> CommandTable:
    from quilld.protocol.commands import admin, blocks, cluster, connection, route, strings

    table = CommandTable()
    for family in (connection, strings, blocks, route, admin, cluster):
        family.register(table)
    return table
