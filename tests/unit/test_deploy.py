"""deploy/: what an operator deploys quilld with (issue 35), checked as far as this machine can.

- Kubernetes (deploy/kubernetes): the manifests parse and pass Kubernetes' own schemas
  (kubernetes-validate, offline); quilld's config loader accepts the config they give it (the
  ConfigMap's file, the StatefulSet's environment and arguments); the ports, the probes' paths,
  the seeds, the memory limit and the volume claim agree with that config and with the code.
- systemd (deploy/systemd): `systemd-analyze verify` finds nothing to say, and the unit's
  ExecStart, run here as written (the installed path mapped to this checkout), brings a node up
  that its KillSignal stops cleanly.
- The container build file (deploy/container): its entry point and arguments are ones quilld
  accepts, its ports are the config's, its sources exist. The image is not built: no container
  registry is reachable here for its base image.
- Prometheus alert rules (deploy/prometheus): `promtool check rules`, and every metric they
  name is one a node serves.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
UNIT = DEPLOY / "systemd" / "quilld.service"
CONTAINERFILE = DEPLOY / "container" / "Containerfile"
RULES = DEPLOY / "prometheus" / "quilld-alerts.yml"
VENV_QUILLD = "/opt/quillcache/.venv/bin/quilld"  # where the container and the unit install quilld
CONFIG_PATH = "/etc/quilld/quilld.toml"
K8S_VERSION = "1.32.0"

from quilld import config  # noqa: E402
from quilld.cli import _overrides, _parser  # noqa: E402
from quilld.http.admin import PROBES, ROUTES  # noqa: E402
from quilld.tiers.arena import DRAM_WARN_SHARE, check_arena_size  # noqa: E402


def tool(name: str) -> str:
    path = shutil.which(name) or next((p for p in (f"/usr/bin/{name}", f"/bin/{name}") if os.path.exists(p)), None)
    if not path:
        pytest.fail(f"{name} is not installed: .ci/run installs it")
    return path


# -- Kubernetes ---------------------------------------------------------------------------

def manifests() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


def one(kind: str, name: str | None = None) -> dict:
    found = [d for d in manifests() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def container() -> dict:
    (c,) = one("StatefulSet")["spec"]["template"]["spec"]["containers"]
    return c


def quantity(text: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(text))
    assert m, text
    return int(m[1]) * units.get(m[2] or "", 1)


def k8s_config(tmp_path: Path) -> config.Config:
    """The config a pod's quilld runs with: the ConfigMap's file, the environment (fieldRefs and
    Secrets given stand-in values), the arguments; loaded and validated by quilld's own loader."""
    cm = one("ConfigMap", "quilld")
    mount = next(m for m in container()["volumeMounts"] if m["name"] == "config")
    args = container()["args"]
    path = args[args.index("--config") + 1]
    assert Path(path).parent == Path(mount["mountPath"]) and Path(path).name in cm["data"]
    local = tmp_path / Path(path).name
    local.write_text(cm["data"][Path(path).name])
    stand_in = {"metadata.name": "quilld-0", "status.podIP": "192.0.2.10"}  # TEST-NET: a string, never dialled
    env = {}
    for e in container()["env"]:
        source = e.get("valueFrom", {})
        if "fieldRef" in source:
            env[e["name"]] = stand_in[source["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in source:
            env[e["name"]] = f"stand-in-{source['secretKeyRef']['key']}"
        else:
            env[e["name"]] = e["value"]
    argv = [str(local) if a == path else a for a in args]
    parsed = _parser().parse_args(argv)
    return config.load(parsed.config, environ=env, overrides=_overrides(parsed))


def test_the_manifests_pass_kubernetes_schemas():
    import kubernetes_validate

    docs = manifests()
    assert {d["kind"] for d in docs} == {"ConfigMap", "Service", "StatefulSet", "PodDisruptionBudget"}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}, "a manifest left out"


def test_quillds_own_loader_takes_the_config_they_give_it(tmp_path):
    cfg = k8s_config(tmp_path)
    assert cfg.server.node_id == "quilld-0" and cfg.server.bind == "192.0.2.10"
    assert cfg.security.requirepass and cfg.admin.token and cfg.cluster.secret  # from the Secret
    assert cfg.cluster.gossip_port and cfg.ssd.dir


def test_the_ports_and_probes_are_the_real_ones(tmp_path):
    cfg = k8s_config(tmp_path)
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert ports == {"resp": cfg.server.port, "admin": cfg.admin.port, "gossip-udp": cfg.cluster.gossip_port,
                     "gossip-tcp": cfg.cluster.gossip_port, "gateway": cfg.gateway.port}
    routes = {path for method, path, _ in ROUTES if method == "GET"}
    for probe, path in (("livenessProbe", "/livez"), ("readinessProbe", "/readyz")):
        get = container()[probe]["httpGet"]
        assert get["path"] == path and path in PROBES and path in routes  # no token needed
        assert ports[get["port"]] == cfg.admin.port
    for svc in (one("Service", "quilld"), one("Service", "quilld-clients")):
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports and p["port"] == ports[p["targetPort"]], p
        assert svc["spec"]["selector"].items() <= one("StatefulSet")["spec"]["template"]["metadata"]["labels"].items()


def test_the_seeds_are_the_pods_stable_names(tmp_path):
    cfg, sts, svc = k8s_config(tmp_path), one("StatefulSet"), one("Service", "quilld")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    names = {f"{sts['metadata']['name']}-{i}.{svc['metadata']['name']}:{cfg.cluster.gossip_port}"
             for i in range(sts["spec"]["replicas"])}
    assert set(cfg.cluster.seeds.split(",")) == names


def test_memory_limit_and_volume_claim_fit_the_config(tmp_path):
    cfg, sts = k8s_config(tmp_path), one("StatefulSet")
    limit = quantity(container()["resources"]["limits"]["memory"])
    assert container()["resources"]["requests"]["memory"] == container()["resources"]["limits"]["memory"]
    assert check_arena_size(cfg.dram.size, (limit, limit)) is None  # neither refused nor warned at start
    assert limit >= cfg.dram.size / DRAM_WARN_SHARE and limit - cfg.dram.size >= 1 << 30
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    mount = next(m for m in container()["volumeMounts"] if m["name"] == claim["metadata"]["name"])
    assert Path(cfg.ssd.dir).is_relative_to(mount["mountPath"])
    room = 2 * cfg.ssd.checkpoint_wal_bytes
    assert quantity(claim["spec"]["resources"]["requests"]["storage"]) >= cfg.ssd.size + room
    security = sts["spec"]["template"]["spec"]["securityContext"]
    assert security["fsGroupChangePolicy"] == "OnRootMismatch"  # else tier-v4.key turns group-readable
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 60  # the stop's flush


def test_the_budget_covers_the_pods_and_the_docs_make_the_secret():
    pdb, sts = one("PodDisruptionBudget"), one("StatefulSet")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    page = (ROOT / "docs" / "operations" / "deployment.md").read_text()
    for e in container()["env"]:
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            assert f"kubectl create secret generic {ref['name']}" in page and f"--from-literal={ref['key']}=" in page


# -- systemd ------------------------------------------------------------------------------

def unit() -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    section = ""
    for line in UNIT.read_text().splitlines():
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            out[section] = {}
        elif "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[section][key] = value
    return out


def test_systemd_analyze_finds_nothing_to_say(tmp_path):
    # verify checks that ExecStart's program exists: here it is this interpreter, the rest as written
    text = UNIT.read_text().replace(f"ExecStart={VENV_QUILLD}", f"ExecStart={sys.executable} -m quilld")
    copy = tmp_path / "quilld.service"
    copy.write_text(text)
    done = subprocess.run([tool("systemd-analyze"), "verify", str(copy)], capture_output=True, text=True, timeout=60)
    said = (done.stdout + done.stderr).strip()
    assert done.returncode == 0 and not said, said


def test_the_units_limits_are_what_quilld_needs():
    s = unit()["Service"]
    cfg = config.load(str(ROOT / "conf" / "quilld.toml"), environ={})
    assert int(s["LimitNOFILE"]) >= cfg.server.max_clients + config.reserved_fds(cfg)
    assert s["LimitMEMLOCK"] == "infinity"  # RDMA pins the whole arena
    assert s["RuntimeDirectory"] == "quilld" and s["StateDirectory"] == "quilld"
    assert s["KillSignal"] == "SIGTERM" and s["RestartPreventExitStatus"] == "2"  # 2: a refused config


def test_the_units_exec_start_runs_and_its_kill_signal_stops_it_cleanly(tmp_path):
    from conftest import free_port

    s = unit()["Service"]
    argv = shlex.split(s["ExecStart"])
    assert argv[0] == VENV_QUILLD
    # the deployment docs install conf/quilld.toml as /etc/quilld/quilld.toml
    argv = [sys.executable, "-m", "quilld", *(str(ROOT / "conf" / "quilld.toml") if a == CONFIG_PATH else a
                                               for a in argv[1:])]
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "wire")]), QUILLD_SERVER_PORT=str(free_port()),
               QUILLD_ADMIN_PORT=str(free_port()), QUILLD_DRAM_SIZE="64MiB")
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("quilld ready on"):
                break
        assert lines and lines[-1].startswith("quilld ready on"), "".join(lines)
        proc.send_signal(getattr(signal, s["KillSignal"]))
        assert proc.wait(int(s["TimeoutStopSec"])) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- the container build file ---------------------------------------------------------------

