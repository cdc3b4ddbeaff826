"""Pulling blocks toward a node before an engine there reads them: a disaggregated request's prefetch.

When a prefill engine stores its KV through one node and the decode engine reads
through another, the gateway asks the decode engine's node to pull the prompt's blocks
as soon as the prefill has answered, so the decode engine's connector reads them
locally. `prefetch` is that one call, whatever node the gateway runs on: on this node it
pulls directly, on another it sends `PEERPULL` over the cluster's authenticated peer
connections. `pull` is what the pulling node does: every key it lacks is read from the
pool as MGET's pool read does (from the holders the directory names, small values many to
a request) and kept, as `cluster.keep_fetched` keeps a peer's copy (with keep_fetched
off nothing is kept and a prefetch brings nothing).
"""

from __future__ import annotations

import asyncio
from typing import Any

from quilld.errors import QuillError
from quilld.model import IdentityScope, Pinned

MAX_PULL_KEYS = 65536  # keys one PEERPULL may name (ROUTE's MAX_BLOCKS)


async def pull(cluster: Any, scope: IdentityScope, keys: list[bytes]) -> int:
    """Bring `keys` of `scope` into this node; returns how many it holds now."""
    store = cluster.keyspace
    tag = cluster.scopes.tag(scope)
    missing = [k for k in keys if not store.contains(tag, k)]
    values = await cluster.pool_read_many(scope, tag, missing) if missing else []
    got = []
    for key, value in zip(missing, values):
        if value.__class__ is Pinned:
            value.release()
        got.append(value is not None and store.contains(tag, key))
    cluster.stats["prefetch_pulls"] += 1
    cluster.stats["prefetch_keys_pulled"] += sum(got)
    return len(keys) - len(missing) + sum(got)


async def prefetch(cluster: Any, node_id: str, scope: IdentityScope, keys: list[bytes], timeout: float) -> int:
    """Ask `node_id` (this node or a peer) to pull `keys` of `scope` now; the keys it holds once done.
    0 when it cannot be asked (no cluster, an unknown node) or did not answer within `timeout`."""
    if cluster is None or not keys:
        return 0
    if node_id == cluster.node_id:
        try:
            return await asyncio.wait_for(pull(cluster, scope, keys), timeout)
        except (asyncio.TimeoutError, QuillError):
            return 0
    addr = cluster.addresses.get(node_id)
    if addr is None:
        cluster.stats["prefetch_unknown_node"] += 1
        return 0
    cluster.stats["prefetch_asked"] += 1
    try:
        reply = await cluster.pool.call(*addr, "PEERPULL", *scope, *keys, timeout=timeout)
    except (OSError, QuillError):
        cluster.stats["prefetch_errors"] += 1
        return 0
    if type(reply) is not int:
        cluster.stats["prefetch_errors"] += 1
        return 0
    return reply
