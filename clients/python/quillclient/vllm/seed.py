"""Whether vLLM's block hashes can be shared: the NONE_HASH seed they start from.

Engines find each other's blocks only when their hashes agree, and vLLM seeds the hash chain
from PYTHONHASHSEED; for `xxhash`/`xxhash_cbor` without PYTHONHASHSEED the seed is random per
process, so nothing one engine stores could be found by another (or by itself after a restart).
The tier and the connector both refuse that at start.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

RANDOM_SEED_ALGOS = ("xxhash", "xxhash_cbor")  # vLLM seeds NONE_HASH randomly for these without PYTHONHASHSEED


class SeedGuard:
    """Stops a tier or connector for good once vLLM's hash seed turns out random (known only after
    vLLM seeded its hashes, so checked at every lookup, not once at start)."""

    def __init__(self, who: str, allow: bool) -> None:
        self.who, self.allow = who, allow
        self.why = ""  # why it stopped ('' while it serves)

    def refused(self) -> bool:
        if self.why:
            return True
        why = random_seed_now()
        if why and not self.allow:
            self.why = why
            log.error("%s: %s; it stores and finds nothing (set PYTHONHASHSEED, the same on every engine, or "
                      "allow_private_seed: true)", self.who, why)
            return True
        return False


def check_seed_at_start(who: str, allow: bool, config=None) -> None:
    """Refuse at start when vLLM's config (given, or the current one) says the seed will be random."""
    if os.environ.get("PYTHONHASHSEED") is not None:
        return
    if config is None:
        try:
            from vllm.config import get_current_vllm_config_or_none
            config = get_current_vllm_config_or_none()
        except ImportError:
            config = None
    algo = getattr(getattr(config, "cache_config", None), "prefix_caching_hash_algo", None)
    if algo in RANDOM_SEED_ALGOS:
        why = (f"prefix_caching_hash_algo {algo} without PYTHONHASHSEED seeds block hashes randomly per "
               "process: no other engine could find what this one stores")
        if not allow:
            raise ValueError(f"{who}: {why}. Set PYTHONHASHSEED (the same on every engine), or "
                             "allow_private_seed: true")
        log.warning("%s: %s (allow_private_seed)", who, why)


def random_seed_now() -> str:
    """Why the seed vLLM derived NONE_HASH from is private to this process ('' when it is not)."""
    if os.environ.get("PYTHONHASHSEED") is not None:
        return ""
    from vllm.v1.core import kv_cache_utils
    seed = getattr(kv_cache_utils, "_NONE_HASH_SEED", None)
    if seed is None or seed == kv_cache_utils.DEFAULT_NONE_HASH_SEED:
        return ""
    return "vLLM seeded its block hashes randomly (an xxhash algo without PYTHONHASHSEED)"
