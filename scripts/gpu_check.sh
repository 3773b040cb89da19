#!/usr/bin/env bash
# Everything a GPU session should run, in as few device calls as possible.  On the device
# machine, from the repository root:
#
#   bash scripts/gpu_check.sh check      # build, quant, suite, sanitizers, engine run, first
#                                        #   token
#   bash scripts/gpu_check.sh quant      # build + the quantized GEMMs' tests on CUDA (Triton
#                                        #   W8A16/W4A16/W8A8 against float64 dequantize-then-
#                                        #   matmul, slow cases included; a quantized engine)
#   bash scripts/gpu_check.sh tests      # build + the test suite on CUDA
#   bash scripts/gpu_check.sh sanitize   # build + compute-sanitizer memcheck (kernels and a
#                                        #   short engine run), racecheck, initcheck (kernels)
#   bash scripts/gpu_check.sh firsttoken # build + import -> first token of
#                                        #   cbatch.LLM("random:gpt2", device="cuda"), cold
#   bash scripts/gpu_check.sh bench      # build + the benchmarks (full grids)
#   bash scripts/gpu_check.sh bench decode_attention mixed_step   # build + only these
#   bash scripts/gpu_check.sh bench quant_matmul   # the quantized GEMMs: decode (M 1, 8) and
#                                        #   prefill (M 512, 2048) shapes beside dense fp16
#   bash scripts/gpu_check.sh all        # check + bench
#
# A device call is limited to 10 minutes: `check` in one call (every stage has a time
# limit, so the summary is always written), then `bench decode_attention prefill_attention
# mixed_step quant_matmul`, then `bench decode_step throughput`.
#
# Each stage prints one line "PASS|FAIL <stage> <seconds>s <note>", also collected in
# $OUT/summary.txt; the exit status is non-zero if any stage failed.  Logs go to $OUT
# (default /tmp/cbatch-gpu); benchmark results to benchmarks/results/<device>/ and a copy
# under $OUT/results to bring back.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/cbatch-gpu}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
what=${1:-check}
case "$what" in
  tests|quant|sanitize|firsttoken|check|bench|all) ;;
  *) echo "usage: bash scripts/gpu_check.sh check|tests|quant|sanitize|firsttoken|bench [names]|all" >&2
     exit 2 ;;
esac
shift || true
benches=${*:-decode_attention prefill_attention mixed_step quant_matmul decode_step throughput}
PY=${PYTHON:-python3}  # the device image's python3 is the one that holds torch
mkdir -p "$OUT"
: > "$OUT/summary.txt"
failed=0

# stage NAME LIMIT_S LOG CMD...: run CMD under a time limit with its output in LOG, then
# print and record one summary line.
stage() {
  local name=$1 limit=$2 log=$3 start rc note
  shift 3
  start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  rc=$?
  note=$(tail -n 1 "$log" | cut -c1-160)
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    note="timed out after ${limit}s; $note"
  fi
  local line
  if [ "$rc" -eq 0 ]; then line="PASS"; else line="FAIL"; failed=1; fi
  line="$line $name $((SECONDS - start))s rc=$rc $note"
  echo "$line" | tee -a "$OUT/summary.txt"
  return "$rc"
}

wants() {  # wants STAGE: does $what include it?
  case "$what:$1" in
    check:quant|check:tests|check:sanitize|check:firsttoken|all:*) return 0 ;;
    "$1:$1") return 0 ;;
    *) return 1 ;;
  esac
}

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
stage build 400 "$OUT/build.log" \
  "$PY" -m pip install --no-build-isolation --no-deps -e . || { tail -40 "$OUT/build.log"; exit 1; }
"$PY" -c "import cbatch.ops as o; [print(k, v) for k, v in o.available_backends().items()]; \
import cbatch.ops.compiled as c; print('build', c.build_info())" | tee "$OUT/backends.txt"

if wants quant; then  # first: the suite's time limit may stop it before it reaches them
  stage quant 180 "$OUT/quant.log" "$PY" -m pytest -q -ra -m "slow or not slow" \
    tests/ops/test_triton_quant_matmul.py tests/models/test_quantized_models.py
  grep -E "^(FAILED|ERROR)" "$OUT/quant.log" | head -20
fi
if wants tests; then
  xdist=()  # pytest-xdist only where the image has it (the device has no package registry)
  if "$PY" -c "import xdist" 2> /dev/null; then xdist=(-n auto); fi
  stage tests "${CBATCH_SUITE_LIMIT:-300}" "$OUT/pytest.log" \
    "$PY" -m pytest -q -ra "${xdist[@]}" tests
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
fi
if wants sanitize; then
  # memcheck: out-of-bounds accesses (kernels, then a short engine run); racecheck:
  # shared-memory hazards; initcheck: reads of device memory nothing wrote (torch.empty).
  san=(compute-sanitizer --error-exitcode 1 --tool)
  stage memcheck 150 "$OUT/memcheck.log" \
    "${san[@]}" memcheck --leak-check no "$PY" scripts/sanitize_run.py
  stage racecheck 120 "$OUT/racecheck.log" \
    "${san[@]}" racecheck "$PY" scripts/sanitize_run.py --kernels-only
  stage initcheck 120 "$OUT/initcheck.log" \
    "${san[@]}" initcheck "$PY" scripts/sanitize_run.py --kernels-only
fi
if wants firsttoken; then
  # A cold start: a fresh Triton cache, so every kernel the first step needs compiles.
  cache=$(mktemp -d)
  stage firsttoken 120 "$OUT/firsttoken.log" \
    env TRITON_CACHE_DIR="$cache" "$PY" scripts/first_token.py --device cuda
  rm -rf "$cache"
fi
if wants bench; then
  dev=$("$PY" -c "import torch, sys; sys.path.insert(0, '.'); \
from benchmarks.common import device_slug; print(device_slug(torch.device('cuda')))")
  for b in $benches; do  # into the device's results folder, to be committed on purpose
    stage "bench_$b" 600 "$OUT/bench_$b.log" "$PY" "benchmarks/bench_$b.py" --no-progress \
      --out "benchmarks/results/$dev"
  done
  mkdir -p "$OUT/results" && cp -r "benchmarks/results/$dev" "$OUT/results/"
fi
exit "$failed"
