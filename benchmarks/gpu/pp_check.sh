#!/usr/bin/env bash
# The device script for pipeline parallelism, on nvidia-h200-x2 (every output under $R):
# Llama-3.1-8B shapes, the nano lengths over 1,024 requests in-process, at two stages and
# on one GPU (issue 32's goal: two stages at 1.7x one GPU or more).
#   source .devkit/env.sh && bash benchmarks/gpu/pp_check.sh
set -uo pipefail
source benchmarks/gpu/common.sh
for size in 2 1; do
  bench "${PP_S:-200}" throughput --model $M/llama-3.1-8b-shape --load-format dummy \
    --workload nano --num-prompts 1024 --path inprocess --pipeline-parallel-size $size \
    --json "$R/throughput-nano1024-pp$size.json" > "$R/throughput-nano1024-pp$size.txt" 2>&1
done
lscpu | grep -E "Model name|^CPU\(s\)" > "$R/host.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv >> "$R/host.txt"
