#!/usr/bin/env bash
# The device script for issue 31 (the host side at GPU speed), every output under $OUT/r:
#   source .devkit/env.sh && bash benchmarks/gpu/issue31_check.sh STAGE
set -uo pipefail
source benchmarks/gpu/common.sh
# item 6's detokenizer-bound workload as `bench throughput` flags: 768 requests, n=4,
# logprobs=5, greedy, 32 prompt and 128 output tokens, 256 streams at most
DETOK_WORKLOAD=(--load-format dummy --workload fixed --num-prompts 768 --prompt-len 32
  --output-len 128 --n 4 --logprobs 5 --temperature 0 --max-num-seqs 256)
latency_8b_ab() {  # Llama-3.1-8B shapes' batch-1 decode in each of FORMATS, this tree then
                 # .base (bf16, AWQ int4 under a written quantization_config, fp8 on load)
  local fmt model quant tree awq=/tmp/llama-3.1-8b-awq-shape
  rm -rf $awq && cp -r $M/llama-3.1-8b-shape $awq
  python - $awq/config.json <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128,
                                 "zero_point": True, "version": "gemm"}
json.dump(config, open(sys.argv[1], "w"))
PY
  for fmt in $FORMATS; do
    model=$(realpath $M/llama-3.1-8b-shape) quant=()
    [ "$fmt" = awq ] && model=$awq
    [ "$fmt" != none ] && quant=(--quantization "$fmt")
    for tree in new base; do
      bench_in $tree 150 latency --model "$model" --load-format dummy --context-len 1000 \
        --batch-size 1 --output-len 64 --iterations 3 --max-model-len 2048 "${quant[@]}" \
        --json "$R/latency-8b-$fmt-b1-$tree.json" >> "$R/latency-ab.txt" 2>&1
    done
  done
}
serve_tree() {  # TREE: `headrace serve` of the 0.6B shapes from this tree (new) or .base,
              # on port 8800, its pid in $serve, once healthy (EXTRA_PATH: a folder put
              # first on its processes' PYTHONPATH)
  local dir=$PWD model
  model=$(realpath $M/qwen3-0.6b-shape)
  [ "$1" = base ] && dir=$PWD/.base
  port_free 8800 || return 1
  (cd "$dir" && PYTHONPATH="${EXTRA_PATH:+$EXTRA_PATH:}/tmp/site:$dir" \
    exec python -m services.cli serve "$model" \
    --load-format dummy --port 8800 --run-dir /tmp/hr-serve-$1 --served-model-name qwen3) \
    > "$R/serve-$1.log" 2>&1 &
  serve=$!
  wait_healthy 8800
}
stop_serve() { kill -TERM $serve; wait $serve; }
chats() {  # SEED PROMPTS NAME [FLAGS...]: greedy chats one at a time against port 8800,
           # the summary in NAME.txt and, for a timed run (seed other than 7), NAME.json
  local seed=$1 prompts=$2 name=$3 save=()
  [ "$seed" != 7 ] && save=(--save-result "$R/$name.json")
  timeout 150 python -m services.cli bench serve --base-url http://127.0.0.1:8800 \
    --seed $seed --disable-tqdm --endpoint chat --num-prompts $prompts --max-concurrency 1 \
    --dataset random --random-input-len 32 --random-output-len 64 "${@:4}" "${save[@]}" \
    > "$R/$name.txt" 2>&1
}
itl_chats() {  # SUFFIX: greedy chats one at a time without and with logprobs, each warmed
              # up on 16 other prompts first, then timed in the order A B B A (64 prompts
              # each: seed 1 for the first pair, 2 for the second), so that a drift over the
              # server's life falls on both alike; ABBA such rounds (1 by default; round r
              # after the first on seeds 10r+1 and 10r+2). benchmarks/gpu/itl_cost.py sums up
  local extra seed run round first second suffix=$1
  for extra in "" "--logprobs 1"; do
    chats 7 16 "warmup-$(echo "chat-c1$extra" | tr -d ' -')$suffix" $extra
  done
  for round in $(seq ${ABBA:-1}); do
    first=1 second=2
    [ $round -gt 1 ] && first=$((10 * round + 1)) second=$((10 * round + 2))
    for run in "$first" "$first --logprobs 1" "$second --logprobs 1" "$second"; do
      seed=${run%% *} extra=${run#"$seed"}
      chats $seed 64 "serve-$(echo "chat-c1$extra" | tr -d ' -')-s$seed$suffix" $extra
    done
  done
  python benchmarks/gpu/itl_cost.py "$R" > "$R/itl-cost.txt" 2>&1
}
latency_lp_ab() {  # the 0.6B batch-1 step, greedy, without and with logprobs=1, this tree
                  # then .base, twice over
  local round tree extra name
  for round in 1 2; do
    for tree in new base; do
      for extra in "" "--logprobs 1"; do
        name=latency-qwen3-0.6b-b1$(echo "$extra" | tr -d ' -')-$tree-$round
        bench_in $tree 120 latency --model "$(realpath $M/qwen3-0.6b-shape)" \
          --load-format dummy --context-len 62 --batch-size 1 --output-len 64 \
          --iterations 3 --max-model-len 2048 $extra --json "$R/$name.json" \
          >> "$R/latency-lp-ab.txt" 2>&1
      done
    done
  done
}
case "$1" in
owed)  # the H100 figures that issues 30 and 31 still owe, in one call (about 8 minutes):
      # lp-cost's nano workload on both paths without and with logprobs=1 (items 1, 2, 4),
      # latency's small-batch steps (item 3), itl's batch-1 chats (item 2), and issue 30's
      # confirm (8B int4 and fp8 at batch 1, fp8 and bf16 at batch 64). Item 6 is
      # stage_scaling.sh, a call of its own; item 5 is serving_check.sh on three leases.
  ROUNDS=1 bash "$0" lp-cost
  bash "$0" latency
  bash "$0" itl
  R=$R/issue30 bash benchmarks/gpu/issue30_check.sh confirm
  grep -h "tok/s\|GPU busy" "$R"/throughput-nano*.txt; cat "$R/latency.txt" | grep "ms/token"
  cat "$R/itl-cost.txt" "$R/issue30/latency.txt" | grep -v '^{' | tail -n 12
  ;;
