"""RESP request encoding and buffer views: no payload is ever copied here.

`pack_command` turns arguments into a list of pieces for `sendall`: small
arguments are joined into one bytes object, while an argument of `LARGE_ARG`
bytes or more is passed through as the caller's own memoryview. redis-py's
hiredis packer copies every argument into one new bytes object (twice for a
memoryview); `CommandPacker` gives redis-py this function instead, so a 4 MiB
PUT2PHASE DATA chunk goes from the caller's buffer to the socket untouched.
"""

from __future__ import annotations

LARGE_ARG = 16 * 1024  # quilld receives bulks of 16 KiB or more straight into the arena; same cut here


def as_readable(data) -> memoryview:
    """A flat byte view of anything exposing the buffer protocol (bytes, bytearray, numpy, mmap)."""
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise ValueError("the data must be C-contiguous")
        view = view.cast("B")
    return view


def as_writable(buffer) -> memoryview:
    """A flat writable byte view of `buffer`; TypeError for read-only objects."""
    view = as_readable(buffer)
    if view.readonly:
        raise TypeError(f"{type(buffer).__name__} is read-only: get_into needs a writable buffer "
                        "(bytearray, numpy array, mmap, memoryview)")
    return view


def encode_arg(arg) -> bytes | memoryview:
    if isinstance(arg, bytes):
        return arg
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, bool):
        raise TypeError("a bool is not a valid command argument: pass 0/1 or a string")
    if isinstance(arg, int):
        return b"%d" % arg
    if isinstance(arg, float):
        return repr(arg).encode()
    try:
        return as_readable(arg)  # bytearray, memoryview, numpy arrays, mmap...
    except TypeError:
        raise TypeError(f"cannot send a {type(arg).__name__} as a command argument") from None


def pack_command(*args) -> list[bytes | memoryview]:
    """RESP multibulk pieces; large arguments stay the caller's memory."""
    if isinstance(args[0], str) and " " in args[0]:  # "CLIENT LIST", as redis-py's packers do
        args = tuple(args[0].split()) + args[1:]
    out: list[bytes | memoryview] = []
    head = bytearray(b"*%d\r\n" % len(args))
    for arg in args:
        value = encode_arg(arg)
        n = value.nbytes if isinstance(value, memoryview) else len(value)
        head += b"$%d\r\n" % n
        if n >= LARGE_ARG:
            out.append(bytes(head))
            out.append(value)
            head = bytearray(b"\r\n")
        else:
            head += value
            head += b"\r\n"
    out.append(bytes(head))
    return out


class CommandPacker:
    """redis-py's `command_packer` interface, backed by `pack_command`."""

    def pack(self, *args) -> list[bytes | memoryview]:
        return pack_command(*args)