def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", CONTAINERFILE.read_text())
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1].strip()) for ln in text.splitlines()
            if ln.strip() and not ln.lstrip().startswith("#")]


def test_the_container_runs_quilld_with_arguments_it_accepts(tmp_path):
    steps = instructions()
    assert [k for k, _ in steps].count("FROM") == 2
    entry = json.loads(dict(steps)["ENTRYPOINT"])
    cmd = json.loads(dict(steps)["CMD"])
    assert entry == [VENV_QUILLD] and any(f"python -m venv {Path(VENV_QUILLD).parents[1]}" in v for k, v in steps)
    assert f"COPY conf/quilld.toml {CONFIG_PATH}" in [f"{k} {v}" for k, v in steps]
    parsed = _parser().parse_args([str(ROOT / "conf" / "quilld.toml") if a == CONFIG_PATH else a for a in cmd])
    cfg = config.load(parsed.config, environ={}, overrides=_overrides(parsed))
    exposed = {int(p.split("/")[0]) for k, v in steps if k == "EXPOSE" for p in v.split()}
    k8s = k8s_config(tmp_path)
    assert exposed == {cfg.server.port, cfg.admin.port, k8s.cluster.gossip_port, k8s.gateway.port}
    for k, v in steps:
        if k == "COPY" and not v.startswith("--from"):
            for source in v.split()[:-1]:
                assert (ROOT / source).exists(), source
    assert container()["image"] == "quilld:0.1.0" and "-t quilld:0.1.0" in CONTAINERFILE.read_text()


# -- Prometheus rules -----------------------------------------------------------------------

def test_the_alert_rules_check_and_name_real_metrics():
    done = subprocess.run([tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    sys.path.insert(0, str(ROOT / "tools"))
    import gen_refs

    served = set()
    for name, kind, _, _ in gen_refs.metric_families():
        served |= {name} | ({f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else set())
    rules = yaml.safe_load(RULES.read_text())
    named = {m for g in rules["groups"] for r in g["rules"] for m in re.findall(r"\bquilld_[a-z_]+", r["expr"])}
    assert named and named <= served, named - served