latency)  # small-batch decode steps: 0.6B at batch 1 and 8, 8B at batch 1
  for spec in "qwen3-0.6b-shape 1 62" "qwen3-0.6b-shape 8 62" "llama-3.1-8b-shape 1 1000"; do
    set -- $spec
    bench 120 latency --model $M/$1 --load-format dummy --context-len $3 --batch-size $2 \
      --output-len 64 --iterations 3 --max-model-len 2048 \
      --json "$R/latency-$1-b$2.json" >> "$R/latency.txt" 2>&1
  done
  ;;
profile)  # eager per-kernel device times of one decode step of the small batches (SPECS:
         # "shape batch context" triples, comma between)
  IFS=, read -ra specs <<< "${SPECS:-qwen3-0.6b-shape 1 62,llama-3.1-8b-shape 1 1000}"
  for spec in "${specs[@]}"; do
    set -- $spec
    name=profile-$1-b$2
    timeout 150 python -m services.cli profile --model $M/$1 --load-format dummy \
      --batch-size $2 --prompt-len $3 --max-model-len 2048 --json "$R/$name.json" \
      run_num_steps -n 2 > "$R/$name.log" 2>&1
    python -m services.cli profile-table --json-trace "$R/$name.json" --phase decode_1 \
      > "$R/$name-decode.txt" 2>&1
  done
  ;;
