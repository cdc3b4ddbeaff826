# Sourced (never run) by .ci/run and tools/serve, from the checkout's root: what both need to get a
# Python that may install this project, on a fresh Debian machine as on a developer's.

# apt_install PKG...: install Debian packages (as root, or through sudo), quietly.
apt_install() {
  [ $# -gt 0 ] || return 0
  echo "installing $* (apt-get)"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}

# build_needs: the Debian packages missing for `pip install -e .` to compile the hot path with mypyc
# (setup.py, quilld/native.py): gcc and Python's headers. Without them it installs the plain build.
build_needs() {
  command -v gcc >/dev/null 2>&1 || echo gcc
  python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    || echo python3-dev
}

# use_python: sets PY to a python that may install packages. A python3 that refuses to install
# outside a virtual environment (Debian's own, PEP 668) gets the checkout's .venv instead, made once
# (Debian's python3-venv installed first when ensurepip is missing), and .venv/bin goes first on PATH.
use_python() {
  PY=python3
  if [ -z "${VIRTUAL_ENV:-}" ] && [ -n "$(python3 -c 'import sys, sysconfig, os; print("y" if os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) and sys.prefix == sys.base_prefix else "")')" ]; then
    if [ ! -x .venv/bin/python ]; then
      python3 -c 'import ensurepip' 2>/dev/null || apt_install python3-venv
      python3 -m venv .venv
    fi
    PY=.venv/bin/python
    export PATH="$PWD/.venv/bin:$PATH"
  fi
}
