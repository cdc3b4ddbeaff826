"""quilld for vLLM 0.33: a secondary tier of vLLM's own offloading, and a KV connector.

Both are named by a user's vLLM config, so this package exports them by those names:

- `QuillTier` (quillclient/vllm/tier.py): a `SecondaryTierManager` for `OffloadingConnector`
  with `TieringOffloadingSpec`: `secondary_tiers: [{"type": "QuillTier", "module_path":
  "quillclient.vllm", ...}]`;
- `QuillConnector` (quillclient/vllm/connector.py): a `KVConnectorBase_V1`:
  `{"kv_connector": "QuillConnector", "kv_connector_module_path": "quillclient.vllm", ...}`.

Importing `quillclient` or this package imports nothing of vLLM (or torch): each class is
loaded on first use, so the client library works where vLLM is not installed
(`pip install -e 'clients/python[vllm]'` from a checkout adds what the classes need).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"QuillTier": ".tier", "QuillConnector": ".connector"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
