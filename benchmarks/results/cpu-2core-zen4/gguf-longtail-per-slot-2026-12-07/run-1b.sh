#!/bin/bash
cd /work/main
echo "start $(date -u +%H:%M:%S) commit $(git rev-parse --short HEAD) load $(cut -d' ' -f1 /proc/loadavg)"
for t in Q4_0 Q8_0; do
  REPS=1 bash benchmarks/peers/alternate_gguf.sh longtail llama-3.2-1b $t llamacpp
done
echo "end $(date -u +%H:%M:%S)"
