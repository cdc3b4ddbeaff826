"""Watching the node work: SLOWLOG, LATENCY and MONITOR, as redis 7.0.15 answers them.

The dispatcher (table.py) times calls and hands those at least `table.slow_ns` long to
`Observer.slow`, which keeps the slowlog (runtime `slowlog_log_slower_than`,
`slowlog_max_len`) and the latency monitor's `command` and `fast-command` events
(runtime `latency_monitor_threshold`, milliseconds). Fast commands are timed one call in
table.SAMPLE_EVERY unless the slowlog's threshold is under table.TIME_ALL_BELOW_US.

Tenants: a slowlog entry remembers its user, and SLOWLOG GET, LEN and RESET see the
caller's own entries only (a node without passwords has one user); MONITOR sends a
connection the commands its own user runs; the latency monitor holds no arguments and is
node-wide, and resetting it is the operator's (`default`'s).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from quilld.errors import CommandError, echo
from quilld.protocol.commands.client import operator_only
from quilld.protocol.commands.command_docs import by_full_name, help_reply, render
from quilld.protocol.commands.common import parse_int
from quilld.protocol.resp import OK, Verbatim, shown_arg
from quilld.protocol.table import Command, CommandTable

SLOWLOG_MAX_ARGC = 32  # redis's SLOWLOG_ENTRY_MAX_ARGC
SLOWLOG_MAX_STRING = 128  # redis's SLOWLOG_ENTRY_MAX_STRING
LATENCY_TS_LEN = 160  # samples kept per latency event (redis's LATENCY_TS_LEN)


class Observer:
    """The slowlog and the latency monitor of one node."""

    def __init__(self) -> None:
        self.slowlog: deque[tuple] = deque(maxlen=128)
        self.next_id = 0
        # event -> [max ms, deque of [time, ms]]
        self.events: dict[str, list] = {}

    def slow(self, client: Any, cmd: Command | None, args: list, ns: int) -> None:
        rt = client.ctx.runtime
        usec = ns // 1000
        if cmd is not None and 0 <= rt.slowlog_log_slower_than <= usec and "skip_slowlog" not in cmd.info_flags:
            if self.slowlog.maxlen != rt.slowlog_max_len:
                self.slowlog = deque(self.slowlog, maxlen=rt.slowlog_max_len)
            if rt.slowlog_max_len:
                self.slowlog.appendleft((self.next_id, int(time.time()), usec, _slowlog_args(cmd, args),
                                         client.addr.encode(), client.name or b"", client.user))
            self.next_id += 1
        ms = ns // 1_000_000
        if rt.latency_monitor_threshold and ms >= rt.latency_monitor_threshold:
            self.add_latency("fast-command" if cmd is not None and "fast" in cmd.info_flags else "command", ms)

    def add_latency(self, event: str, ms: int) -> None:
        """redis's latencyAddSample: one sample per second and event, the highest."""
        now = int(time.time())
        ts = self.events.get(event)
        if ts is None:
            ts = self.events[event] = [0, deque(maxlen=LATENCY_TS_LEN)]
        ts[0] = max(ts[0], ms)
        samples = ts[1]
        if samples and samples[-1][0] == now:
            samples[-1][1] = max(samples[-1][1], ms)
        else:
            samples.append([now, ms])


def _slowlog_args(cmd: Command, args: list) -> list[bytes]:
    """The arguments as the slowlog keeps them: at most 32 (the last says how many more), each
    cut at 128 bytes, redacted where the command hides them (AUTH, HELLO AUTH, CONFIG SET)."""
    hidden = set(cmd.doc.redact(args)) if cmd.doc is not None and cmd.doc.redact else set()
    n = len(args)
    keep = min(n, SLOWLOG_MAX_ARGC)
    out = []
    for i in range(keep):
        if keep != n and i == keep - 1:
            out.append(b"... (%d more arguments)" % (n - keep + 1))
            break
        raw = b"(redacted)" if i in hidden else shown_arg(args[i])
        if len(raw) > SLOWLOG_MAX_STRING:
            raw = raw[:SLOWLOG_MAX_STRING] + b"... (%d more bytes)" % (len(raw) - SLOWLOG_MAX_STRING)
        out.append(raw)
    return out