pdl-ab)  # the graphs' GPU tests (TESTS=0: none), then the 0.6B decode step at batch 1
        # and 8 with PDL (the default) and with HEADRACE_PDL=0, ROUNDS (2) times over, PDL
        # first in odd rounds and last in even ones
  if [ "${TESTS:-1}" != 0 ]; then
    timeout 300 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -k \
      "eager_tokens or programmatic or heads or 16_bit_gemv" > "$R/pytest-graphs.txt" 2>&1
  fi
  for round in $(seq ${ROUNDS:-2}); do
    for batch in 1 8; do
      order="1 0"; [ $((round % 2)) = 0 ] && order="0 1"
      for pdl in $order; do
        HEADRACE_PDL=$pdl bench 120 latency --model "$M/qwen3-0.6b-shape" \
          --load-format dummy --context-len 62 --batch-size $batch --output-len 64 \
          --iterations 3 --max-model-len 2048 \
          --json "$R/latency-qwen3-0.6b-b$batch-pdl$pdl-$round.json" >> "$R/pdl-ab.txt" 2>&1
      done
    done
  done
  ;;
profile-graphs)  # the graphs' GEMV tests (TESTS=0: none), then `bench latency --profile`
                # of the decode steps as served, CUDA graphs and all (SPECS: "shape batch
                # context [quantization]", comma between): traces and summaries in $R
  if [ "${TESTS:-1}" != 0 ]; then
    timeout 150 python -m pytest -q -p no:cacheprovider tests/test_gemv_choice.py \
      tests/test_gpu.py -k "fixed_choice or programmatic or eager_tokens" \
      > "$R/pytest-gemv.txt" 2>&1
  fi
  IFS=, read -ra specs <<< "${SPECS:-qwen3-0.6b-shape 1 62,qwen3-0.6b-shape 8 62}"
  for spec in "${specs[@]}"; do
    set -- $spec
    quant=() name=$1-b$2
    [ -n "${4:-}" ] && quant=(--quantization $4) name=$1-$4-b$2
    bench 150 latency --model "$M/$1" --load-format dummy --context-len $3 \
      --batch-size $2 --output-len 32 --iterations 2 --max-model-len 2048 --profile \
      --profile-result-dir "$R" "${quant[@]}" --json "$R/latency-$name-profile.json" \
      > "$R/latency-$name-profile.txt" 2>&1
  done
  ;;
latency-ab)  # small-batch decode with this tree and .base (the commit before), alternating:
            # each of SPECS ("model batch context", ;-separated; the 0.6B at batch 1 and
            # 8) twice, then the 8B's batch 1 in each of FORMATS
  IFS=';' read -ra specs <<< "${SPECS:-qwen3-0.6b-shape 1 62;qwen3-0.6b-shape 8 62}"
  for round in 1 2; do
    for spec in "${specs[@]}"; do
      set -- $spec
      for tree in new base; do
        bench_in $tree 120 latency --model "$(realpath $M/$1)" --load-format dummy \
          --context-len $3 --batch-size $2 --output-len 64 --iterations 3 \
          --max-model-len 2048 --json "$R/latency-$1-b$2-c$3-$tree-$round.json" \
          >> "$R/latency-ab.txt" 2>&1
      done
    done
  done
  FORMATS="${FORMATS:-none awq fp8}" latency_8b_ab
  ;;
knobs-ab)  # batch-1 decode under each of KNOBS (';'-separated: "base" runs .base, anything
          # else is env assignments for this tree), alternating: the 0.6B at context 62
          # SMALL_ROUNDS times (2), then the 8B at context 1000 in each of FORMATS (fp8 on
          # load)
  IFS=';' read -ra knobs <<< "${KNOBS:-base;HEADRACE_NORM_SEAMS=0;HEADRACE_NORM_SEAMS=1}"
  runs=()
  for round in $(seq ${SMALL_ROUNDS:-2}); do runs+=("qwen3-0.6b-shape none 62 $round"); done
  for fmt in ${FORMATS:-none fp8}; do runs+=("llama-3.1-8b-shape $fmt 1000 1"); done
  for run in "${runs[@]}"; do
    set -- $run
    quant=()
    [ "$2" != none ] && quant=(--quantization "$2")
    for i in "${!knobs[@]}"; do
      tree=new assign=${knobs[$i]}
      [ "$assign" = base ] && tree=base assign=
      echo "== $1 $2 knob $i: ${knobs[$i]}" >> "$R/knobs-ab.txt"
      ( [ -n "$assign" ] && export $assign
        bench_in $tree 120 latency --model "$(realpath $M/$1)" --load-format dummy \
          --context-len $3 --batch-size 1 --output-len 64 --iterations 3 \
          --max-model-len 2048 "${quant[@]}" --json "$R/latency-$1-$2-knob$i-$4.json" ) \
        >> "$R/knobs-ab.txt" 2>&1
    done
  done
  ;;
