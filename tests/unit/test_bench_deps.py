"""The benches run with the `bench` extra alone: no pytest, no test harness (issue 18.10).

Each bench is started with `--help` in a Python where pytest cannot be imported, as on a
machine that installed `.[bench]` and not `.[test]`; and every package a bench (or a
module it imports from tests/) imports is a runtime dependency or in the `bench` extra.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHES = sorted(p for p in (ROOT / "bench").glob("*_bench.py")) + [ROOT / "bench" / "vs_redis.py",
                                                                     ROOT / "bench" / "index_study.py"]
LOCAL = {"plot", "procs", "index_trace", "vs_redis", "vllm_schema", "netns", "netns_cluster", "quilld", "quillclient",
         "quillwire", "vllm_configs", "etcd_cluster"}
OPTIONAL = {"mooncake",  # --mooncake only, never a dependency (get_into_bench.py says how to install it)
            "sglang", "torch",  # SGLang's own classes when installed (docs/connectors.md); replayed without them
            "vllm"}  # vllm_tier_bench.py, vllm_connector_bench.py: imported when they run (.ci/run installs vLLM)
# import name -> distribution where they differ, for a package this Python has not installed (the
# test extra does not hold the bench extra: packages_distributions() knows installed ones only)
DISTRIBUTION_OF = {"blart": "blart-py", "zmq": "pyzmq"}
# what the benches import from tests/: it must not need the test extra either
FROM_TESTS = [ROOT / "tests" / "procs.py", ROOT / "tests" / "vllm_schema.py", ROOT / "tests" / "netns.py",
              ROOT / "tests" / "netns_cluster.py", ROOT / "tests" / "vllm_configs.py", ROOT / "tests" / "etcd_cluster.py"]

_NO_PYTEST = """
import os, runpy, sys
sys.modules["pytest"] = None  # as if only the bench extra were installed
sys.argv = [sys.argv[1], "--help"]
sys.path[0] = os.path.dirname(sys.argv[0])  # as `python bench/x.py` starts
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("bench", BENCHES, ids=lambda p: p.name)
def test_bench_starts_without_pytest(bench):
    out = subprocess.run([sys.executable, "-c", _NO_PYTEST, str(bench)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def test_bench_extra_holds_every_package_the_benches_import():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _requirement_names(project["dependencies"]) | _requirement_names(
        project["optional-dependencies"]["bench"])
    dists = packages_distributions()
    missing = {}
    for path in BENCHES + FROM_TESTS:
        for name in _imports(path) - LOCAL - OPTIONAL - set(sys.stdlib_module_names) - {"__future__"}:
            owners = {d.lower().replace("_", "-") for d in dists.get(name, [DISTRIBUTION_OF.get(name, name)])}
            if not owners & declared:
                missing.setdefault(path.name, set()).add(name)
    assert not missing, f"imported by the benches but in neither the dependencies nor the bench extra: {missing}"


_NO_BLART = """
import os, runpy, sys
sys.modules["blart"] = None  # as if the bench extra were not installed
sys.argv = [sys.argv[1], *sys.argv[2:]]
sys.path[0] = os.path.dirname(sys.argv[0])
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_the_index_study_runs_without_blart_and_says_it_skipped_the_art_row(tmp_path):
    """Issue 29, item 8: `bench/index_study.py --quick` died with ModuleNotFoundError: No module named
    'blart' unless the bench extra was installed. The ART row is optional: skipped, with one line
    saying why (a tiny trace and the memory backend alone here: the path is the same)."""
    out = subprocess.run([sys.executable, "-c", _NO_BLART, str(ROOT / "bench" / "index_study.py"), "--backends",
                          "memory", "--blocks", "2000", "--dir", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ART row skipped: blart-py is not installed (it is in the bench extra: pip install -e '.[bench]')" \
        in out.stdout, out.stdout
    assert "memory " in out.stdout and "ART (blart-py" not in out.stdout
