#!/usr/bin/env bash
# The device script for issue 16 (LoRA, fp8 KV cache, ngram speculation), every output under
# $OUT/r, one device call per stage (each inside the 10-minute limit):
#   source .devkit/env.sh && bash benchmarks/gpu/issue16_check.sh 1
set -uo pipefail
source benchmarks/gpu/common.sh
case "$1" in
1)  # the GPU tests, then the nano workload with a bf16 and an fp8 KV cache
  timeout 300 python -m pytest -q -p no:cacheprovider tests/test_gpu.py \
    "tests/test_kernels_triton.py" -k "not attention_cuda" > "$R/pytest-gpu.txt" 2>&1
  for dtype in auto fp8; do
    bench 120 throughput --model $M/qwen3-0.6b-shape --load-format dummy --workload nano \
      --path inprocess --kv-cache-dtype $dtype --json "$R/throughput-nano-kv-$dtype.json" \
      > "$R/throughput-nano-kv-$dtype.txt" 2>&1
  done
  ;;
2)  # batch-1 decode of Llama-3.1-8B shapes on a prompt that repeats itself, without and
    # with ngram speculation
  for spec in none ngram; do
    args=()
    [ $spec = ngram ] && args=(--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}')
    bench 200 latency --model $M/llama-3.1-8b-shape --load-format dummy --context-len 1000 \
      --batch-size 1 --output-len 128 --iterations 3 --prompt-period 16 "${args[@]}" \
      --json "$R/latency-llama8b-b1-$spec.json" > "$R/latency-llama8b-b1-$spec.txt" 2>&1
  done
  for dtype in fp8 auto; do  # stage 1's pair again, the other way round: the host's noise
    bench 120 throughput --model $M/qwen3-0.6b-shape --load-format dummy --workload nano \
      --path inprocess --kv-cache-dtype $dtype --json "$R/throughput-nano-kv-$dtype-2.json" \
      > "$R/throughput-nano-kv-$dtype-2.txt" 2>&1
  done
  timeout 200 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -k fp8 \
    > "$R/pytest-gpu-fp8.txt" 2>&1
  ;;
esac
grep -hv '"event"' "$R"/*.txt | tail -n 40