nano)  # the nano workload on both user paths, then with logprobs=1, then with top_p
  for extra in "" "--logprobs 1" "--top-p 0.9"; do
    name=$(echo "nano$extra" | tr -d ' -')
    bench 200 throughput --model $M/qwen3-0.6b-shape --load-format dummy --workload nano \
      --path inprocess,http $extra --json "$R/throughput-$name.json" \
      > "$R/throughput-$name.txt" 2>&1
  done
  ;;
steps)  # the in-process path with the executor on the step thread and in the loop
  for flag in --step-thread --no-step-thread; do
    bench 150 throughput --model $M/qwen3-0.6b-shape --load-format dummy --workload nano \
      $flag --json "$R/throughput-nano$flag.json" > "$R/throughput-nano$flag.txt" 2>&1
  done
  ;;
ab)  # the in-process nano workload in this tree and in .base (a copy of the commit before),
    # alternating in one lease, with the executor on the step thread and in the worker
    # process (EXTRA: more bench flags, such as --logprobs 1; TAG names the files)
  for round in 1 2; do
    for tree in new base; do
      for wp in 0 1; do
        name=throughput-nano${TAG:-}-$tree-wp$wp-$round
        HEADRACE_WORKER_PROCESS=$wp bench_in $tree 150 throughput \
          --model "$(realpath $M/qwen3-0.6b-shape)" --load-format dummy --workload nano \
          --path inprocess ${EXTRA:-} --json "$R/$name.json" > "$R/$name.txt" 2>&1
      done
    done
  done
  ;;
lp-ab)  # the nano workload on both paths, without and with logprobs=1, in this tree and in
       # .base (the commit before), alternating in one lease
  for tree in new base; do
    for extra in "" "--logprobs 1"; do
      name=throughput-nano$(echo "$extra" | tr -d ' -')-$tree
      bench_in $tree 280 throughput --model "$(realpath $M/qwen3-0.6b-shape)" \
        --load-format dummy --workload nano --path inprocess,http $extra \
        --json "$R/$name.json" > "$R/$name.txt" 2>&1
    done
  done
  ;;
lp-check)  # the sampler's CUDA logprob tests, then the nano workload with logprobs=1 on both
          # paths and without, in this tree, and with logprobs=1 in-process in .base
  timeout 150 python -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py \
    tests/test_sampler.py -k "sampling_kernel_cuda or logprob" > "$R/pytest-logprobs-cuda.txt" 2>&1
  for run in "new --logprobs 1" "new" "base --logprobs 1"; do
    set -- $run
    paths=inprocess,http; [ $1 = base ] && paths=inprocess
    name=throughput-nano$(echo "${*:2}" | tr -d ' -')-$1
    bench_in $1 200 throughput --model "$(realpath $M/qwen3-0.6b-shape)" --load-format dummy \
      --workload nano --path $paths "${@:2}" --json "$R/$name.json" > "$R/$name.txt" 2>&1
  done
  ;;
