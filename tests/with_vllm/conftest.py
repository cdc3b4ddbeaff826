"""Tests against vLLM 0.33's own classes, on CPU (.ci/run installs torch and vLLM for them).

Outside CI a machine without vLLM skips them, saying so; in CI (CI=true) a missing vLLM fails
the run, since a test skipped for a missing tool is a test that did not run."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

try:
    import vllm  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the machine
    if os.environ.get("CI"):
        raise RuntimeError(f"CI needs vLLM 0.33 for tests/with_vllm ({e}); .ci/run installs it") from None
    pytest.skip(f"vLLM is not installed here ({e}); .ci/run installs it", allow_module_level=True)
