"""The server commands' rows: INFO, CONFIG, COMMAND, MEMORY, SLOWLOG, LATENCY, MONITOR, ACL ...

Taken from redis 7.0.15's command metadata (src/commands/*.json): what COMMAND INFO and
COMMAND DOCS answer for these commands, as redis answers it.
"""

from __future__ import annotations

from dataclasses import replace

from quilld.protocol.table import Arg as A
from quilld.protocol.table import Doc as D
from quilld.protocol.table import KeySpec as K

SERVER = {
    "info": D(
        "Get information and statistics about the server", "1.0.0", "server",
        complexity="O(1)",
        flags="loading stale",
        acl="dangerous",
        tips="nondeterministic_output request_policy:all_shards response_policy:special",
        history=(("7.0.0", "Added support for taking multiple section arguments."),),
        args=(A("section", "string", flags="optional multiple"),),
    ),
    "config": D(
        "A container for server configuration commands", "2.0.0", "server",
        complexity="Depends on subcommand.",
    ),
    "config|get": D(
        "Get the values of configuration parameters", "2.0.0", "server",
        complexity="O(N) when N is the number of configuration parameters provided",
        flags="admin noscript loading stale",
        history=(("7.0.0", "Added the ability to pass multiple pattern parameters in one call"),),
        args=(A("parameter", "block", flags="multiple", args=(A("parameter", "string"),)),),
    ),
    "config|set": D(
        "Set configuration parameters to the given values", "2.0.0", "server",
        complexity="O(N) when N is the number of configuration parameters provided",
        flags="admin noscript loading stale",
        tips="request_policy:all_nodes response_policy:all_succeeded",
        history=(("7.0.0", "Added the ability to set multiple parameters in one call."),),
        args=(A("parameter_value", "block", flags="multiple", args=(A("parameter", "string"), A("value", "string"))),),
    ),
    "config|resetstat": D(
        "Reset the stats returned by INFO", "2.0.0", "server",
        complexity="O(1)",
        flags="admin noscript loading stale",
    ),
    "config|rewrite": D(
        "Rewrite the configuration file with the in memory configuration", "2.8.0", "server",
        complexity="O(1)",
        flags="admin noscript loading stale",
    ),
    "config|help": D(
        "Show helpful text about the different subcommands", "5.0.0", "server",
        complexity="O(1)",
        flags="loading stale",
    ),
    "command": D(
        "Get array of Redis command details", "2.8.13", "server",
        complexity="O(N) where N is the total number of Redis commands",
        flags="loading stale",
        acl="connection",
        tips="nondeterministic_output_order",
    ),
    "command|count": D(
        "Get total number of Redis commands", "2.8.13", "server",
        complexity="O(1)",
        flags="loading stale",
        acl="connection",
    ),
    "command|docs": D(
        "Get array of specific Redis command documentation", "7.0.0", "server",
        complexity="O(N) where N is the number of commands to look up",
        flags="loading stale",
        acl="connection",
        tips="nondeterministic_output_order",
        args=(A("command-name", "string", flags="optional multiple"),),
    ),
    "command|info": D(
        "Get array of specific Redis command details, or all when no argument is given.", "2.8.13", "server",
        complexity="O(N) where N is the number of commands to look up",
        flags="loading stale",
        acl="connection",
        tips="nondeterministic_output_order",
        history=(("7.0.0", "Allowed to be called with no argument to get info on all commands."),),
        args=(A("command-name", "string", flags="optional multiple"),),
    ),
    "command|list": D(
        "Get an array of Redis command names", "7.0.0", "server",
        complexity="O(N) where N is the total number of Redis commands",
        flags="loading stale",
        acl="connection",
        tips="nondeterministic_output_order",
        args=(
            A("filterby", "oneof", token="FILTERBY", flags="optional", args=(
                A("module-name", "string", token="MODULE"),
                A("category", "string", token="ACLCAT"),
                A("pattern", "pattern", token="PATTERN"),
            )),
        ),
    ),
    "command|getkeys": D(
        "Extract keys given a full Redis command", "2.8.13", "server",
        complexity="O(N) where N is the number of arguments to the command",
        flags="loading stale",
        acl="connection",
    ),
    "command|getkeysandflags": D(
        "Extract keys and access flags given a full Redis command", "7.0.0", "server",
        complexity="O(N) where N is the number of arguments to the command",
        flags="loading stale",
        acl="connection",
    ),
    "command|help": D(
        "Show helpful text about the different subcommands", "5.0.0", "server",
        complexity="O(1)",
        flags="loading stale",
        acl="connection",
    ),
    "dbsize": D(
        "Return the number of keys in the selected database", "1.0.0", "server",
        complexity="O(1)",
        flags="readonly fast",
        acl="keyspace",
        tips="request_policy:all_shards response_policy:agg_sum",
    ),
    "flushall": D(
        "Remove all keys from all databases", "1.0.0", "server",
        complexity="O(N) where N is the total number of keys in all databases",
        flags="write",
        acl="keyspace dangerous",
        tips="request_policy:all_shards response_policy:all_succeeded",
        history=(
            ("4.0.0", "Added the `ASYNC` flushing mode modifier."),
            ("6.2.0", "Added the `SYNC` flushing mode modifier."),
        ),
        args=(
            A("async", "oneof", flags="optional", args=(
                A("async", "pure-token", token="ASYNC", since="4.0.0"),
                A("sync", "pure-token", token="SYNC", since="6.2.0"),
            )),
        ),
    ),
    "flushdb": D(
        "Remove all keys from the current database", "1.0.0", "server",
        complexity="O(N) where N is the number of keys in the selected database",
        flags="write",
        acl="keyspace dangerous",
        tips="request_policy:all_shards response_policy:all_succeeded",
        history=(
            ("4.0.0", "Added the `ASYNC` flushing mode modifier."),
            ("6.2.0", "Added the `SYNC` flushing mode modifier."),
        ),
        args=(
            A("async", "oneof", flags="optional", args=(
                A("async", "pure-token", token="ASYNC", since="4.0.0"),
                A("sync", "pure-token", token="SYNC", since="6.2.0"),
            )),
        ),
    ),
    "time": D(
        "Return the current server time", "2.6.0", "server",
        complexity="O(1)",
        flags="loading stale fast",
        tips="nondeterministic_output",
    ),
    "memory": D(
        "A container for memory diagnostics commands", "4.0.0", "server",
        complexity="Depends on subcommand.",
    ),
    "memory|doctor": D(
        "Outputs memory problems report", "4.0.0", "server",
        complexity="O(1)",
        tips="nondeterministic_output request_policy:all_shards response_policy:special",
    ),
    "memory|help": D(
        "Show helpful text about the different subcommands", "4.0.0", "server",
        complexity="O(1)",
        flags="loading stale",
    ),
    "memory|malloc-stats": D(
        "Show allocator internal stats", "4.0.0", "server",
        complexity="Depends on how much memory is allocated, could be slow",
        tips="nondeterministic_output request_policy:all_shards response_policy:special",
    ),
    "memory|purge": D(
        "Ask the allocator to release memory", "4.0.0", "server",
        complexity="Depends on how much memory is allocated, could be slow",
        tips="request_policy:all_shards response_policy:all_succeeded",
    ),
    "memory|stats": D(
        "Show memory usage details", "4.0.0", "server",
        complexity="O(1)",
        tips="nondeterministic_output request_policy:all_shards response_policy:special",
    ),
    "memory|usage": D(
        "Estimate the memory usage of a key", "4.0.0", "server",
        complexity="O(N) where N is the number of samples.",
        flags="readonly",
        keys=(K("RO", index=2, range=(0, 1, 0)),),
        args=(A("key", "key", key_spec=0), A("count", "integer", token="SAMPLES", flags="optional")),
    ),
    "monitor": D(
        "Listen for all requests received by the server in real time", "1.0.0", "server",
        flags="admin noscript loading stale",
    ),
    "debug": D(
        "A container for debugging commands", "1.0.0", "server",
        complexity="Depends on subcommand.",
        flags="admin noscript loading stale",
        doc_flags="syscmd",
    ),
    "slowlog": D(
        "A container for slow log commands", "2.2.12", "server",
        complexity="Depends on subcommand.",
    ),
    "slowlog|get": D(
        "Get the slow log's entries", "2.2.12", "server",
        complexity="O(N) where N is the number of entries returned",
        flags="admin loading stale",
        tips="request_policy:all_nodes nondeterministic_output",
        history=(("4.0.0", "Added client IP address, port and name to the reply."),),
        args=(A("count", "integer", flags="optional"),),
    ),
    "slowlog|len": D(
        "Get the slow log's length", "2.2.12", "server",
        complexity="O(1)",
        flags="admin loading stale",
        tips="request_policy:all_nodes response_policy:agg_sum nondeterministic_output",
    ),
    "slowlog|reset": D(
        "Clear all entries from the slow log", "2.2.12", "server",
        complexity="O(N) where N is the number of entries in the slowlog",
        flags="admin loading stale",
        tips="request_policy:all_nodes response_policy:all_succeeded",
    ),
    "slowlog|help": D(
        "Show helpful text about the different subcommands", "6.2.0", "server",
        complexity="O(1)",
        flags="loading stale",
    ),
    "latency": D(
        "A container for latency diagnostics commands", "2.8.13", "server",
        complexity="Depends on subcommand.",
    ),
    "latency|latest": D(
        "Return the latest latency samples for all events.", "2.8.13", "server",
        complexity="O(1)",
        flags="admin noscript loading stale",
        tips="nondeterministic_output request_policy:all_nodes response_policy:special",
    ),
    "latency|history": D(
        "Return timestamp-latency samples for the event.", "2.8.13", "server",
        complexity="O(1)",
        flags="admin noscript loading stale",
        tips="nondeterministic_output request_policy:all_nodes response_policy:special",
        args=(A("event", "string"),),
    ),
    "latency|reset": D(
        "Reset latency data for one or more events.", "2.8.13", "server",
        complexity="O(1)",
        flags="admin noscript loading stale",
        tips="request_policy:all_nodes response_policy:all_succeeded",
        args=(A("event", "string", flags="optional multiple"),),
    ),
    "latency|doctor": D(
        "Return a human readable latency analysis report.", "2.8.13", "server",
        complexity="O(1)",
        flags="admin noscript loading stale",
        tips="nondeterministic_output request_policy:all_nodes response_policy:special",
    ),
    "latency|help": D(
        "Show helpful text about the different subcommands.", "2.8.13", "server",
        complexity="O(1)",
        flags="loading stale",
    ),
    "latency|graph": D(
        "Return a latency graph for the event.", "2.8.13", "server",
        complexity="O(1)",
        flags="admin noscript loading stale",
        tips="nondeterministic_output request_policy:all_nodes response_policy:special",
        args=(A("event", "string"),),
    ),
    "latency|histogram": D(
        "Return the cumulative distribution of latencies of a subset of commands or all.", "7.0.0", "server",
        complexity="O(N) where N is the number of commands with latency information being retrieved.",
        flags="admin noscript loading stale",
        tips="nondeterministic_output request_policy:all_nodes response_policy:special",
        args=(A("COMMAND", "string", flags="optional multiple"),),
    ),
    "acl": D(
        "A container for Access List Control commands ", "6.0.0", "server",
        complexity="Depends on subcommand.",
    ),
    "acl|whoami": D(
        "Return the name of the user associated to the current connection", "6.0.0", "server",
        complexity="O(1)",
        flags="noscript loading stale",
    ),
    "acl|users": D(
        "List the username of all the configured ACL rules", "6.0.0", "server",
        complexity="O(N). Where N is the number of configured users.",
        flags="admin noscript loading stale",
    ),
    "acl|cat": D(
        "List the ACL categories or the commands inside a category", "6.0.0", "server",
        complexity="O(1) since the categories and commands are a fixed set.",
        flags="noscript loading stale",
        args=(A("categoryname", "string", flags="optional"),),
    ),
    "acl|help": D(
        "Show helpful text about the different subcommands", "6.0.0", "server",
        complexity="O(1)",
        flags="loading stale",
    ),
    "acl|setuser": D(
        "Modify or create the rules for a specific ACL user", "6.0.0", "server",
        complexity="O(N). Where N is the number of rules provided.",
        flags="admin noscript loading stale",
        history=(
            ("6.2.0", "Added Pub/Sub channel patterns."),
            ("7.0.0", "Added selectors and key based permissions."),
        ),
        args=(
            A("username", "string"),
            A("rule", "string", flags="optional multiple"),
        ),
    ),
    "acl|getuser": D(
        "Get the rules for a specific ACL user", "6.0.0", "server",
        complexity="O(N). Where N is the number of password, command and pattern rules that the user has.",
        flags="admin noscript loading stale",
        history=(
            ("6.2.0", "Added Pub/Sub channel patterns."),
            ("7.0.0", "Added selectors and changed the format of key and channel patterns from a list to their rule "
                      "representation."),
        ),
        args=(
            A("username", "string"),
        ),
    ),
    "acl|deluser": D(
        "Remove the specified ACL users and the associated rules", "6.0.0", "server",
        complexity="O(1) amortized time considering the typical user.",
        flags="admin noscript loading stale",
        args=(
            A("username", "string", flags="multiple"),
        ),
    ),
    "acl|list": D(
        "List the current ACL rules in ACL config file format", "6.0.0", "server",
        complexity="O(N). Where N is the number of configured users.",
        flags="admin noscript loading stale",
    ),
    "acl|genpass": D(
        "Generate a pseudorandom secure password to use for ACL users", "6.0.0", "server",
        complexity="O(1)",
        flags="noscript loading stale",
        args=(
            A("bits", "integer", flags="optional"),
        ),
    ),
    "acl|dryrun": D(
        "Returns whether the user can execute the given command without executing the command.", "7.0.0", "server",
        complexity="O(1).",
        flags="admin noscript loading stale",
        args=(
            A("username", "string"),
            A("command", "string"),
            A("arg", "string", flags="optional multiple"),
        ),
    ),
    "acl|load": D(
        "Reload the ACLs from the configured ACL file", "6.0.0", "server",
        complexity="O(N). Where N is the number of configured users.",
        flags="admin noscript loading stale",
    ),
    "acl|save": D(
        "Save the current ACL rules in the configured ACL file", "6.0.0", "server",
        complexity="O(N). Where N is the number of configured users.",
        flags="admin noscript loading stale",
    ),
}

SENSITIVE_CONFIGS = (b"requirepass", b"masterauth")  # values CONFIG SET never shows in MONITOR or the slowlog


def _config_secret(argv: list) -> list[int]:
    return [i + 1 for i in range(2, len(argv) - 1, 2) if bytes(argv[i]).lower() in SENSITIVE_CONFIGS]


SERVER["config|set"] = replace(SERVER["config|set"], redact=_config_secret)
SERVER["acl|setuser"] = replace(SERVER["acl|setuser"], redact=lambda argv: list(range(2, len(argv))))  # as redis
