"""The guard every tests/with_vllm module calls before importing vLLM.

Here, not in a conftest.py of that folder: a second module named `conftest` would take the place
of tests/conftest.py in sys.modules for the rest of an xdist worker, and break every
`from conftest import ...` after it. Outside CI a machine without vLLM skips the module, saying
so; in CI (CI=true) a missing vLLM fails the run, since a skipped test is a test that did not run.
"""

from __future__ import annotations

import os

import pytest


def require_vllm() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import vllm  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the machine
        if os.environ.get("CI"):
            raise RuntimeError(f"CI needs vLLM 0.33 for tests/with_vllm ({e}); .ci/run installs it") from None
        pytest.skip(f"vLLM is not installed here ({e}); .ci/run installs it", allow_module_level=True)