lp-profile)  # benchmarks/gpu/loop_profile.py (tok/s, the loop's phases, the device's idle
            # time between steps, the loop under cProfile) on the nano workload, this tree
            # with logprobs=1 and without, .base with them; then the in-process path with
            # logprobs=1, this tree and .base alternating twice
  mkdir -p .base/benchmarks/gpu && cp benchmarks/gpu/loop_profile.py .base/benchmarks/gpu/
  model=$(realpath $M/qwen3-0.6b-shape)
  for run in "new 1" "new 0" "base 1"; do
    set -- $run
    dir=$PWD; [ $1 = base ] && dir=$PWD/.base
    lp=(); [ $2 = 1 ] && lp=(--logprobs 1)
    (cd "$dir" && PYTHONPATH="/tmp/site:$dir" timeout 150 python \
      benchmarks/gpu/loop_profile.py --model "$model" --load-format dummy "${lp[@]}" \
      --out "$R/loop-$1-lp$2") > "$R/loop-$1-lp$2.txt" 2>&1
  done
  for round in 1 2; do
    for tree in new base; do
      name=throughput-nanologprobs1-$tree-$round
      bench_in $tree 120 throughput --model "$model" --load-format dummy --workload nano \
        --path inprocess --logprobs 1 --json "$R/$name.json" > "$R/$name.txt" 2>&1
    done
  done
  ;;
lp-cost)  # what logprobs=1 costs the nano workload on both paths, in this tree: without and
         # with them alternating, ROUNDS times (2 by default)
  for round in $(seq ${ROUNDS:-2}); do
    for extra in "" "--logprobs 1"; do
      name=throughput-nano$(echo "$extra" | tr -d ' -')-$round
      bench 200 throughput --model $M/qwen3-0.6b-shape --load-format dummy --workload nano \
        --path inprocess,http $extra --json "$R/$name.json" > "$R/$name.txt" 2>&1
    done
  done
  ;;
latency-lp-ab)  # the sampler's, the input copies' and the output blocks' CUDA tests, the
               # copies' host cost (input_copies.py; TESTS=0: neither), then latency_lp_ab
  if [ "${TESTS:-1}" != 0 ]; then
    timeout 200 python -m pytest -q -p no:cacheprovider tests/test_step_inputs.py \
      tests/test_kernels_triton.py::test_sampling_kernel_cuda tests/test_sampler.py \
      -k "cuda or CUDA or gpu" > "$R/pytest-sampler-cuda.txt" 2>&1
    timeout 100 python -m pytest -q -p no:cacheprovider tests/test_launched.py \
      >> "$R/pytest-sampler-cuda.txt" 2>&1
    timeout 60 python benchmarks/gpu/input_copies.py > "$R/input-copies.txt" 2>&1
  fi
  latency_lp_ab
  ;;
latency-topk-ab)  # the 0.6B decode step in process, greedy, at SPECS ("batch logprobs"
                 # pairs, comma between, - for no logprobs; batch 1 with logprobs=1 and
                 # batch 256 with logprobs=5 by default), this tree then .base, ROUNDS (1)
                 # times over
  IFS=, read -ra specs <<< "${SPECS:-1 1,256 5}"
  for round in $(seq ${ROUNDS:-1}); do
    for spec in "${specs[@]}"; do
      set -- $spec
      lp=(); [ "$2" != - ] && lp=(--logprobs $2)
      for tree in new base; do
        bench_in $tree 150 latency --model "$(realpath $M/qwen3-0.6b-shape)" \
          --load-format dummy --context-len 62 --batch-size $1 --output-len 64 \
          --iterations 3 --max-model-len 2048 "${lp[@]}" \
          --json "$R/latency-b$1-lp$2-$tree-$round.json" >> "$R/latency-topk-ab.txt" 2>&1
        python -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], {k: v for k, v in d.items() if 'ms' in k or 'latency' in k})" \
          "$R/latency-b$1-lp$2-$tree-$round.json"
      done
    done
  done
  ;;