def observer(c) -> Observer:
    return c.ctx.table.observer


def _mine(c) -> list[tuple]:
    return [e for e in observer(c).slowlog if e[6] == c.user]


def _count(raw, low: int, message: str) -> int:
    """redis's getRangeLongFromObjectOrReply with a message: one error for every bad value."""
    try:
        value = parse_int(raw)
    except CommandError:
        raise CommandError(message) from None
    if value < low:
        raise CommandError(message)
    return value


def cmd_slowlog_get(c, args):
    if len(args) > 3:
        raise CommandError(f"unknown subcommand or wrong number of arguments for '{echo(args[1], 128)}'. Try "
                           f"{echo(bytes(args[0]).upper())} HELP.")
    entries = _mine(c)
    count = 10
    if len(args) == 3:
        count = _count(args[2], -1, "count should be greater than or equal to -1")
        if count == -1:
            count = len(entries)
    return [[e[0], e[1], e[2], e[3], e[4], e[5]] for e in entries[:count]]


def cmd_slowlog_len(c, args):
    return len(_mine(c))


def cmd_slowlog_reset(c, args):
    obs = observer(c)
    obs.slowlog = deque((e for e in obs.slowlog if e[6] != c.user), maxlen=obs.slowlog.maxlen)
    return OK


_SLOWLOG_HELP = (
    "GET [<count>]",
    "    Return top <count> entries from the slowlog (default: 10, -1 mean all).",
    "    Entries are made of:",
    "    id, timestamp, time in microseconds, arguments array, client IP and port,",
    "    client name",
    "LEN",
    "    Return the length of the slowlog.",
    "RESET",
    "    Reset the slowlog.",
)


def cmd_slowlog_help(c, args):
    return help_reply(args, _SLOWLOG_HELP)


def cmd_latency_latest(c, args):
    return [[event.encode(), ts[1][-1][0], ts[1][-1][1], ts[0]] for event, ts in observer(c).events.items()]


def cmd_latency_history(c, args):
    ts = observer(c).events.get(bytes(args[2]).decode("utf-8", "surrogateescape"))
    return [] if ts is None else [[t, ms] for t, ms in ts[1]]


def cmd_latency_reset(c, args):
    operator_only(c, "latency|reset")
    events = observer(c).events
    names = [n for n in events if len(args) == 2 or any(bytes(a).lower() == n.encode().lower() for a in args[2:])]
    for name in names:
        del events[name]
    return len(names)


def cmd_latency_doctor(c, args):
    obs, rt = observer(c), c.ctx.runtime
    if not obs.events and not rt.latency_monitor_threshold:
        return Verbatim(b"I'm sorry, Dave, I can't do that. Latency monitoring is disabled in this Redis instance. "
                        b"You may use \"CONFIG SET latency-monitor-threshold <milliseconds>.\" in order to enable "
                        b"it. If we weren't in a deep space mission I'd suggest to take a look at "
                        b"https://redis.io/topics/latency-monitor.\n")
    if not obs.events:
        return Verbatim(b"Dave, no latency spike was observed during the lifetime of this Redis instance, not in "
                        b"the slightest bit. I honestly think you ought to sleep tonight.\n")
    lines = ["Dave, I have observed latency spikes in this Redis instance. You don't mind talking about it, do "
             "you Dave?", ""]
    for n, (event, (worst, samples)) in enumerate(obs.events.items(), 1):
        values = [ms for _, ms in samples]
        avg = sum(values) // len(values)
        mad = sum(abs(v - avg) for v in values) // len(values)
        period = (samples[-1][0] - samples[0][0]) / len(values) if len(values) > 1 else 0.0
        lines.append(f"{n}. {event}: {len(values)} latency spikes (average {avg}ms, mean deviation {mad}ms, "
                     f"period {period:.2f} sec). Worst all time event {worst}ms.")
    lines += ["", "I have a few advices for you:", "",
              "- Check your slow commands with SLOWLOG GET: in quilld, large values are read from and written to "
              "the arena in place, so a slow command is usually a large KEYS, SCAN COUNT or multi-key command, "
              "or a value read back from the SSD tier (INFO persistence).", ""]
    return Verbatim("\n".join(lines).encode())


