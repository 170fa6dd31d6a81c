#!/usr/bin/env bash
# The device script for tensor parallelism, on nvidia-h200-x2 (every output under $OUT/r).
# Stage 1: the two-GPU tests of the peer-memory all-reduces (bare and fused with the norm;
# the stage stops if they fail), then Llama-3.1-8B shapes' batch-1 decode at a 1000-token
# context: two ranks (peer-memory all-reduces, then NCCL for every message) and one rank,
# floor printed beside each.
# Stage 2: greedy tokens of 1 and 2 ranks on the same prompts (float32, where the ranks'
# summation orders cannot swap near-tied tokens as bf16's can), then the nano workload at
# 2 ranks, in-process and through the Redis pipeline.
#   source .devkit/env.sh && bash benchmarks/gpu/tp_check.sh 1
set -uo pipefail
source benchmarks/gpu/common.sh
latency() {  # latency NAME ARGS...: Llama-3.1-8B shapes, batch 1, 1000-token context
  bench 150 latency --model $M/llama-3.1-8b-shape --load-format dummy --context-len 1000 \
    --batch-size 1 --output-len 128 --iterations 3 "${@:2}" \
    --json "$R/latency-llama8b-b1-$1.json" > "$R/latency-llama8b-b1-$1.txt" 2>&1
}
case "$1" in
1)
  timeout 90 python -m pytest -q -p no:cacheprovider tests/test_tensor_parallel.py \
    -k "peer or fused" > "$R/pytest-peer.txt" 2>&1 || { tail -n 40 "$R/pytest-peer.txt"; exit 1; }
  latency tp2 --tensor-parallel-size 2
  latency tp2-nccl --tensor-parallel-size 2 --disable-custom-all-reduce
  latency tp1 --tensor-parallel-size 1
  ;;
2)
  timeout 240 python benchmarks/gpu/tp_tokens.py --model $M/llama-3.1-8b-shape \
    --tensor-parallel-size 2 --dtype float32 --json "$R/tp-tokens-llama8b-fp32.json" \
    > "$R/tp-tokens-fp32.txt" 2>&1
  bench 300 throughput --model $M/qwen3-0.6b-shape --load-format dummy --workload nano \
    --path both --detokenizer-replicas 2 --tensor-parallel-size 2 \
    --json "$R/throughput-nano-tp2.json" > "$R/throughput-nano-tp2.txt" 2>&1
  ;;
esac
grep -hv '"event"' "$R"/*.txt | tail -n 40
