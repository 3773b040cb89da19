#!/bin/bash
cd /work/main
echo "start $(date -u +%H:%M:%S) commit $(git rev-parse --short HEAD) load $(cut -d' ' -f1 /proc/loadavg)"
for round in 1 2; do
  for t in Q4_0 Q4_K_M Q8_0; do
    REPS=1 bash benchmarks/peers/alternate_gguf.sh longtail smollm2-360m $t llamacpp
  done
done
REPS=1 bash benchmarks/peers/alternate_gguf.sh longtail llama-3.2-1b Q4_K_M llamacpp
echo "end $(date -u +%H:%M:%S)"
