#!/usr/bin/env bash
# The device script for issue 16 (LoRA, fp8 KV cache, speculative decoding), every output under
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
3)  # the LoRA GPU tests; batch-32 decode of Llama-3.1-8B shapes: the base model, LoRA on
    # but unused, and four random rank-16 adapters over every projection taking the
    # requests in turn
  timeout 200 python -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py \
    tests/test_gpu.py -k "lora" > "$R/pytest-gpu-lora.txt" 2>&1
  for lora in base enabled adapters4; do
    args=()
    [ $lora != base ] && args=(--enable-lora --max-loras 4 --max-lora-rank 16)
    [ $lora = adapters4 ] && args+=(--lora-adapters 4)
    bench 150 latency --model $M/llama-3.1-8b-shape --load-format dummy --context-len 1000 \
      --batch-size 32 --output-len 128 --iterations 3 "${args[@]}" \
      --json "$R/latency-llama8b-b32-lora-$lora.json" > "$R/latency-llama8b-b32-lora-$lora.txt" 2>&1
  done
  ;;
4)  # batch-1 decode without and with ngram speculation on the copy model (a checkpoint at
    # Llama-3.1-8B's shapes whose greedy output is the repeating prompt's cycle)
  PYTHONPATH=$PWD timeout 150 python benchmarks/gpu/copy_model.py --config-dir $M/llama-3.1-8b-shape \
    --out /tmp/copy-8b --context-len 1000 --prompt-period 16 > "$R/copy-model.txt" 2>&1
  for spec in none ngram; do
    args=()
    [ $spec = ngram ] && args=(--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}')
    bench 150 latency --model /tmp/copy-8b --context-len 1000 --batch-size 1 --output-len 128 \
      --iterations 3 --prompt-period 16 "${args[@]}" \
      --json "$R/latency-copy8b-b1-$spec.json" > "$R/latency-copy8b-b1-$spec.txt" 2>&1
  done
  ;;
5)  # batch-1 decode of Llama-3.1-8B shapes drafted by a 16-layer 2048-wide llama with the
    # same vocabulary (Llama-3.2-1B's shapes, untied): both copy models (every draft is
    # right), then both dummy (no draft is), each against no speculation; first the draft
    # model's GPU test (its graphs against eager and plain decoding)
  timeout 200 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -k draft \
    > "$R/pytest-gpu-draft.txt" 2>&1
  python - $M/llama-3.1-8b-shape /tmp/llama-1b-shape <<'PY'
import json, shutil, sys
from pathlib import Path
source, target = Path(sys.argv[1]), Path(sys.argv[2])
shutil.copytree(source, target, dirs_exist_ok=True)
config = json.loads((source / "config.json").read_text())
config.update(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
              num_key_value_heads=8, head_dim=64, intermediate_size=8192)
(target / "config.json").write_text(json.dumps(config, indent=2))
PY
  for size in 8b 1b; do
    config=$M/llama-3.1-8b-shape
    [ $size = 1b ] && config=/tmp/llama-1b-shape
    PYTHONPATH=$PWD timeout 150 python benchmarks/gpu/copy_model.py --config-dir $config \
      --out /tmp/copy-$size --context-len 1000 --prompt-period 16 >> "$R/draft-copy-models.txt" 2>&1
  done
  draft='{"method": "draft_model", "num_speculative_tokens": 4, "model": "'
  for spec in none draft; do
    args=()
    [ $spec = draft ] && args=(--speculative-config "$draft/tmp/copy-1b\"}")
    bench 150 latency --model /tmp/copy-8b --context-len 1000 --batch-size 1 --output-len 128 \
      --iterations 3 --prompt-period 16 "${args[@]}" \
      --json "$R/draft-copy8b-b1-$spec.json" >> "$R/stage5.txt" 2>&1
  done
  for spec in none draft; do
    args=()
    [ $spec = draft ] && args=(--speculative-config "$draft/tmp/llama-1b-shape\"}")
    bench 150 latency --model $M/llama-3.1-8b-shape --load-format dummy --context-len 1000 \
      --batch-size 1 --output-len 128 --iterations 3 --prompt-period 16 "${args[@]}" \
      --json "$R/draft-dummy8b-b1-$spec.json" >> "$R/stage5.txt" 2>&1
  done
  ;;
6)  # a KV-bound decode: Llama-3.1-8B shapes, 32 requests of 8000-token contexts (33 GB of
    # bf16 KV read a step beside 16 GB of weights), bf16 against fp8 KV; first the fp8 GPU
    # tests and the decode attention sweep over both caches
  timeout 200 python -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_kernels_triton.py \
    -k "fp8 and not interpreter" > "$R/pytest-gpu-fp8-tiles.txt" 2>&1
  PYTHONPATH=$PWD timeout 120 python benchmarks/gpu/fp8_attention_sweep.py > "$R/fp8-attention-sweep.txt" 2>&1
  for dtype in auto fp8; do
    bench 250 latency --model $M/llama-3.1-8b-shape --load-format dummy --context-len 8000 \
      --batch-size 32 --output-len 64 --iterations 2 --kv-cache-dtype $dtype \
      --json "$R/kvbound-llama8b-b32-ctx8000-$dtype.json" >> "$R/stage6.txt" 2>&1
  done
  ;;
esac
grep -hv '"event"' "$R"/*.txt | tail -n 40
