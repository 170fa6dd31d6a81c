#!/usr/bin/env bash
# The device script for issue 29 (MoE, Gemma, Phi-3, sliding windows, RoPE scaling), every
# output under $OUT/r, one device call per stage or two (each inside the 10-minute limit):
#   source .devkit/env.sh && bash benchmarks/gpu/issue29_check.sh 1
set -uo pipefail
source benchmarks/gpu/common.sh
T=$M/qwen3-0.6b-shape  # the stand-in tokenizer for shapes without one
case "$1" in
1)  # the GPU tests of the new kernels and models
  timeout 170 python -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py \
    -k "cuda and not interpreter" > "$R/pytest-kernels.txt" 2>&1
  timeout 150 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -k tiny_models \
    > "$R/pytest-models.txt" 2>&1
  ;;
fused)  # the fused attention-input, Gemma norm and sampling kernels against their twins
  timeout 150 python -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py -k \
    "fused_attention_inputs_cuda or small_kernels_cuda or gemma_kernels_cuda or sampling_kernel_cuda" \
    > "$R/pytest-fused.txt" 2>&1
  # the sampler's tests on CUDA (its device fixture names them [cuda])
  timeout 60 python -m pytest -q -p no:cacheprovider tests/test_sampler.py -k cuda \
    > "$R/pytest-sampler-cuda.txt" 2>&1
  ;;
moe)  # the MoE kernels against their twin, then one Qwen3-30B-A3B MoE layer's parts at
      # decode sizes against reading its routed experts' weights once
  timeout 150 python -m pytest -q -p no:cacheprovider tests/test_moe.py -k "cuda or gpu" \
    > "$R/pytest-moe.txt" 2>&1
  PYTHONPATH=$PWD:$PYTHONPATH timeout 150 python benchmarks/gpu/moe_decode.py \
    > "$R/moe-decode.txt" 2>&1
  ;;
gemv)  # the 16-bit decode GEMV (and the fp8 one, which shares its kernel): the kernels at
       # real projections against their twins, the start-up choice, tiny fp16 models with
       # it on and off
  timeout 500 python -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py \
    tests/test_gemv_choice.py tests/test_gpu.py tests/test_quantization.py \
    -k "gemv and not interpreter" > "$R/pytest-gemv.txt" 2>&1
  ;;
gemv-sweep)  # its tiles against cuBLAS at four models' projections (under four minutes)
  PYTHONPATH=$PWD:$PYTHONPATH timeout 280 python benchmarks/gpu/gemv_sweep.py \
    > "$R/gemv-sweep.txt" 2>&1
  ;;
2)  # real widths cut to a few layers against transformers (prompts past each window)
  # SPECS: "shape layers prompt-len" entries, comma-separated
  IFS=, read -ra specs <<< "${SPECS:-qwen3-30b-a3b-shape 2 1000,gemma-2-9b-shape 4 5000,phi-3-mini-4k-shape 2 3000,mistral-7b-v0.1-shape 2 5000}"
  for spec in "${specs[@]}"; do
    set -- $spec
    PYTHONPATH=$PWD:$PYTHONPATH timeout 150 python benchmarks/gpu/model_check.py --model $M/$1 \
      --layers $2 --prompt-len $3 --json "$R/check-$1.json" >> "$R/model-check.txt" 2>&1
  done
  ;;
latency)  # batch-1 decode against its floor
  for model in qwen3-30b-a3b-shape gemma-2-9b-shape phi-3-mini-4k-shape; do
    bench 100 latency --model $M/$model --tokenizer $T --load-format dummy --context-len 1000 \
      --batch-size 1 --output-len 64 --iterations 2 --max-model-len 2048 \
      --json "$R/latency-$model-b1.json" >> "$R/latency.txt" 2>&1
  done
  ;;
profile)  # where a batch-1 decode step's device time goes, kernel by kernel (eager)
  for model in ${MODELS:-qwen3-30b-a3b-shape phi-3-mini-4k-shape gemma-2-9b-shape}; do
    timeout 100 python -m services.cli profile --model $M/$model --tokenizer $T \
      --load-format dummy --batch-size 1 --prompt-len 1000 --max-model-len 2048 \
      --json "$R/profile-$model-b1.json" run_num_steps -n 3 > "$R/profile-$model.txt" 2>&1
  done
  ;;
tp2)  # on two GPUs: Mixtral-8x7B's real widths (two layers) against transformers at TP=2,
     # then the whole model's batch-1 decode at TP=2 against its floor
  PYTHONPATH=$PWD:$PYTHONPATH timeout 200 python benchmarks/gpu/model_check.py \
    --model $M/mixtral-8x7b-shape --layers 2 --prompt-len 1000 --tensor-parallel-size 2 \
    --json "$R/check-mixtral-8x7b-tp2.json" > "$R/model-check-mixtral-tp2.txt" 2>&1
  bench 300 latency --model $M/mixtral-8x7b-shape --tokenizer $T --load-format dummy \
    --context-len 1000 --batch-size 1 --output-len 64 --iterations 2 --max-model-len 2048 \
    --tensor-parallel-size 2 --json "$R/latency-mixtral-8x7b-tp2-b1.json" \
    > "$R/latency-mixtral-tp2.txt" 2>&1
  ;;
3)  # the nano workload's lengths on Qwen3-30B-A3B, the floor counting the experts read
  bench 400 throughput --model $M/qwen3-30b-a3b-shape --load-format dummy --workload nano \
    --path inprocess --json "$R/throughput-nano-qwen3-30b-a3b.json" \
    > "$R/throughput-nano-qwen3-30b-a3b.txt" 2>&1
  ;;
esac
lscpu | grep -E "Model name|^CPU\(s\)" > "$R/host.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv >> "$R/host.txt"