topk-chunks)  # benchmarks/gpu/top_logprobs_chunks.py over the kernels of this tree, then
             # of .base, at TILES (every tile the script has, by default)
  for tree in new base; do
    dir=$PWD; [ $tree = base ] && dir=$PWD/.base
    PYTHONPATH="/tmp/site:$dir" timeout 200 python benchmarks/gpu/top_logprobs_chunks.py \
      ${TILES:+--tiles $TILES} > "$R/top-logprobs-chunks-$tree.txt" 2>&1
    tail -n 1 "$R/top-logprobs-chunks-$tree.txt"
  done
  ;;
topk-ab)  # the top-logprobs kernel's CUDA tests and the heads' (TESTS=0: none), then
         # topk-chunks, detok-inproc-ab's workload (ROUNDS, 2) and latency-topk-ab's
         # batch-1 and batch-8 steps
  if [ "${TESTS:-1}" != 0 ]; then
    timeout 200 python -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py \
      tests/test_gpu.py -k "sampling_kernel_cuda or heads or graph_head" \
      > "$R/pytest-topk.txt" 2>&1
    tail -n 1 "$R/pytest-topk.txt"
  fi
  bash "$0" topk-chunks
  TESTS=0 bash "$0" detok-inproc-ab
  SPECS="1 5,1 20,8 5" bash "$0" latency-topk-ab
  ;;
detok-ab)  # the sampler's CUDA tests (TESTS=0: none), then the detokenizer-bound workload
          # of stage_scaling.sh (n=4, logprobs=5, 256 streams) at REPLICAS (1 2 4) through
          # `serve` of this tree and of .base, ROUNDS (1) times over, this tree first in odd
          # rounds and .base first in even ones: $R/{new,base}-ROUND/
  if [ "${TESTS:-1}" = 1 ]; then
    timeout 200 python -m pytest -q -p no:cacheprovider tests/test_step_inputs.py \
      tests/test_kernels_triton.py::test_sampling_kernel_cuda tests/test_sampler.py \
      -k "cuda or CUDA or gpu" > "$R/pytest-sampler-cuda.txt" 2>&1
    tail -n 1 "$R/pytest-sampler-cuda.txt"
  fi
  for round in $(seq ${ROUNDS:-1}); do
    trees="new base"; [ $((round % 2)) = 0 ] && trees="base new"
    for tree in $trees; do
      dir=$PWD; [ $tree = base ] && dir=$PWD/.base
      R=$R/$tree-$round SERVE_TREE=$dir WORKLOADS=detok REPLICAS=${REPLICAS:-1 2 4} \
        DEADLINE_S=100000 bash benchmarks/gpu/stage_scaling.sh 2>&1 | grep -E "^==|^\| [0-9]"
    done
  done
  ;;
detok-ceiling)  # item 6's bound: the detokenizer-bound workload's engine without the I/O
              # stages. The 0.6B decode step at the workload's batch (256 rows, logprobs=5,
              # greedy), then the workload itself (768 requests, n=4, 32 prompt and 128
              # output tokens) in process and through HTTP with REPLICAS (4) tokenizers and
              # detokenizers (PATHS: other paths than inprocess,http), ROUNDS (2) times over;
              # LATENCY=0 skips the decode step
  model=$(realpath $M/qwen3-0.6b-shape)
  if [ "${LATENCY:-1}" != 0 ]; then
    bench 150 latency --model "$model" --load-format dummy --context-len 96 \
      --batch-size 256 --output-len 64 --iterations 3 --max-model-len 2048 --logprobs 5 \
      --json "$R/latency-b256-lp5.json" > "$R/latency-b256-lp5.txt" 2>&1
  fi
  for round in $(seq ${ROUNDS:-2}); do
    bench 280 throughput --model "$model" "${DETOK_WORKLOAD[@]}" \
      --path ${PATHS:-inprocess,http} \
      --api-server-count 4 --tokenizer-replicas ${REPLICAS:-4} \
      --detokenizer-replicas ${REPLICAS:-4} \
      --json "$R/throughput-detok-$round.json" > "$R/throughput-detok-$round.txt" 2>&1
    tail -n 4 "$R/throughput-detok-$round.txt"
  done
  ;;
