"""Fitting RESP's `maxclients` to the process's descriptor limit, as redis does at start.

A client past the descriptor limit used to be accepted and closed at once by the event loop
(libuv's EMFILE trick): EOF, no error, no log line, while `maxclients` still said 10000. So,
as redis's adjustOpenFilesLimit: at start, the soft RLIMIT_NOFILE is raised to fit `maxclients`
plus what everything else may hold (`descriptors_besides_resp`), towards the hard limit (beyond
it only where the process may raise the hard limit too). When it cannot fit, `maxclients` is
lowered to what does, and one line says so. A client past `maxclients` is then answered
`-ERR max number of clients reached` and counted (protocol/clients.py), always with a descriptor
to spare for it. CONFIG SET maxclients goes through the same fit: a value the limit cannot hold
is refused with redis's error ("try with N"). CONFIG GET maxclients and INFO show the value in force.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

from quilld.config import Config, reserved_fds
from quilld.context.listeners import http_budget


def descriptors_besides_resp(cfg: Config, nofile: int) -> int:
    """Descriptors everything but RESP clients may hold under a limit of `nofile`: the one place
    that adds up the reserve (config.reserved_fds) and the HTTP listeners' share (listeners.http_budget)."""
    return reserved_fds(cfg) + http_budget(cfg, nofile).fds


@dataclass(frozen=True)
class Fit:
    asked: int  # the maxclients asked for
    maxclients: int  # what fits (== asked when it all fits)
    was: int  # the soft limit before
    soft: int  # the soft limit now
    needed: int  # the soft limit `asked` needs
    error: str  # why the limit could not be raised to `needed` ("" when it was, or did not need to be)

    @property
    def message(self) -> str:
        """The one log line that tells what was done ("" when nothing was)."""
        if self.maxclients < self.asked:
            return (f"maxclients {self.asked} needs {self.needed} open files but the limit could not be raised "
                    f"past {self.soft} ({self.error}): maxclients has been reduced to {self.maxclients} to fit. "
                    f"To serve more clients raise 'ulimit -n' (the hard limit) to at least {self.needed}")
        if self.soft > self.was:
            return f"increased the open files limit to {self.soft} (it was {self.was}) to fit maxclients {self.asked}"
        return ""


def _limit(value: int) -> int:
    return 1 << 62 if value == resource.RLIM_INFINITY else value


def _needed(cfg: Config, maxclients: int) -> int:
    """The least limit n with maxclients + descriptors_besides_resp(cfg, n) <= n."""
    n = maxclients + descriptors_besides_resp(cfg, maxclients)
    for _ in range(64):  # others' share may grow with the limit: converge on a fixed point
        m = maxclients + descriptors_besides_resp(cfg, n)
        if m <= n:
            break
        n = m
    return n


def _fitting(cfg: Config, nofile: int, asked: int) -> int:
    return max(0, min(asked, nofile - descriptors_besides_resp(cfg, nofile)))


def fit_open_files(cfg: Config, maxclients: int) -> Fit:
    """Raise the soft descriptor limit to fit `maxclients` (never lowering it); what fits."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    was = _limit(soft)
    needed = _needed(cfg, maxclients)
    if was >= needed:
        return Fit(maxclients, maxclients, was, was, needed, "")
    error = ""
    if needed > _limit(hard):
        try:  # past the hard limit: only a process that may raise it (CAP_SYS_RESOURCE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (needed, needed))
            return Fit(maxclients, maxclients, was, needed, needed, "")
        except (OSError, ValueError) as e:
            error = f"the hard limit is {_limit(hard)}: {getattr(e, 'strerror', None) or e}"
    target = min(needed, _limit(hard))
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        now = target
    except (OSError, ValueError) as e:
        error = error or str(getattr(e, "strerror", None) or e)
        now = was
    return Fit(maxclients, _fitting(cfg, now, maxclients), was, now, needed, error)
