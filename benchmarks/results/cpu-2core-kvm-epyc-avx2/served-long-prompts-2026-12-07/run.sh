#!/usr/bin/env bash
# issue 72 item 4: cbatch serve (w4a8 on the float checkpoint) then llama-server (Q4_0), per case, 2 rounds
cd /work/main
P=/work/peers
for round in ${ROUNDS:-1}; do
  for c in "64 128 128" "32 1024 128" "8 4096 64"; do
    set -- $c
    out=$P/served/r$round-$1x$2x$3
    echo "$(date -u +%H:%M:%S) round $round case $1 x $2 / $3 load $(cut -d' ' -f1-3 /proc/loadavg)"
    .venv/bin/python benchmarks/bench_serving_burst.py --model $P/smollm2-360m \
      --cbatch-args "--quantization w4a8 --num-blocks 2400" --no-offline \
      --llama-server $P/llama.cpp/build/bin/llama-server --llama-model $P/gguf-models/smollm2-360m-Q4_0.gguf \
      --num-prompts $1 --input-len $2 --output-len $3 --out $out --log-dir $out --device cpu 2>&1 | grep -E "^server=|Error|error" 
  done
done
echo "$(date -u +%H:%M:%S) done"
