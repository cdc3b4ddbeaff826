"""The generic keyspace commands' rows.

Taken from redis 7.0.15's command metadata (src/commands/*.json): what COMMAND INFO and
COMMAND DOCS answer for these commands, as redis answers it.
"""

from __future__ import annotations

from quilld.protocol.table import Arg as A
from quilld.protocol.table import Doc as D
from quilld.protocol.table import KeySpec as K

GENERIC = {
    "exists": D(
        "Determine if a key exists", "1.0.0", "generic",
        complexity="O(N) where N is the number of keys to check.",
        flags="readonly fast",
        acl="keyspace",
        tips="request_policy:multi_shard response_policy:agg_sum",
        history=(("3.0.3", "Accepts multiple `key` arguments."),),
        keys=(K("RO", index=1, range=(-1, 1, 0)),),
        args=(A("key", "key", key_spec=0, flags="multiple"),),
    ),
    "del": D(
        "Delete a key", "1.0.0", "generic",
        complexity=(
            "O(N) where N is the number of keys that will be removed. When a key to remove holds a value other than "
            "a string, the individual complexity for this key is O(M) where M is the number of elements in the list, "
            "set, sorted set or hash. Removing a single key that holds a string value is O(1)."
        ),
        flags="write",
        acl="keyspace",
        tips="request_policy:multi_shard response_policy:agg_sum",
        keys=(K("RM delete", index=1, range=(-1, 1, 0)),),
        args=(A("key", "key", key_spec=0, flags="multiple"),),
    ),
    "unlink": D(
        (
            "Delete a key asynchronously in another thread. Otherwise it is just as DEL, but non blocking."
        ), "4.0.0", "generic",
        complexity=(
            "O(1) for each key removed regardless of its size. Then the command does O(N) work in a different thread "
            "in order to reclaim memory, where N is the number of allocations the deleted objects where composed of."
        ),
        flags="write fast",
        acl="keyspace",
        tips="request_policy:multi_shard response_policy:agg_sum",
        keys=(K("RM delete", index=1, range=(-1, 1, 0)),),
        args=(A("key", "key", key_spec=0, flags="multiple"),),
    ),
    "type": D(
        "Determine the type stored at key", "1.0.0", "generic",
        complexity="O(1)",
        flags="readonly fast",
        acl="keyspace",
        keys=(K("RO", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0),),
    ),
    "ttl": D(
        "Get the time to live for a key in seconds", "1.0.0", "generic",
        complexity="O(1)",
        flags="readonly fast",
        acl="keyspace",
        tips="nondeterministic_output",
        history=(("2.8.0", "Added the -2 reply."),),
        keys=(K("RO access", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0),),
    ),
    "pttl": D(
        "Get the time to live for a key in milliseconds", "2.6.0", "generic",
        complexity="O(1)",
        flags="readonly fast",
        acl="keyspace",
        tips="nondeterministic_output",
        history=(("2.8.0", "Added the -2 reply."),),
        keys=(K("RO access", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0),),
    ),
    "expire": D(
        "Set a key's time to live in seconds", "1.0.0", "generic",
        complexity="O(1)",
        flags="write fast",
        acl="keyspace",
        history=(("7.0.0", "Added options: `NX`, `XX`, `GT` and `LT`."),),
        keys=(K("RW update", index=1, range=(0, 1, 0)),),
        args=(
            A("key", "key", key_spec=0),
            A("seconds", "integer"),
            A("condition", "oneof", flags="optional", since="7.0.0", args=(
                A("nx", "pure-token", token="NX"),
                A("xx", "pure-token", token="XX"),
                A("gt", "pure-token", token="GT"),
                A("lt", "pure-token", token="LT"),
            )),
        ),
    ),
    "pexpire": D(
        "Set a key's time to live in milliseconds", "2.6.0", "generic",
        complexity="O(1)",
        flags="write fast",
        acl="keyspace",
        history=(("7.0.0", "Added options: `NX`, `XX`, `GT` and `LT`."),),
        keys=(K("RW update", index=1, range=(0, 1, 0)),),
        args=(
            A("key", "key", key_spec=0),
            A("milliseconds", "integer"),
            A("condition", "oneof", flags="optional", since="7.0.0", args=(
                A("nx", "pure-token", token="NX"),
                A("xx", "pure-token", token="XX"),
                A("gt", "pure-token", token="GT"),
                A("lt", "pure-token", token="LT"),
            )),
        ),
    ),
    "expireat": D(
        "Set the expiration for a key as a UNIX timestamp", "1.2.0", "generic",
        complexity="O(1)",
        flags="write fast",
        acl="keyspace",
        history=(("7.0.0", "Added options: `NX`, `XX`, `GT` and `LT`."),),
        keys=(K("RW update", index=1, range=(0, 1, 0)),),
        args=(
            A("key", "key", key_spec=0),
            A("unix-time-seconds", "unix-time"),
            A("condition", "oneof", flags="optional", since="7.0.0", args=(
                A("nx", "pure-token", token="NX"),
                A("xx", "pure-token", token="XX"),
                A("gt", "pure-token", token="GT"),
                A("lt", "pure-token", token="LT"),
            )),
        ),
    ),
    "pexpireat": D(
        "Set the expiration for a key as a UNIX timestamp specified in milliseconds", "2.6.0", "generic",
        complexity="O(1)",
        flags="write fast",
        acl="keyspace",
        history=(("7.0.0", "Added options: `NX`, `XX`, `GT` and `LT`."),),
        keys=(K("RW update", index=1, range=(0, 1, 0)),),
        args=(
            A("key", "key", key_spec=0),
            A("unix-time-milliseconds", "unix-time"),
            A("condition", "oneof", flags="optional", since="7.0.0", args=(
                A("nx", "pure-token", token="NX"),
                A("xx", "pure-token", token="XX"),
                A("gt", "pure-token", token="GT"),
                A("lt", "pure-token", token="LT"),
            )),
        ),
    ),
    "persist": D(
        "Remove the expiration from a key", "2.2.0", "generic",
        complexity="O(1)",
        flags="write fast",
        acl="keyspace",
        keys=(K("RW update", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0),),
    ),
    "expiretime": D(
        "Get the expiration Unix timestamp for a key", "7.0.0", "generic",
        complexity="O(1)",
        flags="readonly fast",
        acl="keyspace",
        keys=(K("RO access", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0),),
    ),
    "pexpiretime": D(
        "Get the expiration Unix timestamp for a key in milliseconds", "7.0.0", "generic",
        complexity="O(1)",
        flags="readonly fast",
        acl="keyspace",
        keys=(K("RO access", index=1, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0),),
    ),
    "touch": D(
        "Alters the last access time of a key(s). Returns the number of existing keys specified.", "3.2.1", "generic",
        complexity="O(N) where N is the number of keys that will be touched.",
        flags="readonly fast",
        acl="keyspace",
        tips="request_policy:multi_shard response_policy:agg_sum",
        keys=(K("RO", index=1, range=(-1, 1, 0)),),
        args=(A("key", "key", key_spec=0, flags="multiple"),),
    ),
    "keys": D(
        "Find all keys matching the given pattern", "1.0.0", "generic",
        complexity=(
            "O(N) with N being the number of keys in the database, under the assumption that the key names in the "
            "database and the given pattern have limited length."
        ),
        flags="readonly",
        acl="keyspace dangerous",
        tips="request_policy:all_shards nondeterministic_output_order",
        args=(A("pattern", "pattern"),),
    ),
    "scan": D(
        "Incrementally iterate the keys space", "2.8.0", "generic",
        complexity=(
            "O(1) for every call. O(N) for a complete iteration, including enough command calls for the cursor to "
            "return back to 0. N is the number of elements inside the collection."
        ),
        flags="readonly",
        acl="keyspace",
        tips="nondeterministic_output request_policy:special",
        history=(("6.0.0", "Added the `TYPE` subcommand."),),
        args=(
            A("cursor", "integer"),
            A("pattern", "pattern", token="MATCH", flags="optional"),
            A("count", "integer", token="COUNT", flags="optional"),
            A("type", "string", token="TYPE", flags="optional", since="6.0.0"),
        ),
    ),
    "randomkey": D(
        "Return a random key from the keyspace", "1.0.0", "generic",
        complexity="O(1)",
        flags="readonly",
        acl="keyspace",
        tips="request_policy:all_shards nondeterministic_output",
    ),
    "rename": D(
        "Rename a key", "1.0.0", "generic",
        complexity="O(1)",
        flags="write",
        acl="keyspace",
        keys=(K("RW access delete", index=1, range=(0, 1, 0)), K("OW update", index=2, range=(0, 1, 0))),
        args=(A("key", "key", key_spec=0), A("newkey", "key", key_spec=1)),
    ),
    "renamenx": D(
        "Rename a key, only if the new key does not exist", "1.0.0", "generic",
        complexity="O(1)",
        flags="write fast",
        acl="keyspace",
        history=(("3.2.0", "The command no longer returns an error when source and destination names are the same."),),
        keys=(K("RW access delete", index=1, range=(0, 1, 0)), K("OW insert", index=2, range=(0, 1, 0))),
        args=(A("key", "key", key_spec=0), A("newkey", "key", key_spec=1)),
    ),
    "copy": D(
        "Copy a key", "6.2.0", "generic",
        complexity="O(N) worst case for collections, where N is the number of nested items. O(1) for string values.",
        flags="write denyoom",
        acl="keyspace",
        keys=(K("RO access", index=1, range=(0, 1, 0)), K("OW update", index=2, range=(0, 1, 0))),
        args=(
            A("source", "key", key_spec=0),
            A("destination", "key", key_spec=1),
            A("destination-db", "integer", token="DB", flags="optional"),
            A("replace", "pure-token", token="REPLACE", flags="optional"),
        ),
    ),
    "object": D(
        "A container for object introspection commands", "2.2.3", "generic",
        complexity="Depends on subcommand.",
    ),
    "object|encoding": D(
        "Inspect the internal encoding of a Redis object", "2.2.3", "generic",
        complexity="O(1)",
        flags="readonly",
        acl="keyspace",
        tips="nondeterministic_output",
        keys=(K("RO", index=2, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0),),
    ),
    "object|freq": D(
        "Get the logarithmic access frequency counter of a Redis object", "4.0.0", "generic",
        complexity="O(1)",
        flags="readonly",
        acl="keyspace",
        tips="nondeterministic_output",
        keys=(K("RO", index=2, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0),),
    ),
    "object|help": D(
        "Show helpful text about the different subcommands", "6.2.0", "generic",
        complexity="O(1)",
        flags="loading stale",
        acl="keyspace",
    ),
    "object|idletime": D(
        "Get the time since a Redis object was last accessed", "2.2.3", "generic",
        complexity="O(1)",
        flags="readonly",
        acl="keyspace",
        tips="nondeterministic_output",
        keys=(K("RO", index=2, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0),),
    ),
    "object|refcount": D(
        "Get the number of references to the value of the key", "2.2.3", "generic",
        complexity="O(1)",
        flags="readonly",
        acl="keyspace",
        tips="nondeterministic_output",
        keys=(K("RO", index=2, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0),),
    ),
    "dump": D(
        "Return a serialized version of the value stored at the specified key.", "2.6.0", "generic",
        complexity=(
            "O(1) to access the key and additional O(N*M) to serialize it, where N is the number of Redis objects "
            "composing the value and M their average size. For small string values the time complexity is thus "
            "O(1)+O(1*M) where M is small, so simply O(1)."
        ),
        flags="readonly",
        acl="keyspace",
        tips="nondeterministic_output",
        keys=(K("RO access", index=1, range=(0, 1, 0)),),
        args=(
            A("key", "key", key_spec=0),
        ),
    ),
    "restore": D(
        "Create a key using the provided serialized value, previously obtained using DUMP.", "2.6.0", "generic",
        complexity=(
            "O(1) to create the new key and additional O(N*M) to reconstruct the serialized value, where N is the "
            "number of Redis objects composing the value and M their average size. For small string values the time "
            "complexity is thus O(1)+O(1*M) where M is small, so simply O(1). However for sorted set values the "
            "complexity is O(N*M*log(N)) because inserting values into sorted sets is O(log(N))."
        ),
        flags="write denyoom",
        acl="keyspace dangerous",
        history=(
            ("3.0.0", "Added the `REPLACE` modifier."),
            ("5.0.0", "Added the `ABSTTL` modifier."),
            ("5.0.0", "Added the `IDLETIME` and `FREQ` options."),
        ),
        keys=(K("OW update", index=1, range=(0, 1, 0)),),
        args=(
            A("key", "key", key_spec=0),
            A("ttl", "integer"),
            A("serialized-value", "string"),
            A("replace", "pure-token", token="REPLACE", flags="optional", since="3.0.0"),
            A("absttl", "pure-token", token="ABSTTL", flags="optional", since="5.0.0"),
            A("seconds", "integer", token="IDLETIME", flags="optional", since="5.0.0"),
            A("frequency", "integer", token="FREQ", flags="optional", since="5.0.0"),
        ),
    ),
}
