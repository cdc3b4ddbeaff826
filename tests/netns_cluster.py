"""A quilld cluster of real hosts on one machine: each node in its own network namespace
(tests/netns.py), bound to its own address with the customary ports, the first node the seed.

    with Topology() as topo:
        cluster = NetnsCluster(topo, workdir)
        cluster.start(12)                 # spawned together, each waited for until it listens
        cluster.wait_converged()          # every node's NODES lists every live node alive
        r = cluster.nodes["n3"].client()  # redis-py, from this process, through the bridge

Bound off loopback, a node needs `cluster.secret` (gossip) and a password (protected mode): every
node gets SECRET, PASSWORD and ADMIN_TOKEN. No pytest here: a bench uses this module too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import redis

from netns import Host, Topology, stop_all, wait_listening
from procs import wait_serving

ROOT = Path(__file__).resolve().parent.parent
RESP_PORT, ADMIN_PORT, GOSSIP_PORT = 7379, 7380, 7381  # every node its own address: the same ports
SECRET = "netns-cluster-secret"
PASSWORD = "netns-pw"
ADMIN_TOKEN = "netns-admin-token"
# Gossip as tests/blackbox/test_cluster.py runs it: failures found in about a second, not several.
FAST_GOSSIP = {"QUILLD_CLUSTER_PROBE_INTERVAL_MS": "200", "QUILLD_CLUSTER_PROBE_TIMEOUT_MS": "80",
               "QUILLD_CLUSTER_PUSH_PULL_INTERVAL_MS": "1000"}
START_TIMEOUT = 90.0  # a dozen Python processes importing at once on two shared cores
CONVERGE_TIMEOUT = 60.0


@dataclass
class Node:
    """One quilld in its namespace."""

    node_id: str
    host: Host
    proc: subprocess.Popen
    log_path: Path
    _client: redis.Redis | None = field(default=None, repr=False)

    @property
    def addr(self) -> str:
        return self.host.addr

    @property
    def gossip(self) -> str:
        return f"{self.addr}:{GOSSIP_PORT}"

    def url(self, scope: tuple[str, ...] = ()) -> str:
        """A redis:// URL to this node, as LMCache's connector takes it; `scope` (model, tokenizer
        [, adapter]) rides in the user name (README, "Identity scopes from a URL")."""
        user = "~".join(["default", *(urllib.parse.quote(s, safe="") for s in scope)]) if scope else ""
        return f"redis://{user}:{PASSWORD}@{self.addr}:{RESP_PORT}"

    def client(self, scope: tuple[str, ...] = (), **kw) -> redis.Redis:
        """redis-py from this URL (a new pool each call)."""
        kw.setdefault("socket_timeout", 30)
        kw.setdefault("socket_connect_timeout", 10)
        return redis.Redis.from_url(self.url(scope), **kw)

    @property
    def r(self) -> redis.Redis:
        """One shared default-scope client, kept for the node's life."""
        if self._client is None:
            self._client = self.client()
        return self._client

    def members(self) -> dict[str, str]:
        """NODES as {id: state}."""
        lines = self.r.execute_command("NODES").decode().strip().splitlines()
        return {line.split()[0]: line.split()[1] for line in lines}

    def admin(self, method: str, path: str, body: object = None, timeout: float = 10.0) -> tuple[int, object]:
        """One admin API request (JSON in and out): (status, decoded body)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://{self.addr}:{ADMIN_PORT}{path}", data=data, method=method,
                                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}",
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            with e:
                return e.code, e.read().decode(errors="replace")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """kill -9, and reap it."""
        if self._client is not None:
            self._client.close()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class NetnsCluster:
    """quilld nodes on `topo`'s hosts, one a host; the first node started is every later one's seed."""

    def __init__(self, topo: Topology, workdir: Path, config: str = "", env: dict[str, str] | None = None,
                 dram: str = "64MiB", gossip: bool = True) -> None:
        """`config`: TOML text every node reads (--config); `env`: QUILLD_* settings over FAST_GOSSIP;
        `gossip=False`: nodes outside any cluster (single nodes to compare with)."""
        self.topo, self.workdir, self.dram, self.gossip = topo, Path(workdir), dram, gossip
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.nodes: dict[str, Node] = {}
        self.config_path: Path | None = None
        if config:
            self.config_path = self.workdir / "quilld.toml"
            self.config_path.write_text(config)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")}
        self.env.pop("PYTHONDONTWRITEBYTECODE", None)
        self.env.update(FAST_GOSSIP, PYTHONPATH=str(ROOT), QUILLD_CLUSTER_SECRET=SECRET,
                        QUILLD_ADMIN_TOKEN=ADMIN_TOKEN)
        self.env.update(env or {})

    @property
    def seed(self) -> Node | None:
        return next(iter(self.nodes.values()), None)

    def live(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.alive]

    def _spawn(self, host: Host, seed: Node | None) -> Node:
        node_id = f"n{host.index}"
        argv = [sys.executable, "-m", "quilld", "--node-id", node_id, "--bind", host.addr,
                "--port", str(RESP_PORT), "--admin-port", str(ADMIN_PORT), "--dram", self.dram,
                "--requirepass", PASSWORD]
        if self.gossip:
            argv += ["--gossip-port", str(GOSSIP_PORT)]
        if seed is not None and self.gossip:
            argv += ["--seeds", seed.gossip]
        if self.config_path is not None:
            argv += ["--config", str(self.config_path)]
        log_path = self.workdir / f"{node_id}.log"
        with open(log_path, "ab") as log:
            proc = self.topo.popen(host, argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=self.env)
        return Node(node_id, host, proc, log_path)

    def start(self, count: int, timeout: float = START_TIMEOUT) -> list[Node]:
        """`count` new hosts and a node on each, started together (from this thread: see netns.popen);
        returns once each serves (its RESP and admin ports listen before it has joined). The first node of a cluster has no seed."""
        new = []
        for host in self.topo.add_hosts(count):
            node = self._spawn(host, self.seed)
            self.nodes[node.node_id] = node
            new.append(node)
        deadline = time.monotonic() + timeout
        for node in new:
            try:
                wait_listening(node.proc, (RESP_PORT, ADMIN_PORT), max(0.0, deadline - time.monotonic()))
                wait_serving(node.proc, node.log_path, max(0.0, deadline - time.monotonic()))
            except (RuntimeError, TimeoutError) as e:
                raise RuntimeError(f"quilld {node.node_id} on {node.addr} did not start ({e}):\n"
                                   f"{node.log()[-3000:]}") from None
        return new

    def restart(self, node_id: str, timeout: float = START_TIMEOUT) -> Node:
        """Start a node that was killed again, on its own host with its own name and the same
        seed (from this thread: see netns.popen); returns once it serves."""
        old = self.nodes[node_id]
        if old.alive:
            raise RuntimeError(f"{node_id} is still running")
        seed = next((n for n in self.nodes.values() if n.alive), None)
        node = self._spawn(old.host, seed)
        self.nodes[node_id] = node
        deadline = time.monotonic() + timeout
        try:
            wait_listening(node.proc, (RESP_PORT, ADMIN_PORT), timeout)
            wait_serving(node.proc, node.log_path, max(0.0, deadline - time.monotonic()))
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"quilld {node_id} did not start again ({e}):\n{node.log()[-3000:]}") from None
        return node

    def views(self) -> dict[str, dict[str, str] | str]:
        """Every live node's NODES ({id: state}), or the error asking it gave."""
        out: dict[str, dict[str, str] | str] = {}
        for node in self.live():
            try:
                out[node.node_id] = node.members()
            except redis.RedisError as e:
                out[node.node_id] = f"{type(e).__name__}: {e}"
        return out

    def converged(self) -> bool:
        """Every live node lists every live node alive, and each other node it lists dead or left
        (a suspect is neither: its residencies are still in the directory); and every node's
        directory applies that membership, with nothing of a handoff still on its way: no bucket
        filling and no holder's message queued or unanswered (a host plugged back in has sent its
        entries to their owners, so its keys are found again)."""
        want = {n.node_id for n in self.live()}
        for view in self.views().values():
            if isinstance(view, str) or {i for i, s in view.items() if s == "alive"} != want:
                return False
            if any(s not in ("dead", "left") for i, s in view.items() if i not in want):
                return False
        for node in self.live():
            try:
                info = node.r.info("cluster")
            except redis.RedisError:
                return False
            if (info.get("cluster_directory_view_members") != len(want) or info.get("cluster_directory_view_pending")
                    or info.get("cluster_directory_buckets_filling")
                    or info.get("cluster_directory_handoffs_in_flight")):
                return False
        return True

    def wait_converged(self, timeout: float = CONVERGE_TIMEOUT) -> float:
        """Poll until converged(); the seconds it took. TimeoutError with every node's view past `timeout`."""
        t0 = time.monotonic()
        while not self.converged():
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"no convergence in {timeout} s: live {sorted(n.node_id for n in self.live())},"
                                   f" views {self.views()}")
            time.sleep(0.1)
        return time.monotonic() - t0

    def stop_all(self) -> None:
        """SIGTERM every node at once (a graceful leave), SIGKILL past the bound."""
        for node in self.nodes.values():
            if node._client is not None:
                node._client.close()
        stop_all([n.proc for n in self.nodes.values()])