def _cdf(hist: dict[int, int]) -> dict:
    """redis's histogram_usec: cumulative calls under each power of two from 1 microsecond."""
    by_power: dict[int, int] = {}
    for bucket, n in hist.items():
        power = max(bucket >> 4, 10)  # durations under 2^10 ns (1.024 us) fall in the first
        by_power[power] = by_power.get(power, 0) + n
    out, total = {}, 0
    for power in sorted(by_power):
        total += by_power[power]
        out[(1 << power) // 1000] = total
    return {b"calls": sum(hist.values()), b"histogram_usec": out}


def cmd_latency_histogram(c, args):
    table = c.ctx.table
    if len(args) == 2:
        cmds = [x for cmd in table.commands.values() for x in (cmd, *cmd.subcommands.values())]
    else:
        cmds = []
        for raw in args[2:]:
            cmd = by_full_name(table, raw)
            if cmd is not None:
                cmds += [cmd, *cmd.subcommands.values()]
    return render({cmd.name.encode(): _cdf(table.stats[cmd.name][5]) for cmd in cmds if table.stats[cmd.name][5]},
                  c.resp3)


_LATENCY_HELP = (
    "DOCTOR",
    "    Return a human readable latency analysis report.",
    "HISTORY <event>",
    "    Return time-latency samples for the <event> class.",
    "LATEST",
    "    Return the latest latency samples for all events.",
    "RESET [<event> ...]",
    "    Reset latency data of one or more <event> classes.",
    "    (default: reset all data for all event classes)",
    "HISTOGRAM [COMMAND ...]",
    "    Return a cumulative distribution of latencies in the format of a histogram for the specified command "
    "names.",
    "    If no commands are specified then all histograms are replied.",
)


def cmd_latency_help(c, args):
    return help_reply(args, _LATENCY_HELP)


def cmd_monitor(c, args):
    """MONITOR: from now on this connection receives every command its user runs."""
    c.ctx.clients.monitor_on(c)
    return OK


def register(t: CommandTable) -> None:
    obs = Observer()
    t.observer = obs
    t.on_slow = obs.slow
    slow = CommandTable()
    slow.add("slowlog|get", -2, "", cmd_slowlog_get)
    slow.add("slowlog|help", 2, "", cmd_slowlog_help)
    slow.add("slowlog|len", 2, "", cmd_slowlog_len)
    slow.add("slowlog|reset", 2, "", cmd_slowlog_reset)
    t.add("slowlog", -2, "", lambda c, a: None, subcommands={n.split(b"|")[1]: x for n, x in slow.commands.items()})
    lat = CommandTable()
    lat.add("latency|doctor", 2, "", cmd_latency_doctor)
    lat.add("latency|help", 2, "", cmd_latency_help)
    lat.add("latency|histogram", -2, "", cmd_latency_histogram)
    lat.add("latency|history", 3, "", cmd_latency_history)
    lat.add("latency|latest", 2, "", cmd_latency_latest)
    lat.add("latency|reset", -2, "", cmd_latency_reset)
    t.add("latency", -2, "", lambda c, a: None, subcommands={n.split(b"|")[1]: x for n, x in lat.commands.items()})
    t.add("monitor", 1, "", cmd_monitor)
