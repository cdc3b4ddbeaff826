"""Which build of the hot path runs (quilld/native.py): the compiled modules only when every one
matches the `.py` it was compiled from, never a stale or foreign extension
(tests/blackbox/test_native_build.py: INFO and the start log say which).

Each case copies the package to a temporary directory, changes it, and imports it in a fresh
interpreter (the choice is made once, at `import quilld`).
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from procs import ROOT
from quilld import native

PROBE = """
import json, sys
import quilld, quilld.native as n
import quilld.protocol.server, quilld.protocol.commands.strings
mods = {m: sys.modules[m].__file__ for m in n.HOT}
print(json.dumps({"build": n.BUILD, "reason": n.REASON, "running": n.running()[0], "files": mods}))
"""
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def copy_package(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "quilld", tmp_path / "quilld", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def probe(tree: Path, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != native.PURE_ENV}
    environ.update(env, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, "-c", PROBE], env=environ, capture_output=True, text=True, timeout=120,
                          cwd=tree)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def from_sources(result: dict, tree: Path) -> bool:
    return all(f == str(tree / "quilld" / Path(*m.split(".")[1:])) + ".py" for m, f in result["files"].items())


def test_a_foreign_extension_beside_a_module_is_never_loaded(tmp_path):
    # no manifest: whatever sits beside the .py files (here not even an extension) is passed over
    tree = copy_package(tmp_path)
    (tree / "quilld" / native.MANIFEST).unlink(missing_ok=True)
    for module in native.HOT:
        Path(native.source_path(module).replace(str(ROOT / "quilld"), str(tree / "quilld"))[:-3] + SUFFIX).write_bytes(
            b"not an extension")
    result = probe(tree)
    assert result["build"] == "pure" and result["running"] == "pure"
    assert "manifest" in result["reason"] or "_compiled.json" in result["reason"]
    assert from_sources(result, tree)


def test_a_manifest_naming_other_sources_is_refused(tmp_path):
    tree = copy_package(tmp_path)
    for module in native.HOT:
        Path(str(tree / "quilld" / Path(*module.split(".")[1:])) + SUFFIX).write_bytes(b"not an extension")
    (tree / "quilld" / native.MANIFEST).write_text(json.dumps(
        {"group": "0", "modules": {m: {"source": "0" * 64, "extension": "0" * 64} for m in native.HOT}}))
    result = probe(tree)
    assert result["build"] == "pure" and "changed since it was compiled" in result["reason"]
    assert from_sources(result, tree)


compiled_here = pytest.mark.skipif(
    not native.check()[0], reason="this tree runs the pure build (pip install -e . compiles it; CI's is compiled)")


@compiled_here
def test_the_compiled_modules_run_when_they_match_their_sources(tmp_path):
    result = probe(copy_package(tmp_path))
    assert result["build"] == "compiled" and result["running"] == "compiled"
    assert all(not f.endswith(".py") for f in result["files"].values())


@compiled_here
def test_an_edited_source_is_run_instead_of_its_stale_extension_and_so_are_the_others(tmp_path):
    tree = copy_package(tmp_path)
    table = tree / "quilld" / "protocol" / "table.py"
    table.write_text(table.read_text() + "\nEDITED_AFTER_THE_BUILD = True\n")
    result = probe(tree)
    assert result["build"] == "pure" and result["running"] == "pure"
    assert "quilld.protocol.table" in result["reason"] and "stale" in result["reason"]
    assert from_sources(result, tree)  # all of them, not only the edited one: never mixed


@compiled_here
def test_quilld_pure_python_runs_the_sources(tmp_path):
    tree = copy_package(tmp_path)
    result = probe(tree, **{native.PURE_ENV: "1"})
    assert result["build"] == "pure" and native.PURE_ENV in result["reason"]
    assert from_sources(result, tree)
