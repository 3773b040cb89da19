#!/usr/bin/env bash
# Set up a fresh machine (idempotent) and run the demo or the test suite:
#
#   bash scripts/run.sh demo     # virtualenv + build + `cbatch demo`
#   bash scripts/run.sh test     # virtualenv + build + pytest
#
# CBATCH_TORCH picks the torch requirement (default torch==2.13.0); PYTHON the interpreter
# that makes the virtualenv (default python3); VENV its folder (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."

what=${1:-}
case "$what" in
  demo|test) ;;
  *) echo "usage: bash scripts/run.sh demo|test [extra args]" >&2; exit 2 ;;
esac
shift

VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
"$VENV/bin/pip" install -q "${CBATCH_TORCH:-torch==2.13.0}"
"$VENV/bin/pip" install -q -r requirements-dev.txt
"$VENV/bin/pip" install -q --no-build-isolation --no-deps -e .

if [ "$what" = demo ]; then
  exec "$VENV/bin/cbatch" demo "$@"
else
  exec "$VENV/bin/python" -m pytest -q "$@"
fi
