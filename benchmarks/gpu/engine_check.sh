#!/usr/bin/env bash
# The device script for the engine: the GPU tests, then issue 5's benchmarks, every output
# under $OUT/r. Stage 1 tests and times latency, stage 2 times throughput (one device
# call each, inside the 10-minute limit):
#   source .devkit/env.sh && bash benchmarks/gpu/engine_check.sh 1
set -uo pipefail
source benchmarks/gpu/common.sh
case "$1" in
1)
  timeout 330 python -m pytest -q -p no:cacheprovider tests/test_gpu.py \
    tests/test_kernels_triton.py -k "cuda or gpu or fused" > "$R/pytest-gpu.txt" 2>&1
  bench 150 latency --model $M/llama-3.1-8b-shape --load-format dummy --context-len 1000 \
    --batch-size 1 --output-len 128 --iterations 3 --json "$R/latency-llama8b-b1.json" \
    > "$R/latency-llama8b-b1.txt" 2>&1
  ;;
2)
  bench 280 throughput --model $M/qwen3-0.6b-shape --load-format dummy --workload nano \
    --path both --detokenizer-replicas 2 --json "$R/throughput-nano.json" \
    > "$R/throughput-nano.txt" 2>&1
  bench 300 throughput --model $M/qwen3-0.6b-shape --load-format dummy --workload nano \
    --path inprocess --compare transformers --json "$R/compare-transformers.json" \
    > "$R/compare-transformers.txt" 2>&1
  ;;
esac
grep -hv '"event"' "$R"/*.txt | tail -n 30
