cd /work/main
L=/work/peers/llama.cpp/build/bin/llama-server; M=/work/peers/gguf-models/smollm2-360m-Q4_0.gguf; W=/work/peers/workloads-smollm2-360m-gguf.json
echo "== cbatch longtail $(date -u +%H:%M:%S)"
.venv/bin/python benchmarks/bench_throughput.py --engines cbatch-continuous --model $M --dtype float32 --workload longtail --scale 0.125 --max-len 256 --no-progress 2>&1 | grep -A1 "cbatch-continuous "
for k in "" "--kv-unified"; do echo "== llama longtail $k $(date -u +%H:%M:%S)"; python3 benchmarks/peers/bench_llama_cpp.py --server $L --model $M --workloads $W --workload longtail --reps 1 $k 2>&1 | grep -E "^rep|RESULT|mismatch|exited"; done
echo "done $(date -u +%H:%M:%S)"
