"""Builds quilld's hot path with mypyc where it can, and plain Python where it cannot.

`pip install -e wire -e .` (or a wheel build) compiles the modules that quilld/native.py names
in HOT into C extensions with mypyc (pyproject.toml's build requirements bring mypy) and gcc,
then writes quilld/_compiled.json: the SHA-256 of each `.py` and of what it was compiled to,
so that a `.py` edited later is never shadowed by its stale extension (quilld/native.py).

Without a C compiler or Python's headers (Debian: `apt-get install gcc python3-dev`), or with
QUILLD_PURE_PYTHON=1 in the environment, the package installs as plain Python and says why
(run pip with -v to see this file's lines); quilld then runs the same `.py` files, slower.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
NATIVE = os.path.join(ROOT, "quilld", "native.py")


def _native() -> dict:
    """quilld/native.py's names, read without importing quilld (its dependencies may be missing)."""
    ns: dict = {"__file__": NATIVE, "__name__": "quilld_native_for_setup"}
    with open(NATIVE) as f:
        exec(compile(f.read(), NATIVE, "exec"), ns)
    return ns


def say(text: str) -> None:
    print(f"quilld build: {text}", file=sys.stderr, flush=True)


def _compiler_works() -> str | None:
    """None when a C compiler builds against this Python's headers, else why not."""
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        return f"no Python.h in {include} (Debian: apt-get install python3-dev)"
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    cc = os.environ.get("CC", cc).split()[0]
    if shutil.which(cc) is None:
        return f"no C compiler ({cc}; Debian: apt-get install gcc)"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write("#include <Python.h>\nint main(void) { return Py_IsInitialized(); }\n")
        try:
            done = subprocess.run([cc, "-c", src, "-I", include, "-o", os.path.join(tmp, "probe.o")],
                                  capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            return f"{cc} did not run: {e}"
        if done.returncode != 0:
            return f"{cc} cannot compile against Python.h: {done.stderr.strip()[:200]}"
    return None


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class BuildHot(build_ext):
    """build_ext, then the manifest of what was compiled from which source (quilld/native.py)."""

    def run(self) -> None:
        super().run()
        if all(ext in C_MODULES for ext in self.extensions):  # the hot path is not compiled: no manifest
            return
        native = _native()
        modules = {}
        for module in native["HOT"]:
            source = native["source_path"](module)
            built = self.get_ext_fullpath(module)
            inplace = native["extension_path"](module)
            ext = built if os.path.exists(built) else inplace
            modules[module] = {"source": _digest(source), "extension": _digest(ext)}
        group = self.get_ext_fullpath(native["GROUP"] + "__mypyc")
        from mypy.version import __version__ as mypy_version

        manifest = {"mypyc": mypy_version, "group": _digest(group), "modules": modules}
        text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
        targets = {os.path.join(ROOT, "quilld", native["MANIFEST"])}  # beside the sources (editable)
        if not self.inplace:
            targets.add(os.path.join(self.build_lib, "quilld", native["MANIFEST"]))  # and in the wheel
        for path in targets:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        say(f"compiled {len(modules)} modules with mypyc {mypy_version}")


# setup.py's commands that build something; the others (egg_info, dist_info: pip asks for the
# metadata first) need no extensions, and mypyc takes some seconds to generate them
BUILDING = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}


# C that has no Python twin, built whenever a compiler works (QUILLD_PURE_PYTHON or not): LZF
# decompression for RESTORE (quilld/_lzf.c; without it quilld refuses LZF payloads, rdb_payload.py)
C_MODULES = [Extension("quilld._lzf", ["quilld/_lzf.c"])]


def extensions() -> list:
    if not BUILDING & set(sys.argv[1:]):
        return []
    native = _native()
    manifest = os.path.join(ROOT, "quilld", native["MANIFEST"])
    compiler = _compiler_works()
    if compiler is not None:
        say(f"quilld/_lzf.c is not built, RESTORE refuses LZF payloads: {compiler}")
    c_modules = C_MODULES if compiler is None else []
    if os.environ.get(native["PURE_ENV"], "") not in ("", "0"):
        reason = f"{native['PURE_ENV']} is set"
    else:
        reason = compiler
        if reason is None:
            try:
                from mypyc.build import mypycify
            except ImportError as e:
                reason = f"mypyc is not installed ({e})"
    if reason is not None:
        if os.path.exists(manifest):
            os.remove(manifest)  # whatever an earlier build compiled is not used (quilld/native.py)
        say(f"pure Python, the hot path is not compiled: {reason}")
        return c_modules
    paths = [os.path.relpath(native["source_path"](m), ROOT) for m in native["HOT"]]
    say(f"compiling with mypyc: {' '.join(paths)}")
    cwd = os.getcwd()
    os.chdir(ROOT)  # mypyc names modules after paths relative to here
    try:
        return c_modules + mypycify(["--config-file", os.path.join(ROOT, "pyproject.toml"), *paths],
                                    group_name=native["GROUP"], opt_level="3", debug_level="0")
    finally:
        os.chdir(cwd)


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildHot})