detok-inproc-ab)  # the heads' GPU tests (TESTS=0: none), then detok-ceiling's workload in
                # process, this tree and .base alternating, ROUNDS (2) times over
  if [ "${TESTS:-1}" != 0 ]; then
    timeout 200 python -m pytest -q -p no:cacheprovider tests/test_gpu.py \
      tests/test_sampler.py -k "heads or graph_head" > "$R/pytest-heads.txt" 2>&1
    tail -n 1 "$R/pytest-heads.txt"
  fi
  for round in $(seq ${ROUNDS:-2}); do
    trees="new base"; [ $((round % 2)) = 0 ] && trees="base new"
    for tree in $trees; do
      name=throughput-detok-$tree-$round
      bench_in $tree 150 throughput --model "$(realpath $M/qwen3-0.6b-shape)" \
        "${DETOK_WORKLOAD[@]}" --path inprocess --json "$R/$name.json" > "$R/$name.txt" 2>&1
      tail -n 2 "$R/$name.txt"
    done
  done
  ;;
compile-ab)  # the CUDA tests of eager steps' kernel specializations and the attention's
            # (TESTS=0: none), then detok-inproc-ab's workload once in this tree and once in
            # .base, each with a Triton cache of its own from empty: how many variants of
            # the attention and of the cache write each compiled, startup and run together
            # ($R/variants.txt)
  if [ "${TESTS:-1}" != 0 ]; then
    timeout 200 python -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py -k \
      "eager_steps or attention_cuda or norm_rope or key_limits or window_cuda or soft_cap" \
      > "$R/pytest-compile.txt" 2>&1
    tail -n 1 "$R/pytest-compile.txt"
  fi
  for tree in new base; do
    rm -rf /tmp/triton-$tree
    TRITON_CACHE_DIR=/tmp/triton-$tree bench_in $tree 200 throughput \
      --model "$(realpath $M/qwen3-0.6b-shape)" "${DETOK_WORKLOAD[@]}" --path inprocess \
      --json "$R/throughput-detok-$tree.json" > "$R/throughput-detok-$tree.txt" 2>&1
    for kernel in _paged_attention_kernel _norm_rope_write_kv_kernel; do
      echo "$tree $kernel $(find /tmp/triton-$tree -name "$kernel.json" | wc -l)"
    done | tee -a "$R/variants.txt"
  done
  ;;
paths)  # this tree's nano workload on both paths in one command, ROUNDS times over, with
       # the executor in the worker process and then on the step thread (WPS: which of the
       # two, 1 and 0; EXTRA: more flags; TAG names the files)
  for round in $(seq ${ROUNDS:-2}); do
    for wp in ${WPS:-1 0}; do
      HEADRACE_WORKER_PROCESS=$wp bench 280 throughput --model $M/qwen3-0.6b-shape \
        --load-format dummy --workload nano --path inprocess,http ${EXTRA:-} \
        >> "$R/throughput-nano${TAG:-}-paths-wp$wp.txt" 2>&1
    done
  done
  ;;
itl-ab)  # one streamed chat at a time with top_p 0.95, through `headrace serve` of this tree
        # and then of the copy in .base (the commit before; TREES: which of the two;
        # CONCURRENCY: chats at a time, 1 by default, each its 64 timed prompts' worth)
  for tree in ${TREES:-new base}; do
    serve_tree $tree || exit 1
    c=${CONCURRENCY:-1}
    for seed in 7 1; do  # 7: the warm-up, on other prompts
      timeout 150 python -m services.cli bench serve --base-url http://127.0.0.1:8800 \
        --seed $seed --disable-tqdm --endpoint chat \
        --num-prompts $(( c * ($seed == 7 ? 16 : 64) )) --max-concurrency $c \
        --dataset random --random-input-len 32 --random-output-len 64 \
        --temperature 0.7 --top-p 0.95 --save-result "$R/chat-c$c-topp-$tree-$seed.json" \
        > "$R/chat-c$c-topp-$tree-$seed.txt" 2>&1
    done
    stop_serve
  done
  ;;
