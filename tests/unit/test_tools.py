"""Scripts in tools/ are run by hand, some in another environment (SGLang's own virtual
environment for tools/sglang_check.py, docs/connectors.md): each answers --help anywhere,
with no pytest and none of the optional packages it checks, and says plainly what it lacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = sorted((ROOT / "tools").glob("*.py"))

_WITHOUT = """
import os, runpy, sys
for name in ("pytest", "sglang", "torch", "vllm"):
    sys.modules[name] = None  # as on a machine without them, even where they are installed
script, *args = sys.argv[1:]
sys.argv = [script, *args]
sys.path[0] = os.path.dirname(script)  # as `python tools/x.py` starts
runpy.run_path(script, run_name="__main__")
"""


def run(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _WITHOUT, str(script), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_there_are_tools():
    assert ROOT / "tools" / "sglang_check.py" in TOOLS


@pytest.mark.parametrize("script", TOOLS, ids=lambda p: p.name)
def test_tool_answers_help_without_its_optional_packages(script):
    out = run(script, "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage:"), out.stdout


def test_the_vllm_fixture_maker_says_vllm_is_missing_and_writes_nothing(tmp_path):
    out = run(ROOT / "tools" / "make_vllm_hash_fixtures.py", "--out", str(tmp_path / "x.json"))
    assert out.returncode == 1 and "vLLM is not importable here" in out.stderr, out
    assert not (tmp_path / "x.json").exists()


def test_the_chat_render_fixture_maker_says_vllm_is_missing_and_writes_nothing(tmp_path):
    out = run(ROOT / "tools" / "make_chat_render_fixtures.py", "--out", str(tmp_path / "fx"))
    assert out.returncode == 1 and "vLLM is not importable here" in out.stderr, out
    assert not (tmp_path / "fx").exists()


def test_sglang_check_says_sglang_is_missing_before_starting_anything():
    out = run(ROOT / "tools" / "sglang_check.py")
    assert out.returncode == 1, out
    assert "SGLang is not importable here" in out.stderr and "run this in SGLang's environment" in out.stderr
