"""How the last run of a node ended, kept in its SSD tier directory's LOCK file.

LOCK (ssd_files.py) is flocked by the process that owns the directory and starts with
its pid; after it come `key=value` lines of a `RunState`:

    4242
    state=running             running: the process has not stopped cleanly (yet)
    started=1767225600.125    stopped: a clean stop finished (flushed, checkpointed)
    census=1767225610.500     when the keys below were last counted
    dram_only=330             keys whose value had no copy on the SSD tier at the census
    stopped=...               (stopped only) when the stop finished
    not_kept=0                (stopped only) keys the clean stop could not write to SSD

A start reads what the previous run left before it writes its own `running`. `running`
found there means the previous run did not stop cleanly (kill -9, a crash, a power
loss): what it held only in DRAM is gone, and the census says about how many keys that
was (a census is taken every few seconds while the node runs, so writes after the last
one are not in it). A LOCK with no state line was left by a quilld older than this file:
how it ended is not known.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

RUNNING, STOPPED = "running", "stopped"


@dataclass
class RunState:
    pid: int = 0
    state: str = ""  # RUNNING, STOPPED, or "" (not known)
    started: float = 0.0
    census: float = 0.0  # when dram_only was counted (0: never)
    dram_only: int = 0
    stopped: float = 0.0
    not_kept: int = 0

    def encode(self) -> bytes:
        lines = [str(self.pid), f"state={self.state}", f"started={self.started:.3f}"]
        if self.census:
            lines += [f"census={self.census:.3f}", f"dram_only={self.dram_only}"]
        if self.state == STOPPED:
            lines += [f"stopped={self.stopped:.3f}", f"not_kept={self.not_kept}"]
        return ("\n".join(lines) + "\n").encode()

    @classmethod
    def parse(cls, data: bytes) -> RunState | None:
        """The state in a LOCK file's bytes; None when there is none (a new directory)."""
        lines = data.decode(errors="replace").split("\n")
        if not lines[0].strip():
            return None
        out = cls()
        try:
            out.pid = int(lines[0].strip())
        except ValueError:
            return cls()
        fields = dict(line.split("=", 1) for line in lines[1:] if "=" in line)
        out.state = fields.get("state", "") if fields.get("state") in (RUNNING, STOPPED) else ""
        for name, kind in (("started", float), ("census", float), ("dram_only", int), ("stopped", float),
                           ("not_kept", int)):
            try:
                setattr(out, name, kind(fields[name]))
            except (KeyError, ValueError):
                pass
        return out

    def report(self) -> tuple[bool, str]:
        """(whether it is worth a warning, what to say at start about the run that left this)."""
        if not self.state:
            return False, (f"the previous run (pid {self.pid}) left no record of how it ended "
                           "(a quilld older than the run marker)")
        if self.state == STOPPED:
            if self.not_kept:
                return True, (f"the previous run (pid {self.pid}) stopped cleanly at {_when(self.stopped)}, but "
                              f"{self.not_kept} keys it held only in DRAM could not be written to SSD and are lost")
            return False, f"the previous run (pid {self.pid}) stopped cleanly at {_when(self.stopped)}"
        if self.census and self.dram_only:
            lost = (f"about {self.dram_only} keys it held only in DRAM were lost (census of "
                    f"{_when(self.census)}; keys written after it are not counted)")
        elif self.census:
            lost = (f"it held no key only in DRAM at its last census ({_when(self.census)}); keys written "
                    "after it are lost")
        else:
            lost = "what it held only in DRAM was lost (it ended before its first census)"
        return True, (f"the previous run (pid {self.pid}, started {_when(self.started)}) did not stop cleanly "
                      f"(killed or crashed): {lost}")


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "an unknown time"