itl)  # one streamed chat at a time, without and with logprobs, through `headrace serve`
  serve_tree new && itl_chats "" && stop_serve
  ;;
itl-spy)  # the itl stage's chats with py-spy (in .devkit/whl) sampling the worker and the
          # scheduler through each timed run: spy-STAGE-NAME.txt, their busiest functions
          # (SPY_FLAGS: more py-spy flags, such as --gil for the GIL holder's samples only)
  export PATH=/tmp/site/bin:$PATH
  serve_tree new || exit 1
  for extra in "" "--logprobs 1"; do
    name=$(echo "chat-c1$extra" | tr -d ' -')
    chats 7 16 "warmup-$name" $extra
    spies=()
    for stage in worker scheduler; do
      py-spy record --nonblocking --threads ${SPY_FLAGS:-} -d 4 -r 500 -f raw -o "$R/spy-$stage-$name.raw" \
        -p "$(pgrep -f "services.cli $stage " | head -n 1)" > "$R/spy-$stage-$name.log" 2>&1 &
      spies+=($!)
    done
    chats 1 64 "serve-$name" $extra
    wait "${spies[@]}"
  done
  stop_serve
  for raw in "$R"/spy-*.raw; do
    python benchmarks/gpu/top_frames.py "$raw" > "${raw%.raw}.txt"
  done
  ;;
itl-gil)  # the itl chats (A B B A) through this tree's serve with Python's switch interval
         # at its default, 5 ms, and then at SWITCH seconds (1e-4 by default) in every
         # served process, set by a sitecustomize: whether the worker's step thread waits
         # for the GIL that its event loop's thread holds
  serve_tree new && itl_chats "-default" && stop_serve
  mkdir -p /tmp/switch
  echo "import sys; sys.setswitchinterval(${SWITCH:-1e-4})" > /tmp/switch/sitecustomize.py
  EXTRA_PATH=/tmp/switch serve_tree new && itl_chats "-switch" && stop_serve
  ;;
itl-lp-ab)  # the same, through `headrace serve` of this tree and then of .base (the commit
           # before), ROUNDS times over
  for round in $(seq ${ROUNDS:-1}); do
    for tree in new base; do
      serve_tree $tree && itl_chats "-$tree-$round" && stop_serve
    done
  done
  ;;
placement)  # the 0.6B batch-1 step (latency, no logprobs), ROUNDS times over, unpinned and
           # pinned (taskset) to one CPU, to a CPU and its hyperthread sibling, and to two
           # CPUs of separate cores: whether a slow run is where its threads land
  { lscpu; lscpu -e; nvidia-smi topo -m; } > "$R/topology.txt" 2>&1
  sib=$(tr ',-' '\n\n' < /sys/devices/system/cpu/cpu2/topology/thread_siblings_list | grep -vx 2 | head -n 1)
  other=$(for c in 4 5 6 7 8 9 10; do grep -qw $c /sys/devices/system/cpu/cpu2/topology/thread_siblings_list || { echo $c; break; }; done)
  for round in $(seq ${ROUNDS:-3}); do
    for cpus in all 2 "2,${sib:-3}" "2,$other"; do
      pin=(); [ "$cpus" != all ] && pin=(taskset -c "$cpus")
      name=latency-b1-cpus$(echo "$cpus" | tr , _)-$round
      "${pin[@]}" timeout 120 python -m services.cli bench latency --model $M/qwen3-0.6b-shape \
        --load-format dummy --context-len 62 --batch-size 1 --output-len 64 --iterations 20 \
        --max-model-len 2048 --json "$R/$name.json" > "$R/$name.txt" 2>&1
    done
  done
  ;;
esac
lscpu | grep -E "Model name|^CPU\(s\)" > "$R/host.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv >> "$R/host.txt"
