#!/usr/bin/env bash
# Redis's own TCL test suite (tag 7.0.15) against quilld, one unit at a time, in
# external-server mode; prints ok/err counts per unit and their total.
#
#   bash bench/redis_suite.sh /path/to/redis-checkout-at-7.0.15 [unit ...]
#
# The checkout is not part of this repository (never vendor it): clone
# redis/redis and `git checkout 7.0.15`. External-server mode calls
# `FUNCTION FLUSH` before each block, which quilld (no scripting) refuses; this
# script wraps that one line in `catch` in a copy of the checkout's
# tests/support/server.tcl, leaving the checkout itself untouched. Needs tclsh
# (Debian: tcl) and redis-cli. Logs: $OUT/<unit>.log (OUT defaults to a temp dir).
#
# The suite's own server config (tests/assets/default.conf) sets `enable-debug-command yes`;
# in external mode quilld's config applies instead, so quilld is started here with
# security.enable_debug_command = yes to match (its default is "no", as redis's).
# DEBUG_COMMAND=no runs the suite without DEBUG, as a quilld with the default config would.
# SUITE_ARGS are passed on to test_helper.tcl (e.g. SUITE_ARGS='--skiptest "DISCARD should not fail"' to
# see what the tests after a failing one do when it does not leave its client in MULTI).
set -euo pipefail
REDIS=${1:?usage: redis_suite.sh REDIS_CHECKOUT [unit ...]}
shift
UNITS=${*:-unit/type/string unit/keyspace unit/expire unit/protocol unit/introspection unit/info-command unit/quit unit/multi}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
WORK=$(mktemp -d)
cp -r "$REDIS/tests" "$WORK/tests"
sed -i 's/^    r function flush$/    catch {r function flush}/' "$WORK/tests/support/server.tcl"
PORT=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
(cd "$ROOT" && QUILLD_SECURITY_ENABLE_DEBUG_COMMAND=${DEBUG_COMMAND:-yes} PYTHONPATH="$ROOT" exec python3 -m quilld --port "$PORT" --admin-port 0 --dram 256MiB \
    --log-level warning) > "$OUT/quilld.log" 2>&1 &
QPID=$!
trap 'kill $QPID 2>/dev/null; rm -rf "$WORK"' EXIT
for _ in $(seq 100); do
  [ "$(timeout 1 redis-cli -p "$PORT" PING 2>/dev/null)" = PONG ] && break
  sleep 0.2
done
total_ok=0; total_err=0
cd "$WORK"
for u in $UNITS; do
  log="$OUT/$(echo "$u" | tr / _).log"
  timeout 900 tclsh tests/test_helper.tcl --host 127.0.0.1 --port "$PORT" --single "$u" --singledb \
    --ignore-encoding --ignore-digest --durable ${SUITE_ARGS:-} > "$log" 2>&1 || true
  sed -i 's/\x1b\[[0-9;]*m//g' "$log"
  ok=$(grep -c '^\[ok\]' "$log" || true); err=$(grep -c '^\[err\]' "$log" || true)
  exc=$(grep -c '^\[exception\]' "$log" || true)
  total_ok=$((total_ok + ok)); total_err=$((total_err + err))
  echo "$u ok=$ok err=$err exception=$exc"
done
echo "total ok=$total_ok err=$total_err (logs in $OUT)"
