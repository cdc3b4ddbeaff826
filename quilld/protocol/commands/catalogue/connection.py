"""The connection commands' rows: PING ... CLIENT.

Taken from redis 7.0.15's command metadata (src/commands/*.json): what COMMAND INFO and
COMMAND DOCS answer for these commands, as redis answers it.
"""

from __future__ import annotations

from dataclasses import replace

from quilld.protocol.table import Arg as A
from quilld.protocol.table import Doc as D
from quilld.protocol.table import KeySpec as K

CONNECTION = {
    "ping": D(
        "Ping the server", "1.0.0", "connection",
        complexity="O(1)",
        flags="fast",
        acl="connection",
        tips="request_policy:all_shards response_policy:all_succeeded",
        args=(A("message", "string", flags="optional"),),
    ),
    "echo": D(
        "Echo the given string", "1.0.0", "connection",
        complexity="O(1)",
        flags="loading stale fast",
        acl="connection",
        args=(A("message", "string"),),
    ),
    "auth": D(
        "Authenticate to the server", "1.0.0", "connection",
        complexity="O(N) where N is the number of passwords defined for the user",
        flags="noscript loading stale fast no_auth allow_busy",
        acl="connection",
        history=(("6.0.0", "Added ACL style (username and password)."),),
        args=(A("username", "string", flags="optional", since="6.0.0"), A("password", "string")),
    ),
    "hello": D(
        "Handshake with Redis", "6.0.0", "connection",
        complexity="O(1)",
        flags="noscript loading stale fast no_auth allow_busy",
        acl="connection",
        history=(
            ("6.2.0", (
                "`protover` made optional; when called without arguments the command reports the current "
                "connection's context."
            )),
        ),
        args=(
            A("arguments", "block", flags="optional", args=(
                A("protover", "integer"),
                A("username_password", "block", token="AUTH", flags="optional", args=(
                    A("username", "string"),
                    A("password", "string"),
                )),
                A("clientname", "string", token="SETNAME", flags="optional"),
            )),
        ),
    ),
    "select": D(
        "Change the selected database for the current connection", "1.0.0", "connection",
        complexity="O(1)",
        flags="loading stale fast",
        acl="connection",
        args=(A("index", "integer"),),
    ),
    "quit": D(
        "Close the connection", "1.0.0", "connection",
        complexity="O(1)",
        flags="allow_busy noscript loading stale fast no_auth",
        acl="connection",
    ),
    "reset": D(
        "Reset the connection", "6.2.0", "connection",
        complexity="O(1)",
        flags="noscript loading stale fast no_auth allow_busy",
        acl="connection",
    ),
    "client": D(
        "A container for client connection commands", "2.4.0", "connection",
        complexity="Depends on subcommand.",
    ),
    "client|setname": D(
        "Set the current connection name", "2.6.9", "connection",
        complexity="O(1)",
        flags="noscript loading stale",
        acl="connection",
        args=(A("connection-name", "string"),),
    ),
    "client|getname": D(
        "Get the current connection name", "2.6.9", "connection",
        complexity="O(1)",
        flags="noscript loading stale",
        acl="connection",
    ),
    "client|id": D(
        "Returns the client ID for the current connection", "5.0.0", "connection",
        complexity="O(1)",
        flags="noscript loading stale",
        acl="connection",
    ),
    "client|list": D(
        "Get the list of client connections", "2.4.0", "connection",
        complexity="O(N) where N is the number of client connections",
        flags="admin noscript loading stale",
        acl="connection",
        tips="nondeterministic_output",
        history=(
            ("2.8.12", "Added unique client `id` field."),
            ("5.0.0", "Added optional `TYPE` filter."),
            ("6.0.0", "Added `user` field."),
            ("6.2.0", "Added `argv-mem`, `tot-mem`, `laddr` and `redir` fields and the optional `ID` filter."),
            ("7.0.0", "Added `resp`, `multi-mem`, `rbs` and `rbp` fields."),
            ("7.0.3", "Added `ssub` field."),
        ),
        args=(
            A("normal_master_replica_pubsub", "oneof", token="TYPE", flags="optional", since="5.0.0", args=(
                A("normal", "pure-token", token="NORMAL"),
                A("master", "pure-token", token="MASTER"),
                A("replica", "pure-token", token="REPLICA"),
                A("pubsub", "pure-token", token="PUBSUB"),
            )),
            A("id", "block", token="ID", flags="optional", since="6.2.0", args=(
                A("client-id", "integer", flags="multiple"),
            )),
        ),
    ),
    "client|info": D(
        "Returns information about the current client connection.", "6.2.0", "connection",
        complexity="O(1)",
        flags="noscript loading stale",
        acl="connection",
        tips="nondeterministic_output",
    ),
    "client|kill": D(
        "Kill the connection of a client", "2.4.0", "connection",
        complexity="O(N) where N is the number of client connections",
        flags="admin noscript loading stale",
        acl="connection",
        history=(
            ("2.8.12", "Added new filter format."),
            ("2.8.12", "`ID` option."),
            ("3.2.0", "Added `master` type in for `TYPE` option."),
            ("5.0.0", "Replaced `slave` `TYPE` with `replica`. `slave` still supported for backward compatibility."),
            ("6.2.0", "`LADDR` option."),
        ),
        args=(
            A("filter", "oneof", args=(
                A("ip:port", "string", deprecated_since="2.8.12"),
                A("new-format", "oneof", flags="multiple", args=(
                    A("client-id", "integer", token="ID", flags="optional", since="2.8.12"),
                    A("normal_master_slave_pubsub", "oneof", token="TYPE", flags="optional", since="2.8.12", args=(
                        A("normal", "pure-token", token="NORMAL"),
                        A("master", "pure-token", token="MASTER", since="3.2.0"),
                        A("slave", "pure-token", token="SLAVE"),
                        A("replica", "pure-token", token="REPLICA", since="5.0.0"),
                        A("pubsub", "pure-token", token="PUBSUB"),
                    )),
                    A("username", "string", token="USER", flags="optional"),
                    A("ip:port", "string", token="ADDR", flags="optional"),
                    A("ip:port", "string", token="LADDR", flags="optional", since="6.2.0"),
                    A("yes/no", "string", token="SKIPME", flags="optional"),
                )),
            )),
        ),
    ),
    "client|no-evict": D(
        "Set client eviction mode for the current connection", "7.0.0", "connection",
        complexity="O(1)",
        flags="admin noscript loading stale",
        acl="connection",
        args=(A("enabled", "oneof", args=(A("on", "pure-token", token="ON"), A("off", "pure-token", token="OFF"))),),
    ),
    "client|reply": D(
        "Instruct the server whether to reply to commands", "3.2.0", "connection",
        complexity="O(1)",
        flags="noscript loading stale",
        acl="connection",
        args=(
            A("on_off_skip", "oneof", args=(
                A("on", "pure-token", token="ON"),
                A("off", "pure-token", token="OFF"),
                A("skip", "pure-token", token="SKIP"),
            )),
        ),
    ),
    "client|pause": D(
        "Stop processing commands from clients for some time", "2.9.50", "connection",
        complexity="O(1)",
        flags="admin noscript loading stale",
        acl="connection",
        history=(("6.2.0", "`CLIENT PAUSE WRITE` mode added along with the `mode` option."),),
        args=(
            A("timeout", "integer"),
            A("mode", "oneof", flags="optional", since="6.2.0", args=(
                A("write", "pure-token", token="WRITE"),
                A("all", "pure-token", token="ALL"),
            )),
        ),
    ),
    "client|unpause": D(
        "Resume processing of clients that were paused", "6.2.0", "connection",
        complexity="O(N) Where N is the number of paused clients",
        flags="admin noscript loading stale",
        acl="connection",
    ),
    "client|tracking": D(
        "Enable or disable server assisted client side caching support", "6.0.0", "connection",
        complexity="O(1). Some options may introduce additional complexity.",
        flags="noscript loading stale",
        acl="connection",
        args=(
            A("status", "oneof", args=(
                A("on", "pure-token", token="ON"),
                A("off", "pure-token", token="OFF"),
            )),
            A("client-id", "integer", token="REDIRECT", flags="optional"),
            A("prefix", "string", token="PREFIX", flags="optional multiple multiple_token"),
            A("BCAST", "pure-token", token="BCAST", flags="optional"),
            A("OPTIN", "pure-token", token="OPTIN", flags="optional"),
            A("OPTOUT", "pure-token", token="OPTOUT", flags="optional"),
            A("NOLOOP", "pure-token", token="NOLOOP", flags="optional"),
        ),
    ),
    "client|caching": D(
        "Instruct the server about tracking or not keys in the next request", "6.0.0", "connection",
        complexity="O(1)",
        flags="noscript loading stale",
        acl="connection",
        args=(
            A("mode", "oneof", args=(
                A("yes", "pure-token", token="YES"),
                A("no", "pure-token", token="NO"),
            )),
        ),
    ),
    "client|trackinginfo": D(
        "Return information about server assisted client side caching for the current connection",
        "6.2.0", "connection",
        complexity="O(1)",
        flags="noscript loading stale",
        acl="connection",
    ),
    "client|getredir": D(
        "Get tracking notifications redirection client ID if any", "6.0.0", "connection",
        complexity="O(1)",
        flags="noscript loading stale",
        acl="connection",
    ),
    "client|help": D(
        "Show helpful text about the different subcommands", "5.0.0", "connection",
        complexity="O(1)",
        flags="loading stale",
        acl="connection",
    ),
}


def _auth_secret(argv: list) -> list[int]:
    """AUTH's arguments never show in MONITOR or the slowlog."""
    return list(range(1, len(argv)))


def _hello_secret(argv: list) -> list[int]:
    """HELLO ... AUTH user password: the user and the password never show."""
    for i in range(2, len(argv)):
        if bytes(argv[i]).lower() == b"auth" and len(argv) - i - 1 >= 2:
            return [i + 1, i + 2]
    return []


CONNECTION["auth"] = replace(CONNECTION["auth"], redact=_auth_secret)
CONNECTION["hello"] = replace(CONNECTION["hello"], redact=_hello_secret)
