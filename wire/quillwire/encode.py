"""RESP request encoding: no large payload is ever copied here.

`pack_command` turns arguments into a list of pieces for `sendall` (or a
`writelines`): small arguments are joined into one bytes object, while an
argument of `LARGE_ARG` bytes or more is passed through as the caller's own
memoryview, so a 4 MiB block goes from the caller's buffer to the socket
untouched. `encode_command` is the same, joined into one bytes object, for
small commands and for tests.

Arguments: bytes as they are; str as UTF-8; int in decimal; float as its
`repr`; anything with the buffer protocol (bytearray, memoryview, numpy
arrays, mmap) as its bytes. A bool is refused (is `True` "1" or "True"?), as
is any other type.
"""

from __future__ import annotations

LARGE_ARG = 16 * 1024  # quilld receives bulks of 16 KiB or more straight into the arena; same cut here


def as_readable(data) -> memoryview:
    """A flat byte view of anything exposing the buffer protocol (bytes, bytearray, numpy, mmap)."""
    view = data if isinstance(data, memoryview) else memoryview(data)
    if not view.c_contiguous:
        raise ValueError("the data must be C-contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def encode_arg(arg) -> bytes | memoryview:
    """One argument as bytes, or as a flat memoryview of the caller's buffer."""
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
    """RESP multibulk pieces; arguments of LARGE_ARG bytes or more stay the caller's memory."""
    if not args:
        raise ValueError("a command needs at least one argument")
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


def encode_command(*args) -> bytes:
    """The whole command as one bytes object (large arguments are copied into it)."""
    return b"".join(pack_command(*args))
