#!/usr/bin/env bash
# One alternated round of cbatch and llama.cpp's llama-server on the SAME .gguf file,
# $PEERS/gguf-models/<shape>-<TYPE>.gguf (PEERS default /work/peers; set up as
# benchmarks/peers/README.md says, "GGUF files: the same .gguf in cbatch and llama-server"):
#
#   bash benchmarks/peers/alternate_gguf.sh seed|longtail <shape> <TYPE> [llamacpp] [openvino]
#   bash benchmarks/peers/alternate_gguf.sh seed smollm2-360m Q4_0
#   SAMPLE="--temperature 0.8 --top-p 0.95" bash benchmarks/peers/alternate_gguf.sh longtail \
#       llama-3.2-1b Q4_K_M
#
# TYPE: f16, Q4_K_M, Q4_0, Q8_0 (Q5_K_M, Q6_K for smollm2-360m-outliers).  cbatch runs
# bench_throughput.py --model <file> --dtype float32 --engines cbatch-continuous (QUANT
# adds --quantization QUANT, SAMPLE the sampling flags, as alternate_quant.sh); then
# llama-server (bench_llama_cpp.py, REPS reps, default 2; KV_UNIFIED=1 shares one KV cache among
# its slots, as the runs before 2026-12-07 did) on the same file.  bench_throughput.py
# takes no workload file: it builds `seed` from the model's tokenizer (for a .gguf, the
# file's vocabulary, not random:'s byte ids that workloads-<shape>.json holds) and `longtail`
# from the vocabulary size (the same ids as workloads-<shape>.json).  So llama-server gets
# the ids cbatch runs: workloads-<shape>-gguf.json, written here from the file's tokenizer.
# openvino: not run: OpenVINO GenAI 2026.4.1's GGUF reader (a preview, LLMPipeline(<file>, "CPU"))
# refused every file made here, f16, Q8_0 and Q4_0 of SmolLM2-360M's and Llama-3.2-1B's shapes,
# with "IndexError: map::at" (2026-12-06); named for alternate_quant.sh's syntax.
set -euo pipefail
cd "$(dirname "$0")/../.."
usage="usage: alternate_gguf.sh seed|longtail <shape> <TYPE> [llamacpp] [openvino]"
workload=${1:?$usage}
shape=${2:?$usage}
type=${3:?$usage}
peers=${PEERS:-/work/peers}
file=$peers/gguf-models/$shape-$type.gguf
workloads=$peers/workloads-$shape-gguf.json
shift 3
names=("${@:-llamacpp}")
read -r -a names <<< "${names[*]}"
read -r -a sample <<< "${SAMPLE:-}"
[ -f "$file" ] || { echo "no $file" >&2; exit 2; }
args=(--workload "$workload")
[ "$workload" = longtail ] && args+=(--scale 0.125 --max-len 256)
[ -n "${SCALE:-}" ] && args+=(--scale "$SCALE")  # smoke runs only
quant=(${QUANT:+--quantization "$QUANT"})
if [ ! -f "$workloads" ]; then  # the ids bench_throughput.py builds for this file
  .venv/bin/python - "$file" "$workloads" <<'PY'
import json, sys
from cbatch import workloads
from cbatch.tokenizer import load_tokenizer
file, out = sys.argv[1:]
import gguf
r = gguf.GGUFReader(file)
vocab = len(r.fields["tokenizer.ggml.tokens"].data)
tok = load_tokenizer(file, None, eos_token_id=vocab - 1)
res = {}
for wl in (workloads.seed(tok), workloads.longtail(vocab, 0.125, 256)):
    res[wl.name] = {"prompts": [tok.encode(p) if isinstance(p, str) else p for p in wl.prompts],
                    "max_tokens": [p.max_tokens for p in wl.params], "batch_size": wl.batch_size}
json.dump(res, open(out, "w"))
print(f"wrote {out}: seed {len(res['seed']['prompts'][0])} ids a prompt, vocabulary {vocab}")
PY
fi
echo "== $(date -u +%H:%M:%S) $shape-$type $workload ${SAMPLE:-greedy}, load $(cut -d' ' -f1 /proc/loadavg)"
.venv/bin/python benchmarks/bench_throughput.py --engines cbatch-continuous --model "$file" \
  --dtype float32 ${quant[@]+"${quant[@]}"} "${args[@]}" ${sample[@]+"${sample[@]}"} --no-progress 2>&1 |
  grep -A1 "cbatch-continuous " | sed "s/^/cbatch-$type${QUANT:+-$QUANT} /"
for name in "${names[@]}"; do
  case "$name" in
    llamacpp)
      scale_down=()
      [ -n "${SCALE:-}" ] && scale_down=(--scale-down "${SCALE_DOWN:-8}")
      python3 benchmarks/peers/bench_llama_cpp.py --server "$peers/llama.cpp/build/bin/llama-server" \
        --model "$file" --workloads "$workloads" --workload "$workload" --reps "${REPS:-2}" \
        ${KV_UNIFIED:+--kv-unified} ${scale_down[@]+"${scale_down[@]}"} ${sample[@]+"${sample[@]}"} 2>&1 |
        grep -E "^rep|RESULT|mismatch|exited" | sed "s/^/llama.cpp-$type /" ;;
    openvino) echo "openvino: OpenVINO GenAI 2026.4.1 refuses these files (map::at); skipped" ;;
    *) echo "unknown peer $name (llamacpp, openvino)" >&2; exit 2 ;;
  esac
done
exit 0
