"""SLOWLOG's record of a command whose payload was received straight into the arena."""

from __future__ import annotations

from quilld.protocol.commands import build_table
from quilld.protocol.commands.observe import _slowlog_args
from quilld.tiers.puts import IntoBlock


def test_a_payload_received_into_the_arena_is_recorded_by_its_size():
    table = build_table()
    args = [b"PUT2PHASE", b"DATA", b"h" * 24, b"0", IntoBlock(None, 0, 4 << 20)]
    out = _slowlog_args(table.resolve(args), args)
    assert out[:4] == [b"PUT2PHASE", b"DATA", b"h" * 24, b"0"]
    assert out[4] == b"(4194304 bytes received into the arena)"
