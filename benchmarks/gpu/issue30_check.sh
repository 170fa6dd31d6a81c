#!/usr/bin/env bash
# The device script for issue 30 (quantized weights), every output under $OUT/r, one device
# call per stage (each inside the 10-minute limit):
#   source .devkit/env.sh && bash benchmarks/gpu/issue30_check.sh 1
# Stage 1 runs the CUDA checks of every quantized kernel; 2 times batch-1 decode of
# Llama-3.1-8B's shapes in bf16, fp8 (quantized on load) and AWQ int4 (dummy weights under
# an AWQ quantization_config) against each format's floor; 3 the batch-64 8B workload and
# the nano workload (Qwen3-0.6B shapes), bf16 against fp8.
set -uo pipefail
source benchmarks/gpu/common.sh
L=$M/llama-3.1-8b-shape
awq_shape() {  # the 8B shape's directory with an AWQ 4-bit, group-128 quantization_config
  local dir=/tmp/llama-3.1-8b-awq-shape
  rm -rf "$dir" && cp -r "$L" "$dir"
  python - "$dir/config.json" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128,
                                 "zero_point": True, "version": "gemm"}
json.dump(config, open(sys.argv[1], "w"))
PY
  echo "$dir"
}
sym_shape() {  # the 8B shape's directory with a compressed-tensors W4A16 config, symmetric,
             # group 128 (GPTQ's sym=True in another format; no zeros are stored)
  local dir=/tmp/llama-3.1-8b-w4a16-sym-shape
  rm -rf "$dir" && cp -r "$L" "$dir"
  python - "$dir/config.json" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config["quantization_config"] = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "quantization_status": "compressed", "ignore": ["lm_head"],
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "dynamic": False,
                                              "symmetric": True, "strategy": "group",
                                              "group_size": 128}}}}
json.dump(config, open(sys.argv[1], "w"))
PY
  echo "$dir"
}
latency_ab() {  # 8B batch-1 decode in each of FORMATS (awq, sym: int4 without zeros, fp8,
                # none) with this tree and .base, alternating
  local AWQ SYM fmt model quant tree
  AWQ=$(awq_shape) SYM=$(sym_shape)
  for fmt in ${FORMATS:-awq fp8 none}; do
    model=$L quant=(); [ "$fmt" = awq ] && model=$AWQ
    [ "$fmt" != none ] && quant=(--quantization "$fmt")
    [ "$fmt" = sym ] && model=$SYM quant=(--quantization compressed-tensors)
    for tree in new base; do
      bench_in $tree 150 latency --model "$(realpath "$model")" --load-format dummy --context-len 1000 \
        --batch-size 1 --output-len 64 --iterations 3 --max-model-len 2048 "${quant[@]}" \
        --json "$R/latency-8b-$fmt-b1-$tree.json" >> "$R/latency-ab.txt" 2>&1
    done
  done
}
case "$1" in
1)
  timeout 200 python -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py \
    -k "quant and cuda" > "$R/pytest-quant-kernels.txt" 2>&1
  timeout 150 python -m pytest -q -p no:cacheprovider tests/test_quant_int4.py tests/test_gguf_quant.py \
    -k cuda > "$R/pytest-int4-gguf.txt" 2>&1
  timeout 150 python -m pytest -q -p no:cacheprovider tests/test_moe.py -k "fp8 and cuda" \
    > "$R/pytest-moe-fp8.txt" 2>&1
  ;;
2)
  AWQ=$(awq_shape)
  for spec in "$L none" "$L fp8" "$AWQ awq"; do
    set -- $spec
    quant=(); [ "$2" != none ] && quant=(--quantization "$2")
    bench 150 latency --model "$1" --load-format dummy --context-len 1000 --batch-size 1 \
      --output-len 64 --iterations 2 --max-model-len 2048 "${quant[@]}" \
      --json "$R/latency-8b-$2-b1.json" >> "$R/latency.txt" 2>&1
  done
  ;;
sweeps)  # the one-row tiles of the int4 and fp8 GEMVs, on this card
  timeout "${SWEEP_S:-200}" python benchmarks/gpu/int4_gemv_sweep.py 1 > "$R/int4-sweep.txt" 2>&1
  timeout 150 python benchmarks/gpu/fp8_packed_experiment.py > "$R/fp8-packed-experiment.txt" 2>&1
  ;;
