#!/usr/bin/env bash
# Everything a GPU session should run, in as few device calls as possible.  On the device
# machine, from the repository root:
#
#   bash scripts/gpu_check.sh tests      # build + full test suite on CUDA
#   bash scripts/gpu_check.sh sanitize   # build + compute-sanitizer memcheck (kernels, engine)
#   bash scripts/gpu_check.sh check      # build + tests + sanitize
#   bash scripts/gpu_check.sh bench      # build + the five benchmarks (full grids)
#   bash scripts/gpu_check.sh bench decode_attention mixed_step   # build + only these
#   bash scripts/gpu_check.sh all        # everything
#
# A device call is limited to 10 minutes: `check` in one call, then
# `bench decode_attention prefill_attention mixed_step`, then `bench decode_step throughput`.
#
# Logs go to $OUT (default /tmp/cbatch-gpu); benchmark results to
# benchmarks/results/<device>/ and a copy under $OUT/results to bring back.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cbatch-gpu}
mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
what=${1:-all}
case "$what" in
  tests|sanitize|check|bench|all) ;;
  *) echo "usage: bash scripts/gpu_check.sh tests|sanitize|check|bench [names]|all" >&2; exit 2 ;;
esac
shift || true
benches=${*:-decode_attention prefill_attention mixed_step decode_step throughput}
PY=${PYTHON:-python3}  # the device image's python3 is the one that holds torch

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
if ! "$PY" -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  exit 1
fi
"$PY" -c "import cbatch.ops as o; [print(k, v) for k, v in o.available_backends().items()]" \
  | tee "$OUT/backends.txt"
rc=0

if [ "$what" = tests ] || [ "$what" = check ] || [ "$what" = all ]; then
  "$PY" -m pytest -q -ra tests > "$OUT/pytest.log" 2>&1 || rc=1
  tail -15 "$OUT/pytest.log"
fi
if [ "$what" = sanitize ] || [ "$what" = check ] || [ "$what" = all ]; then
  compute-sanitizer --tool memcheck --leak-check no "$PY" scripts/sanitize_run.py \
    > "$OUT/memcheck.log" 2>&1 || rc=1
  tail -8 "$OUT/memcheck.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for b in $benches; do
    "$PY" "benchmarks/bench_$b.py" --no-progress > "$OUT/bench_$b.log" 2>&1 || rc=1
    tail -3 "$OUT/bench_$b.log"
  done
  dev=$("$PY" -c "import torch, sys; sys.path.insert(0, '.'); \
from benchmarks.common import device_slug; print(device_slug(torch.device('cuda')))")
  mkdir -p "$OUT/results" && cp -r "benchmarks/results/$dev" "$OUT/results/"
fi
exit $rc
