#!/usr/bin/env bash
# Set up a fresh machine (idempotent, incremental) and run the demo or the test suite:
#
#   bash scripts/run.sh demo     # virtualenv + build + `cbatch demo`
#   bash scripts/run.sh test     # virtualenv + build + pytest
#
# CBATCH_TORCH picks the torch requirement (default torch==2.13.0); PYTHON the interpreter
# that makes the virtualenv (default python3); VENV its folder (default .venv).
#
# requirements-dev.txt includes nvcc and the CUDA headers (CUDA 13.0 wheels from PyPI, inside
# the virtualenv, not on PATH): with them the tests compile csrc/cuda/*.cu for sm_80 and
# sm_90a on a machine without a GPU or a CUDA toolkit (tests/ops/test_cuda_compile.py).
#
# The pip installs (torch, requirements-dev.txt, the C++ build of cbatch) run only when what
# they depend on changed: a stamp in the virtualenv holds the hash of csrc/, setup.py,
# pyproject.toml, requirements-dev.txt, the torch requirement and this checkout's path.
# Python files need no reinstall (cbatch is installed in editable mode).
set -euo pipefail
cd "$(dirname "$0")/.."

what=${1:-}
case "$what" in
  demo|test) ;;
  *) echo "usage: bash scripts/run.sh demo|test [extra args]" >&2; exit 2 ;;
esac
shift

VENV=${VENV:-.venv}
TORCH_REQUIREMENT=${CBATCH_TORCH:-torch==2.13.0}
say() { echo "run.sh: $*"; }
if [ ! -x "$VENV/bin/python" ]; then
  say "creating the virtualenv $VENV with ${PYTHON:-python3}"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
py="$VENV/bin/python"  # `python -m pip`, not bin/pip: a copied venv's scripts point elsewhere

stamp_file="$VENV/.cbatch-install-stamp"
stamp=$(TORCH_REQUIREMENT="$TORCH_REQUIREMENT" "$py" - <<'PY'
import hashlib, os, pathlib
h = hashlib.sha256(f"{os.environ['TORCH_REQUIREMENT']}\n{os.getcwd()}\n".encode())
files = sorted(p for p in pathlib.Path("csrc").rglob("*") if p.is_file())
for p in files + [pathlib.Path(n) for n in ("setup.py", "pyproject.toml", "requirements-dev.txt")]:
    h.update(f"{p}\n".encode() + p.read_bytes())
print(h.hexdigest())
PY
)
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ]; then
  say "$VENV is up to date (csrc/, setup.py, pyproject.toml, requirements-dev.txt," \
      "$TORCH_REQUIREMENT unchanged); skipping pip. Delete $stamp_file to reinstall."
else
  rm -f "$stamp_file"
  say "[1/3] installing $TORCH_REQUIREMENT into $VENV"
  "$py" -m pip install "$TORCH_REQUIREMENT"
  say "[2/3] installing requirements-dev.txt (transformers, triton, the server, pytest," \
      "nvcc for the compile-only CUDA test, ...)"
  "$py" -m pip install -r requirements-dev.txt
  say "[3/3] building cbatch's C++ extension against that torch and installing cbatch" \
      "(editable; compiling can take minutes)"
  "$py" -m pip install --no-build-isolation --no-deps -e .
  echo "$stamp" > "$stamp_file"
  say "installed; cbatch --version says:"
  "$py" -m cbatch --version | sed 's/^/    /'
  say "to use cbatch from your shell: source $VENV/bin/activate"
fi

if [ "$what" = demo ]; then
  say "running the demo: $py -m cbatch demo $*"
  exec "$py" -m cbatch demo "$@"
else
  say "running the tests: $py -m pytest -q $*"
  exec "$py" -m pytest -q "$@"
fi