gemv)  # the fp8 weight-only GEMV against its twin, the layer's choice of it, 8B batch-1
       # decode in bf16 and fp8, then the GEMV's tiles against cuBLAS at the 8B projections
  timeout 120 python -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py \
    tests/test_quantization.py -k "fp8_gemv and cuda or gemv_cuda" > "$R/pytest-fp8-gemv.txt" 2>&1
  for quant in none fp8; do
    args=(); [ "$quant" != none ] && args=(--quantization "$quant")
    bench 120 latency --model "$L" --load-format dummy --context-len 1000 --batch-size 1 \
      --output-len 64 --iterations 2 --max-model-len 2048 "${args[@]}" \
      --json "$R/latency-8b-$quant-b1.json" >> "$R/latency.txt" 2>&1
  done
  timeout "${SWEEP_S:-200}" python benchmarks/gpu/fp8_gemv_sweep.py > "$R/fp8-gemv-sweep.txt" 2>&1
  ;;
int4)  # the W4A16 kernels' CUDA tests, their tile sweep, and batch-1 decode of the 8B
       # shapes in AWQ int4, fp8 and bf16 (TAG names the run's files)
  timeout 150 python -m pytest -q -p no:cacheprovider tests/test_quant_int4.py -k cuda \
    > "$R/pytest-int4-cuda${TAG:-}.txt" 2>&1
  timeout "${SWEEP_S:-200}" python benchmarks/gpu/int4_gemv_sweep.py ${SWEEP_ROWS:-1 8 2048} \
    > "$R/int4-gemv-sweep${TAG:-}.txt" 2>&1
  AWQ=$(awq_shape)
  for fmt in ${FORMATS:-awq fp8 none}; do
    model=$L quant=(); [ "$fmt" = awq ] && model=$AWQ
    [ "$fmt" != none ] && quant=(--quantization "$fmt")
    bench 150 latency --model "$model" --load-format dummy --context-len 1000 \
      --batch-size 1 --output-len 64 --iterations 3 --max-model-len 2048 "${quant[@]}" \
      --json "$R/latency-8b-$fmt-b1${TAG:-}.json" >> "$R/latency${TAG:-}.txt" 2>&1
  done
  ;;
fp8)  # the fp8 GEMV's CUDA tests at its tuned tiles, 8B batch-1 decode in fp8, and the
      # batch-64 workload in bf16, fp8 and fp8 with an fp8 KV cache (TAG names the files)
  timeout 120 python -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py \
    -k "fp8_gemv and cuda" > "$R/pytest-fp8-gemv${TAG:-}.txt" 2>&1
  bench 120 latency --model "$L" --load-format dummy --context-len 1000 --batch-size 1 \
    --output-len 64 --iterations 3 --max-model-len 2048 --quantization fp8 \
    --json "$R/latency-8b-fp8-b1${TAG:-}.json" >> "$R/latency${TAG:-}.txt" 2>&1
  for spec in "none auto" "fp8 auto" "fp8 fp8"; do
    set -- $spec
    quant=(); [ "$1" != none ] && quant=(--quantization "$1")
    bench 150 latency --model "$L" --load-format dummy --context-len 1000 --batch-size 64 \
      --output-len 64 --iterations 2 --max-model-len 2048 "${quant[@]}" \
      --kv-cache-dtype "$2" --json "$R/latency-8b-$1-kv$2-b64${TAG:-}.json" \
      >> "$R/latency-b64${TAG:-}.txt" 2>&1
  done
  ;;
3)
  for quant in none fp8; do
    args=(); [ "$quant" != none ] && args=(--quantization "$quant")
    bench 200 latency --model "$L" --load-format dummy --context-len 1000 --batch-size 64 \
      --output-len 64 --iterations 2 --max-model-len 2048 "${args[@]}" \
      --json "$R/latency-8b-$quant-b64.json" >> "$R/latency-b64.txt" 2>&1
    bench 200 throughput --model $M/qwen3-0.6b-shape --load-format dummy --workload nano \
      --path inprocess "${args[@]}" --json "$R/throughput-nano-$quant.json" \
      >> "$R/throughput-nano.txt" 2>&1
  done
  ;;
