"""Which build of the hot path runs: the modules mypyc compiled, or their `.py` sources.

The `.py` files are the source of truth. `setup.py` compiles the modules named in `HOT` with
mypyc when it can (mypyc installed, a C compiler and Python's headers there, and
`QUILLD_PURE_PYTHON` not set) and writes `MANIFEST` beside them: for each module the SHA-256
of the `.py` it was compiled from and of the extension it produced. `choose()` runs first
thing when `quilld` is imported (quilld/__init__.py) and uses the compiled modules only if
every one of them matches: a `.py` edited since it was compiled (a stale `.so`), an extension
missing or changed, or `QUILLD_PURE_PYTHON=1` in the environment, and all of them load from
their `.py` sources instead, together (a compiled module calls the others of its group
natively, so the two builds are never mixed). `BUILD` says which runs ("compiled" or
"pure"), `REASON` why; INFO server shows it (`quilld_build`) and the node logs it at start.

Standard library only: setup.py reads `HOT` and `MANIFEST` from this file before anything
of quilld can be imported.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from typing import Any

# The command loop, smallest set that holds it: parse and encode, the server shell's loop,
# dispatch, the string handlers, the session and the keyspace's lookups and publishes.
HOT = (
    "quilld.protocol.resp",
    "quilld.protocol.server",
    "quilld.protocol.table",
    "quilld.protocol.commands.strings",
)
GROUP = "quilld._hot"  # mypyc's shared library for the group: quilld/_hot__mypyc.*.so
MANIFEST = "_compiled.json"  # beside this file, written by setup.py after a compiled build
PURE_ENV = "QUILLD_PURE_PYTHON"

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
BUILD = "pure"
REASON = "not chosen yet"


def source_path(module: str) -> str:
    """The `.py` of a module of quilld (`quilld.protocol.resp` -> .../quilld/protocol/resp.py)."""
    return os.path.join(PACKAGE_DIR, *module.split(".")[1:]) + ".py"


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def extension_path(module: str) -> str | None:
    """The compiled extension of `module` that an import would find first, or None."""
    base = source_path(module)[:-3]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if os.path.exists(base + suffix):
            return base + suffix
    return None


def _group_path() -> str | None:
    base = os.path.join(PACKAGE_DIR, GROUP.split(".", 1)[1] + "__mypyc")
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if os.path.exists(base + suffix):
            return base + suffix
    return None


def check(package_dir: str | None = None) -> tuple[bool, str]:
    """(whether the compiled modules may be used, why or why not)."""
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return False, f"{PURE_ENV}={os.environ[PURE_ENV]}"
    found = {m: extension_path(m) for m in HOT}
    if not any(found.values()):
        return False, "no compiled modules (built without mypyc or a C compiler)"
    try:
        with open(os.path.join(package_dir or PACKAGE_DIR, MANIFEST)) as f:
            manifest: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        return False, f"compiled modules without a readable {MANIFEST}"
    entries = manifest.get("modules", {})
    group = _group_path()
    for module, ext in found.items():
        entry = entries.get(module)
        if ext is None or entry is None:
            return False, f"{module} was not compiled with the others"
        if digest(source_path(module)) != entry.get("source"):
            return False, f"{module}'s .py changed since it was compiled (stale extension)"
        if digest(ext) != entry.get("extension"):
            return False, f"{module}'s extension is not the one the manifest names"
    if group is None or digest(group) != manifest.get("group"):
        return False, "the group library is missing or not the one the manifest names"
    return True, f"{len(HOT)} modules compiled with mypyc {manifest.get('mypyc', '?')}"


class _Sources(importlib.abc.MetaPathFinder):
    """Loads the modules of HOT from their `.py`, past any extension beside them."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in HOT:
            return None
        return importlib.util.spec_from_file_location(name, source_path(name))


def choose() -> None:
    """Decide the build, once, before any module of HOT is imported."""
    global BUILD, REASON
    if BUILD == "compiled" or any(isinstance(f, _Sources) for f in sys.meta_path):
        return
    ok, REASON = check()
    if ok:
        BUILD = "compiled"
    else:
        BUILD = "pure"
        if any(extension_path(m) for m in HOT):
            sys.meta_path.insert(0, _Sources())


def running() -> tuple[str, str]:
    """(what actually runs, why): "compiled" when every module of HOT imported so far came from its
    extension, "pure" when none did ("mixed" would be a bug: `choose` loads them all one way)."""
    loaded = [sys.modules[m] for m in HOT if m in sys.modules]
    compiled = [not str(getattr(m, "__file__", "")).endswith(".py") for m in loaded]
    if compiled and all(compiled):
        return "compiled", REASON
    if any(compiled):
        return "mixed", REASON
    return "pure", REASON
