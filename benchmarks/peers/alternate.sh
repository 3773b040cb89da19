#!/usr/bin/env bash
# One round of cbatch beside its peers, alternated (benchmarks/NOTES.md, "The lm_head's greedy
# screen"): cbatch, then (fp32) cbatch with its greedy screen off, then each peer named (2 reps
# each): `openvino` (the default; for `seed` also with its prefix cache) and `vllm`.  Set up
# the peers first as benchmarks/peers/README.md says (PEERS, default /tmp/peers, holds their
# venvs, the checkpoint, the IR and the workloads).  Greedy unless SAMPLE gives the sampling
# flags, which every engine takes alike (request i seeded with --seed + i, default 0; the
# screen-off run is left out, as the screen serves greedy rows only):
#
#   bash benchmarks/peers/alternate.sh seed|longtail float32|bfloat16 [openvino] [vllm]
#   SAMPLE="--temperature 0.8 --top-p 0.95" bash benchmarks/peers/alternate.sh seed bfloat16 \
#       openvino vllm
set -euo pipefail
cd "$(dirname "$0")/../.."
workload=${1:?usage: alternate.sh seed|longtail float32|bfloat16}
dtype=${2:?usage: alternate.sh seed|longtail float32|bfloat16}
peers=${PEERS:-/tmp/peers}
shift 2
names=("${@:-openvino}")
read -r -a sample <<< "${SAMPLE:-}"  # the sampling flags, as words (none: greedy)
args=(--workload "$workload")
[ "$workload" = longtail ] && args+=(--scale 0.125 --max-len 256)
precision=$([ "$dtype" = bfloat16 ] && echo bf16 || echo fp32)
echo "== $(date -u +%H:%M:%S) $workload $dtype ${SAMPLE:-greedy}," \
  "load $(cut -d' ' -f1 /proc/loadavg)"
cbatch() {  # $1: label; the rest: environment
  local label=$1; shift
  env "$@" .venv/bin/python benchmarks/bench_throughput.py --engines cbatch-continuous \
    --dtype "$dtype" "${args[@]}" ${sample[@]+"${sample[@]}"} --no-progress 2>&1 |
    grep -A1 "cbatch-continuous " | sed "s/^/$label /"
}
openvino() {  # $1: label; the rest: extra arguments
  local label=$1; shift
  "$peers/ov/bin/python" benchmarks/peers/bench_openvino_genai.py --model "$peers/gpt2-random-ov" \
    --workloads "$peers/workloads.json" --workload "$workload" --precision "$precision" \
    --reps 2 ${sample[@]+"${sample[@]}"} "$@" 2>&1 | grep -E "^rep|RESULT" | sed "s/^/$label /"
}
vllm() {
  VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 "$peers/vllm/bin/python" \
    benchmarks/peers/bench_vllm_cpu.py --model "$peers/gpt2-random" \
    --workloads "$peers/workloads.json" --workload "$workload" --dtype "$dtype" --reps 2 \
    ${sample[@]+"${sample[@]}"} 2>&1 | grep -E "^rep|RESULT" | sed "s/^/vllm /"
}
cbatch cbatch CBATCH_GREEDY_SCREEN=1
[ "$dtype" = float32 ] && [ -z "${SAMPLE:-}" ] && cbatch cbatch-no-screen CBATCH_GREEDY_SCREEN=0
for name in "${names[@]}"; do
  case "$name" in
    openvino) openvino openvino
              [ "$workload" = seed ] && openvino openvino-prefix --prefix-caching ;;
    vllm) vllm ;;
    *) echo "unknown peer $name (openvino, vllm)" >&2; exit 2 ;;
  esac
done
exit 0
