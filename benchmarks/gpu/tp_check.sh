#!/usr/bin/env bash
# The device script for tensor parallelism, on nvidia-h200-x2 (every output under $OUT/r).
# Stage 1: Llama-3.1-8B shapes, greedy tokens of 1 and 2 ranks on the same prompts, then
# batch-1 decode at a 1000-token context with 1 and 2 ranks, floor printed beside each.
# Stage 2: the nano workload at 2 ranks, in-process and through the Redis pipeline.
#   source .devkit/env.sh && bash benchmarks/gpu/tp_check.sh 1
set -uo pipefail
source benchmarks/gpu/common.sh
case "$1" in
1)
  timeout 240 python benchmarks/gpu/tp_tokens.py --model $M/llama-3.1-8b-shape \
    --tensor-parallel-size 2 --json "$R/tp-tokens-llama8b.json" > "$R/tp-tokens.txt" 2>&1
  for tp in 1 2; do
    bench 150 latency --model $M/llama-3.1-8b-shape --load-format dummy --context-len 1000 \
      --batch-size 1 --output-len 128 --iterations 3 --tensor-parallel-size $tp \
      --json "$R/latency-llama8b-b1-tp$tp.json" > "$R/latency-llama8b-b1-tp$tp.txt" 2>&1
  done
  ;;
2)
  bench 300 throughput --model $M/qwen3-0.6b-shape --load-format dummy --workload nano \
    --path both --detokenizer-replicas 2 --tensor-parallel-size 2 \
    --json "$R/throughput-nano-tp2.json" > "$R/throughput-nano-tp2.txt" 2>&1
  ;;
esac
grep -hv '"event"' "$R"/*.txt | tail -n 30
