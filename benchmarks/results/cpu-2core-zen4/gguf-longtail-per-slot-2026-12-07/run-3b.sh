#!/bin/bash
cd /work/main
echo "start $(date -u +%H:%M:%S) commit $(git rev-parse --short HEAD) load $(cut -d' ' -f1 /proc/loadavg)"
REPS=1 bash benchmarks/peers/alternate_gguf.sh longtail llama-3.2-3b Q4_K_M llamacpp
echo "end $(date -u +%H:%M:%S)"
