#!/usr/bin/env bash
# The device script for the engine: GPU tests, then the issue-5 benchmarks, each output
# under $OUT. Stage 1 checks and times latency, stage 2 times throughput (one device call
# each, inside the 10-minute limit):
#   source .devkit/env.sh && bash benchmarks/gpu/engine_check.sh 1
set -uo pipefail
M=.devkit/models
export HEADRACE_SHAPES=$M
bench() { timeout "$1" python -m services.cli bench "${@:2}"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt"
case "$1" in
1)
  timeout 240 python -m pytest -q -p no:cacheprovider tests/test_gpu.py \
    "tests/test_kernels_triton.py::test_attention_dispatch_takes_triton_on_cuda" \
    2>&1 | tail -n 40 > "$OUT/pytest-gpu.txt"
  bench 150 latency --model $M/llama-3.1-8b-shape --load-format dummy --context-len 1000 \
    --batch-size 1 --output-len 128 --iterations 3 --json "$OUT/latency-llama8b-b1.json" \
    > "$OUT/latency-llama8b-b1.txt" 2>&1
  bench 150 throughput --model $M/qwen3-0.6b-shape --load-format dummy --workload nano \
    --path inprocess --json "$OUT/throughput-nano-inprocess.json" \
    > "$OUT/throughput-nano-inprocess.txt" 2>&1
  ;;
2)
  bench 300 throughput --model $M/qwen3-0.6b-shape --load-format dummy --workload nano \
    --path both --json "$OUT/throughput-nano-both.json" > "$OUT/throughput-nano-both.txt" 2>&1
  bench 240 throughput --model $M/qwen3-0.6b-shape --load-format dummy --workload nano \
    --path inprocess --compare transformers --json "$OUT/compare-transformers.json" \
    > "$OUT/compare-transformers.txt" 2>&1
  ;;
esac
tail -n 25 "$OUT"/*.txt
