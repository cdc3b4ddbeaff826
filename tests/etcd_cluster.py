"""A real etcd cluster on 127.0.0.1 for the etcd registry's tests: Debian's `etcd` (etcd-server),
three members by default, free ports, data under a directory of the test's, stopped by PID.

    with EtcdCluster(tmp_path) as etcd:
        etcd.endpoints            # "http://127.0.0.1:p0,http://127.0.0.1:p1,http://127.0.0.1:p2"
        etcd.kill(etcd.leader())  # SIGKILL of the member that leads now
        etcd.stop_all(); etcd.start_all()

No pytest here: a bench uses it too.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from procs import free_port, stop_process

START_TIMEOUT = 30.0


class EtcdUnavailable(RuntimeError):
    """No etcd binary here (Debian: apt-get install etcd-server; .ci/run installs it)."""


class EtcdCluster:
    def __init__(self, workdir: Path, members: int = 3) -> None:
        self.binary = shutil.which("etcd") or ("/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None)
        if self.binary is None:
            raise EtcdUnavailable("etcd is not installed (Debian: apt-get install etcd-server; .ci/run installs it)")
        self.workdir = Path(workdir)
        self.names = [f"e{i}" for i in range(members)]
        self.client_ports = {n: free_port() for n in self.names}
        self.peer_ports = {n: free_port() for n in self.names}
        self.token = "quilltest-" + secrets.token_hex(4)
        self.procs: dict[str, subprocess.Popen] = {}
        self.started: set[str] = set()  # members that have run once (their data directory holds the cluster)

    @property
    def endpoints(self) -> str:
        return ",".join(f"http://127.0.0.1:{self.client_ports[n]}" for n in self.names)

    def _argv(self, name: str) -> list[str]:
        c, p = self.client_ports[name], self.peer_ports[name]
        initial = ",".join(f"{n}=http://127.0.0.1:{self.peer_ports[n]}" for n in self.names)
        return [self.binary, "--name", name, "--data-dir", str(self.workdir / f"etcd-{name}"),
                "--listen-client-urls", f"http://127.0.0.1:{c}", "--advertise-client-urls", f"http://127.0.0.1:{c}",
                "--listen-peer-urls", f"http://127.0.0.1:{p}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{p}",
                "--initial-cluster", initial, "--initial-cluster-token", self.token,
                "--initial-cluster-state", "existing" if name in self.started else "new",
                "--heartbeat-interval", "100", "--election-timeout", "1000", "--logger", "zap",
                "--log-level", "warn"]

    def start(self, name: str) -> None:
        log = open(self.workdir / f"etcd-{name}.log", "ab")
        with log:
            self.procs[name] = subprocess.Popen(self._argv(name), stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True)
        self.started.add(name)

    def start_all(self, timeout: float = START_TIMEOUT) -> None:
        for name in self.names:
            if name not in self.procs or self.procs[name].poll() is not None:
                self.start(name)
        self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        """Until every running member answers /health with a leader elected."""
        deadline = time.monotonic() + timeout
        while True:
            running = [n for n in self.names if n in self.procs and self.procs[n].poll() is None]
            if running and all(self._healthy(n) for n in running):
                return
            if time.monotonic() > deadline:
                logs = "\n".join(f"-- {n}:\n" + (self.workdir / f"etcd-{n}.log").read_text(errors="replace")[-1500:]
                                 for n in self.names if (self.workdir / f"etcd-{n}.log").exists())
                raise TimeoutError(f"etcd not healthy within {timeout} s\n{logs}")
            time.sleep(0.1)

    def _healthy(self, name: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.client_ports[name]}/health", timeout=1) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def _status(self, name: str) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.client_ports[name]}/v3/maintenance/status",
                                     data=b"{}", method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=2) as r:
            return json.loads(r.read())

    def leader(self, timeout: float = 10.0) -> str:
        """The name of the member that leads now."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name in self.names:
                if name not in self.procs or self.procs[name].poll() is not None:
                    continue
                try:
                    st = self._status(name)
                except (OSError, ValueError):
                    continue
                if st.get("leader") and st["leader"] == st.get("header", {}).get("member_id"):
                    return name
            time.sleep(0.1)
        raise TimeoutError("no etcd leader")

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def stop_all(self) -> None:
        for name in list(self.procs):
            stop_process(self.procs.pop(name))

    def __enter__(self) -> EtcdCluster:
        try:
            self.start_all()
        except BaseException:
            self.stop_all()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()
