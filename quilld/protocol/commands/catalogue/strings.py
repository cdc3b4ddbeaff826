"""The string and bitmap commands' rows.

Taken from redis 7.0.15's command metadata (src/commands/*.json): what COMMAND INFO and
COMMAND DOCS answer for these commands, as redis answers it.
"""

from __future__ import annotations

from dataclasses import replace

from quilld.protocol.table import Arg as A
from quilld.protocol.table import Doc as D
from quilld.protocol.table import KeySpec as K

STRING = {
    "get": D(
        "Get the value of a key", "1.0.0", "string",
        complexity="O(1)",
        flags="readonly fast",
        acl="string",
        keys=(K("RO access", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0),),
    ),
    "set": D(
        "Set the string value of a key", "1.0.0", "string",
        complexity="O(1)",
        flags="write denyoom",
        acl="string",
        history=(
            ("2.6.12", "Added the `EX`, `PX`, `NX` and `XX` options."),
            ("6.0.0", "Added the `KEEPTTL` option."),
            ("6.2.0", "Added the `GET`, `EXAT` and `PXAT` option."),
            ("7.0.0", "Allowed the `NX` and `GET` options to be used together."),
        ),
        keys=(
            K("RW access update variable_flags", index=1, range=(0, 1, 0),
              notes="RW and ACCESS due to the optional `GET` argument"),
        ),
        args=(
            A("key", "key", key_spec=0),
            A("value", "string"),
            A("condition", "oneof", flags="optional", since="2.6.12", args=(
                A("nx", "pure-token", token="NX"),
                A("xx", "pure-token", token="XX"),
            )),
            A("get", "pure-token", token="GET", flags="optional", since="6.2.0"),
            A("expiration", "oneof", flags="optional", args=(
                A("seconds", "integer", token="EX", since="2.6.12"),
                A("milliseconds", "integer", token="PX", since="2.6.12"),
                A("unix-time-seconds", "unix-time", token="EXAT", since="6.2.0"),
                A("unix-time-milliseconds", "unix-time", token="PXAT", since="6.2.0"),
                A("keepttl", "pure-token", token="KEEPTTL", since="6.0.0"),
            )),
        ),
    ),
    "mget": D(
        "Get the values of all the given keys", "1.0.0", "string",
        complexity="O(N) where N is the number of keys to retrieve.",
        flags="readonly fast",
        acl="string",
        tips="request_policy:multi_shard",
        keys=(K("RO access", index=1, range=(-1, 1, 0)),),
        args=(A("key", "key", key_spec=0, flags="multiple"),),
    ),
    "mset": D(
        "Set multiple keys to multiple values", "1.0.1", "string",
        complexity="O(N) where N is the number of keys to set.",
        flags="write denyoom",
        acl="string",
        tips="request_policy:multi_shard response_policy:all_succeeded",
        keys=(K("OW update", index=1, range=(-1, 2, 0)),),
        args=(A("key_value", "block", flags="multiple", args=(A("key", "key", key_spec=0), A("value", "string"))),),
    ),
    "strlen": D(
        "Get the length of the value stored in a key", "2.2.0", "string",
        complexity="O(1)",
        flags="readonly fast",
        acl="string",
        keys=(K("RO", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0),),
    ),
    "append": D(
        "Append a value to a key", "2.0.0", "string",
        complexity=(
            "O(1). The amortized time complexity is O(1) assuming the appended value is small and the already "
            "present value is of any size, since the dynamic string library used by Redis will double the free space "
            "available on every reallocation."
        ),
        flags="write denyoom fast",
        acl="string",
        keys=(K("RW insert", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0), A("value", "string")),
    ),
    "decr": D(
        "Decrement the integer value of a key by one", "1.0.0", "string",
        complexity="O(1)",
        flags="write denyoom fast",
        acl="string",
        keys=(K("RW access update", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0),),
    ),
    "decrby": D(
        "Decrement the integer value of a key by the given number", "1.0.0", "string",
        complexity="O(1)",
        flags="write denyoom fast",
        acl="string",
        keys=(K("RW access update", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0), A("decrement", "integer")),
    ),
    "getdel": D(
        "Get the value of a key and delete the key", "6.2.0", "string",
        complexity="O(1)",
        flags="write fast",
        acl="string",
        keys=(K("RW access delete", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0),),
    ),
    "getex": D(
        "Get the value of a key and optionally set its expiration", "6.2.0", "string",
        complexity="O(1)",
        flags="write fast",
        acl="string",
        keys=(K("RW access update", index=1, range=(0, 1, 0), notes="RW and UPDATE because it changes the TTL"),),
        args=(
            A("key", "key", key_spec=0),
            A("expiration", "oneof", flags="optional", args=(
                A("seconds", "integer", token="EX"),
                A("milliseconds", "integer", token="PX"),
                A("unix-time-seconds", "unix-time", token="EXAT"),
                A("unix-time-milliseconds", "unix-time", token="PXAT"),
                A("persist", "pure-token", token="PERSIST"),
            )),
        ),
    ),
    "getrange": D(
        "Get a substring of the string stored at a key", "2.4.0", "string",
        complexity=(
            "O(N) where N is the length of the returned string. The complexity is ultimately determined by the "
            "returned length, but because creating a substring from an existing string is very cheap, it can be "
            "considered O(1) for small strings."
        ),
        flags="readonly",
        acl="string",
        keys=(K("RO access", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0), A("start", "integer"), A("end", "integer")),
    ),
    "getset": D(
        "Set the string value of a key and return its old value", "1.0.0", "string",
        complexity="O(1)",
        flags="write denyoom fast",
        acl="string",
        doc_flags="deprecated",
        deprecated_since="6.2.0",
        replaced_by="`SET` with the `!GET` argument",
        keys=(K("RW access update", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0), A("value", "string")),
    ),
    "incr": D(
        "Increment the integer value of a key by one", "1.0.0", "string",
        complexity="O(1)",
        flags="write denyoom fast",
        acl="string",
        keys=(K("RW access update", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0),),
    ),
    "incrby": D(
        "Increment the integer value of a key by the given amount", "1.0.0", "string",
        complexity="O(1)",
        flags="write denyoom fast",
        acl="string",
        keys=(K("RW access update", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0), A("increment", "integer")),
    ),
    "incrbyfloat": D(
        "Increment the float value of a key by the given amount", "2.6.0", "string",
        complexity="O(1)",
        flags="write denyoom fast",
        acl="string",
        keys=(K("RW access update", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0), A("increment", "double")),
    ),
    "lcs": D(
        "Find longest common substring", "7.0.0", "string",
        complexity="O(N*M) where N and M are the lengths of s1 and s2, respectively",
        flags="readonly",
        acl="string",
        keys=(K("RO access", index=1, range=(1, 1, 0)),),
        args=(
            A("key1", "key", key_spec=0),
            A("key2", "key", key_spec=0),
            A("len", "pure-token", token="LEN", flags="optional"),
            A("idx", "pure-token", token="IDX", flags="optional"),
            A("len", "integer", token="MINMATCHLEN", flags="optional"),
            A("withmatchlen", "pure-token", token="WITHMATCHLEN", flags="optional"),
        ),
    ),
    "msetnx": D(
        "Set multiple keys to multiple values, only if none of the keys exist", "1.0.1", "string",
        complexity="O(N) where N is the number of keys to set.",
        flags="write denyoom",
        acl="string",
        tips="request_policy:multi_shard response_policy:agg_min",
        keys=(K("OW insert", index=1, range=(-1, 2, 0)),),
        args=(A("key_value", "block", flags="multiple", args=(A("key", "key", key_spec=0), A("value", "string"))),),
    ),
    "psetex": D(
        "Set the value and expiration in milliseconds of a key", "2.6.0", "string",
        complexity="O(1)",
        flags="write denyoom",
        acl="string",
        keys=(K("OW update", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0), A("milliseconds", "integer"), A("value", "string")),
    ),
    "setex": D(
        "Set the value and expiration of a key", "2.0.0", "string",
        complexity="O(1)",
        flags="write denyoom",
        acl="string",
        keys=(K("OW update", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0), A("seconds", "integer"), A("value", "string")),
    ),
    "setnx": D(
        "Set the value of a key, only if the key does not exist", "1.0.0", "string",
        complexity="O(1)",
        flags="write denyoom fast",
        acl="string",
        keys=(K("OW insert", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0), A("value", "string")),
    ),
    "setrange": D(
        "Overwrite part of a string at key starting at the specified offset", "2.2.0", "string",
        complexity=(
            "O(1), not counting the time taken to copy the new string in place. Usually, this string is very small "
            "so the amortized complexity is O(1). Otherwise, complexity is O(M) with M being the length of the value "
            "argument."
        ),
        flags="write denyoom",
        acl="string",
        keys=(K("RW update", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0), A("offset", "integer"), A("value", "string")),
    ),
    "substr": D(
        "Get a substring of the string stored at a key", "1.0.0", "string",
        complexity=(
            "O(N) where N is the length of the returned string. The complexity is ultimately determined by the "
            "returned length, but because creating a substring from an existing string is very cheap, it can be "
            "considered O(1) for small strings."
        ),
        flags="readonly",
        acl="string",
        doc_flags="deprecated",
        deprecated_since="2.0.0",
        replaced_by="`GETRANGE`",
        keys=(K("RO access", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0), A("start", "integer"), A("end", "integer")),
    ),
    "setbit": D(
        "Sets or clears the bit at offset in the string value stored at key", "2.2.0", "bitmap",
        complexity="O(1)",
        flags="write denyoom",
        acl="bitmap",
        keys=(K("RW access update", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0), A("offset", "integer"), A("value", "integer")),
    ),
    "getbit": D(
        "Returns the bit value at offset in the string value stored at key", "2.2.0", "bitmap",
        complexity="O(1)",
        flags="readonly fast",
        acl="bitmap",
        keys=(K("RO access", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0), A("offset", "integer")),
    ),
    "bitcount": D(
        "Count set bits in a string", "2.6.0", "bitmap",
        complexity="O(N)",
        flags="readonly",
        acl="bitmap",
        history=(("7.0.0", "Added the `BYTE|BIT` option."),),
        keys=(K("RO access", index=1, range=(0, 1, 0)),),
        args=(
            A("key", "key", key_spec=0),
            A("index", "block", flags="optional", args=(
                A("start", "integer"),
                A("end", "integer"),
                A("index_unit", "oneof", flags="optional", since="7.0.0", args=(
                    A("byte", "pure-token", token="BYTE"),
                    A("bit", "pure-token", token="BIT"),
                )),
            )),
        ),
    ),
    "bitpos": D(
        "Find first bit set or clear in a string", "2.8.7", "bitmap",
        complexity="O(N)",
        flags="readonly",
        acl="bitmap",
        history=(("7.0.0", "Added the `BYTE|BIT` option."),),
        keys=(K("RO access", index=1, range=(0, 1, 0)),),
        args=(
            A("key", "key", key_spec=0),
            A("bit", "integer"),
            A("index", "block", flags="optional", args=(
                A("start", "integer"),
                A("end_index", "block", flags="optional", args=(
                    A("end", "integer"),
                    A("index_unit", "oneof", flags="optional", since="7.0.0", args=(
                        A("byte", "pure-token", token="BYTE"),
                        A("bit", "pure-token", token="BIT"),
                    )),
                )),
            )),
        ),
    ),
    "bitop": D(
        "Perform bitwise operations between strings", "2.6.0", "bitmap",
        complexity="O(N)",
        flags="write denyoom",
        acl="bitmap",
        keys=(K("OW update", index=2, range=(0, 1, 0)), K("RO access", index=3, range=(-1, 1, 0))),
        args=(A("operation", "string"), A("destkey", "key", key_spec=0), A("key", "key", key_spec=1, flags="multiple")),
    ),
    "bitfield": D(
        "Perform arbitrary bitfield integer operations on strings", "3.2.0", "bitmap",
        complexity="O(1) for each subcommand specified",
        flags="write denyoom",
        acl="bitmap",
        keys=(
            K("RW update access variable_flags", index=1, range=(0, 1, 0),
              notes="This command allows both access and modification of the key"),
        ),
        args=(
            A("key", "key", key_spec=0),
            A("operation", "oneof", flags="optional multiple", args=(
                A("encoding_offset", "block", token="GET", args=(A("encoding", "string"), A("offset", "integer"))),
                A("write", "block", args=(
                    A("wrap_sat_fail", "oneof", token="OVERFLOW", flags="optional", args=(
                        A("wrap", "pure-token", token="WRAP"),
                        A("sat", "pure-token", token="SAT"),
                        A("fail", "pure-token", token="FAIL"),
                    )),
                    A("write_operation", "oneof", args=(
                        A("encoding_offset_value", "block", token="SET", args=(
                            A("encoding", "string"),
                            A("offset", "integer"),
                            A("value", "integer"),
                        )),
                        A("encoding_offset_increment", "block", token="INCRBY", args=(
                            A("encoding", "string"),
                            A("offset", "integer"),
                            A("increment", "integer"),
                        )),
                    )),
                )),
            )),
        ),
    ),
    "bitfield_ro": D(
        "Perform arbitrary bitfield integer operations on strings. Read-only variant of BITFIELD", "6.0.0", "bitmap",
        complexity="O(1) for each subcommand specified",
        flags="readonly fast",
        acl="bitmap",
        keys=(K("RO access", index=1, range=(0, 1, 0)),),
        args=(
            A("key", "key", key_spec=0),
            A("encoding_offset", "block", token="GET", flags="optional multiple multiple_token", args=(
                A("encoding", "string"),
                A("offset", "integer"),
            )),
        ),
    ),
}


def _set_keys(argv: list) -> list[tuple[int, str]]:
    """SET's key is read as well only with GET (redis's setGetKeys)."""
    if any(bytes(a).lower() == b"get" for a in argv[3:]):
        return [(1, "RW access update")]
    return [(1, "OW update")]


def _bitfield_keys(argv: list) -> list[tuple[int, str]]:
    """BITFIELD only reads its key when every operation is a GET (redis's bitfieldGetKeys)."""
    i, n = 2, len(argv)
    while i < n:
        op, more = bytes(argv[i]).lower(), n - i - 1
        if op == b"get" and more >= 2:
            i += 3
        elif op == b"overflow" and more >= 1:
            i += 2
        else:  # SET, INCRBY, or a syntax error: assume a write, as redis does
            return [(1, "RW access update")]
    return [(1, "RO access")]


# SET and MSET are O(1) per key and the hottest writes: timed one call in SAMPLE_EVERY, as fast commands are
STRING["set"] = replace(STRING["set"], getkeys=_set_keys, sampled=True)
STRING["mset"] = replace(STRING["mset"], sampled=True)
STRING["bitfield"] = replace(STRING["bitfield"], getkeys=_bitfield_keys)