profile)  # eager per-kernel device times of one decode step: fp8 weights with an fp8 KV cache
          # and bf16 at batch 64 (prompt 1000), AWQ int4 and fp8 at batch 1
  # PROFILE_SPECS: "format kv-dtype batch" triples, space-separated, comma between
  AWQ=$(awq_shape)
  IFS=, read -ra specs <<< "${PROFILE_SPECS:-fp8 fp8 64,none auto 64,awq auto 1,fp8 auto 1}"
  for spec in "${specs[@]}"; do
    set -- $spec
    model=$L; [ "$1" = awq ] && model=$AWQ
    set -- "$model" "$@"
    quant=(); [ "$2" != none ] && quant=(--quantization "$2")
    name=profile-8b-$2-kv$3-b$4
    timeout 150 python -m services.cli profile --model "$1" --load-format dummy \
      --batch-size "$4" --prompt-len 1000 --max-model-len 2048 "${quant[@]}" \
      --kv-cache-dtype "$3" --json "$R/$name.json" run_num_steps -n 2 > "$R/$name.log" 2>&1
    python -m services.cli profile-table --json-trace "$R/$name.json" --phase decode_1 \
      > "$R/$name-decode.txt" 2>&1
  done
  ;;
ab)  # this tree against the one in .base (a copy of the commit before, carried): the CUDA
    # tests of the GEMVs, the int4 sweep at one row, then 8B batch-1 decode in each format
    # with both trees, alternating, in one lease
  timeout 200 python -m pytest -q -p no:cacheprovider tests/test_quant_int4.py \
    tests/test_kernels_triton.py -k "cuda and (w4a16 or gemv)" > "$R/pytest-ab.txt" 2>&1
  timeout "${SWEEP_S:-240}" python benchmarks/gpu/int4_gemv_sweep.py 1 > "$R/int4-sweep-ab.txt" 2>&1
  latency_ab
  ;;
latency-ab)  # ab's batch-1 decode alone
  latency_ab
  ;;
ab-fp8)  # the packed one-row fp8 GEMV: its CUDA tests and experiment, then 8B batch-1 decode
        # in fp8 with this tree and .base, alternating, in one lease
  timeout 200 python -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py \
    -k "cuda and fp8_gemv" > "$R/pytest-fp8-ab.txt" 2>&1
  timeout 150 python benchmarks/gpu/fp8_packed_experiment.py > "$R/fp8-packed-experiment.txt" 2>&1
  for tree in new base new base; do
    bench_in $tree 150 latency --model "$(realpath $L)" --load-format dummy --context-len 1000 \
      --batch-size 1 --output-len 64 --iterations 3 --max-model-len 2048 --quantization fp8 \
      --json "$R/latency-8b-fp8-b1-$tree.json" >> "$R/latency-fp8-ab.txt" 2>&1
  done
  ;;
b64)  # the fp8 cache's attention: its CUDA tests, the layout/tile experiment, then 8B
     # batch-64 decode (context 1000) with fp8 weights and cache in this tree and in .base,
     # and bf16 in this tree, in one lease
  timeout 150 python -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py \
    -k "fp8_cache_kernels_cuda" > "$R/pytest-fp8-attention.txt" 2>&1
  timeout 120 python benchmarks/gpu/kv_layout_experiment.py > "$R/kv-layout.txt" 2>&1
  for spec in "new fp8 fp8" "base fp8 fp8" "new none auto"; do
    set -- $spec
    quant=(); [ $2 != none ] && quant=(--quantization $2)
    bench_in $1 150 latency --model "$(realpath $L)" --load-format dummy --context-len 1000 \
      --batch-size 64 --output-len 64 --iterations 2 --max-model-len 2048 "${quant[@]}" \
      --kv-cache-dtype $3 --json "$R/latency-8b-$2-kv$3-b64-$1.json" >> "$R/latency-b64.txt" 2>&1
  done
  ;;
confirm)  # this tree alone, on another lease: 8B batch 64 (fp8 weights and cache, bf16)
          # and batch 1 (AWQ int4, symmetric int4, fp8), context 1000
  AWQ=$(awq_shape) SYM=$(sym_shape)
  for spec in "$L fp8 fp8 64" "$L none auto 64" "$AWQ awq auto 1" "$SYM sym auto 1" \
              "$L fp8 auto 1"; do
    set -- $spec
    quant=(); [ "$2" != none ] && quant=(--quantization "$2")
    [ "$2" = sym ] && quant=(--quantization compressed-tensors)
    bench 150 latency --model "$1" --load-format dummy --context-len 1000 --batch-size "$4" \
      --output-len 64 --iterations 3 --max-model-len 2048 "${quant[@]}" --kv-cache-dtype "$3" \
      --json "$R/latency-8b-$2-kv$3-b$4.json" >> "$R/latency.txt" 2>&1
  done
  ;;
esac
lscpu | grep -E "Model name|^CPU\(s\)" > "$R/host.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv >> "$R/host.txt"
