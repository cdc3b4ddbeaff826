"""The etcd registry's parts that need no etcd: its config's checks, endpoints, and how etcd's
key changes become the same membership events gossip gives (tests/blackbox/test_etcd_registry.py
runs it against a real etcd)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from quilld.cluster.etcd_registry import EtcdRegistry, parse_endpoint
from quilld.cluster.swim import EventKind
from quilld.cluster.wire import State
from quilld.config import load
from quilld.errors import ConfigError


def etcd_env(**more) -> dict:
    return {"QUILLD_CLUSTER_REGISTRY": "etcd", "QUILLD_CLUSTER_ETCD_ENDPOINTS": "http://127.0.0.1:2379", **more}


def test_the_config_says_what_an_etcd_registry_lacks():
    cfg = load(environ=etcd_env())
    assert cfg.cluster.enabled and cfg.cluster.etcd_prefix == "/quilld" and cfg.cluster.etcd_lease_ttl_s == 5
    assert not load(environ={}).cluster.enabled
    for env, says in (({"QUILLD_CLUSTER_ETCD_ENDPOINTS": ""}, "needs cluster.etcd_endpoints"),
                      ({"QUILLD_CLUSTER_GOSSIP_PORT": "7381"}, "does not gossip"),
                      ({"QUILLD_CLUSTER_ETCD_PREFIX": "quilld"}, "must start with /"),
                      ({"QUILLD_CLUSTER_ETCD_PREFIX": "/"}, "must start with / and name something"),
                      ({"QUILLD_CLUSTER_ETCD_LEASE_TTL_S": "1"}, "2 to 3600"),
                      ({"QUILLD_CLUSTER_ETCD_PASSWORD": "pw"}, "needs cluster.etcd_user"),
                      ({"QUILLD_CLUSTER_REGISTRY": "consul"}, "must be one of gossip, etcd")):
        with pytest.raises(ConfigError, match=says):
            load(environ=etcd_env(**env))
    shown = load(environ=etcd_env(QUILLD_CLUSTER_ETCD_USER="q", QUILLD_CLUSTER_ETCD_PASSWORD="pw")).redacted()
    assert shown["cluster"]["etcd_password"] == "***"


def test_endpoints_as_urls_or_host_port():
    assert parse_endpoint("http://10.0.0.5:2379") == ("10.0.0.5", 2379)
    assert parse_endpoint("10.0.0.5:12379") == ("10.0.0.5", 12379)
    assert parse_endpoint("etcd.internal") == ("etcd.internal", 2379)
    with pytest.raises(ConfigError, match="not host:port"):
        parse_endpoint("http://h:port")


def kv(key: str, state: str, meta: dict, rev: int = 5):
    return SimpleNamespace(key=key.encode(), value=json.dumps({"state": state, "meta": meta}).encode(),
                           create_revision=rev, mod_revision=rev)


def test_key_changes_become_gossip_s_events():
    cfg = SimpleNamespace(etcd_prefix="/p/", etcd_endpoints="127.0.0.1:2379", etcd_lease_ttl_s=5)
    events = []
    reg = EtcdRegistry("me", {"resp": ["127.0.0.1", 1]}, cfg, events.append)
    meta = {"resp": ["127.0.0.1", 7001]}
    assert reg._apply_put(kv("/p/nodes/b", "alive", meta)) == "b"
    reg._apply_put(kv("/p/nodes/b", "alive", meta))  # the same again: no event
    reg._apply_put(kv("/p/nodes/b", "alive", meta | {"dram_used": 5}))
    reg._apply_put(kv("/p/nodes/me", "alive", {}))  # this node's own key: no event
    assert reg._apply_put(kv("/other/nodes/x", "alive", meta)) is None
    reg._apply_put(SimpleNamespace(key=b"/p/nodes/c", value=b"not json", create_revision=1, mod_revision=1))
    assert [(e.kind, e.member.node_id) for e in events] == [(EventKind.JOINED, "b"), (EventKind.UPDATED, "b")]
    assert events[0].member.addr == ("127.0.0.1", 7001) and reg.stats["registry_malformed"] == 1
    reg._change("b", State.DEAD, meta, 5)  # its key deleted: the lease ran out
    reg._apply_put(kv("/p/nodes/b", "alive", meta, rev=9))  # back, a new process
    reg._apply_put(kv("/p/nodes/b", "left", meta, rev=9))  # a graceful stop
    assert [e.kind for e in events[2:]] == [EventKind.DEAD, EventKind.JOINED, EventKind.LEFT]
    assert events[3].previous == State.DEAD
    assert {m.node_id: m.state for m in reg.members()} == {"me": State.ALIVE, "b": State.LEFT}
