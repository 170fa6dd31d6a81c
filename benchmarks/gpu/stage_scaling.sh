#!/usr/bin/env bash
# Issue 31 item 6, the I/O stages scaling out. For each count in REPLICAS, one `headrace
# serve` with that many tokenizers and detokenizers runs two workloads through
# `headrace bench serve`, each timed after a warm-up on another seed's prompts:
#   tok   tokenizer-bound: long text prompts (words, so the tokenizer does real work), one
#         output token, TOK_CONCURRENCY open at once. The prompts share one cached prefix
#         (vLLM's prefix_repetition dataset), so the GPU prefills only each one's suffix: by
#         estimate a fresh 3000-token prefill of the 0.6B model takes the H100 about 10 ms
#         (from the 8B prefill profile), what tokenizing it takes one tokenizer (21 ms on
#         the shared 2-core dev machine), so the GPU would bound the run from one replica.
#   detok detokenizer-bound: short prompts, n=DETOK_N completions each with DETOK_LOGPROBS
#         logprobs per token, streamed, DETOK_CONCURRENCY requests open at once.
# Every output under $R ($OUT/r): {tok,detok}-N.{json,txt} (bench serve's result, with the
# server's stage histograms in server_stages and the client's own CPU in client_cores),
# {tok,detok}-N-cpu.json (the CPU seconds of each server process over the timed run),
# {tok,detok}-N-gpu.csv (nvidia-smi's utilization every 200 ms, where there is a GPU),
# serve-N.log, host.txt, then scaling.png and scaling.md (benchmarks/bench/scaling_plot.py).
#   source .devkit/env.sh && bash benchmarks/gpu/stage_scaling.sh
# Every setting below can be overridden from the environment (a tiny CPU run: README).
set -uo pipefail
source benchmarks/gpu/common.sh
MODEL=${MODEL:-$M/qwen3-0.6b-shape}
SERVE_FLAGS=${SERVE_FLAGS---load-format dummy}  # set empty for a model with weights
REPLICAS=${REPLICAS:-1 2 4 8}
WORKLOADS=${WORKLOADS:-tok detok}  # which of the two run, in this order
API_SERVERS=${API_SERVERS:-4}
PORT=${PORT:-8800}
TOK_PROMPTS=${TOK_PROMPTS:-2000}
TOK_PREFIX_LEN=${TOK_PREFIX_LEN:-2976}  # 186 blocks of 16: the suffix starts a fresh block
TOK_SUFFIX_LEN=${TOK_SUFFIX_LEN:-24}
TOK_CONCURRENCY=${TOK_CONCURRENCY:-512}  # under serve's --max-queue-len (1024)
DETOK_PROMPTS=${DETOK_PROMPTS:-768}
DETOK_INPUT_LEN=${DETOK_INPUT_LEN:-32}
DETOK_OUTPUT_LEN=${DETOK_OUTPUT_LEN:-128}
DETOK_N=${DETOK_N:-4}
DETOK_LOGPROBS=${DETOK_LOGPROBS:-5}
DETOK_CONCURRENCY=${DETOK_CONCURRENCY:-64}  # x n streams: serve's --max-num-seqs (256)
WARMUP_DIVISOR=${WARMUP_DIVISOR:-8}  # a warm-up sends this fraction of the timed requests
SERVE_TREE=${SERVE_TREE:-$PWD}  # the checkout whose `serve` runs (the client is this one's)
SPY=${SPY:-}  # roles (as `services.cli ROLE`) that py-spy samples for SPY_S s of each timed run
SPY_S=${SPY_S:-8}
SPY_FLAGS=${SPY_FLAGS:-}  # more py-spy flags, such as --gil for the GIL holder's samples only
DEADLINE_S=${DEADLINE_S:-400}  # no further replica count starts after this many seconds

tok_flags() {  # NUM_PROMPTS
  echo --endpoint completions --num-prompts "$1" --max-concurrency "$TOK_CONCURRENCY" \
    --dataset prefix_repetition --prefix-repetition-num-prefixes 1 \
    --prefix-repetition-prefix-len "$TOK_PREFIX_LEN" \
    --prefix-repetition-suffix-len "$TOK_SUFFIX_LEN" --prefix-repetition-output-len 1
}
detok_flags() {  # NUM_PROMPTS
  echo --endpoint completions --num-prompts "$1" --max-concurrency "$DETOK_CONCURRENCY" \
    --dataset random --random-input-len "$DETOK_INPUT_LEN" \
    --random-output-len "$DETOK_OUTPUT_LEN" --n "$DETOK_N" --logprobs "$DETOK_LOGPROBS"
}

run_workload() {  # NAME NUM_PROMPTS: the warm-up (seed 7), then the timed run (seed 1)
  local name=$1 prompts=$2 kind=${1%%-*}
  local warmup=$(( prompts / WARMUP_DIVISOR > 0 ? prompts / WARMUP_DIVISOR : 1 ))
  timeout 120 python -m services.cli bench serve --base-url "http://127.0.0.1:$PORT" \
    --seed 7 --disable-tqdm $("${kind}_flags" "$warmup") > "$R/warmup-$name.txt" 2>&1
  python -m benchmarks.bench.proc_cpu snapshot /tmp/cpu-before.json "$serve"
  local sampler=""
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader,nounits -lms 200 \
      > "$R/$name-gpu.csv" 2> /dev/null &
    sampler=$!
  fi
  local spies=()
  for role in $SPY; do
    py-spy record --nonblocking --threads $SPY_FLAGS -d "$SPY_S" -r 500 -f raw -o "$R/spy-$role-$name.raw" \
      -p "$(pgrep -f "services.cli $role " | head -n 1)" > "$R/spy-$role-$name.log" 2>&1 &
    spies+=($!)
  done
  timeout 150 python -m services.cli bench serve --base-url "http://127.0.0.1:$PORT" \
    --seed 1 --disable-tqdm --save-result "$R/$name.json" $("${kind}_flags" "$prompts") \
    > "$R/$name.txt" 2>&1
  [ -n "$sampler" ] && kill "$sampler"
  for spy in "${spies[@]}"; do wait "$spy"; done
  for role in $SPY; do
    python benchmarks/gpu/top_frames.py "$R/spy-$role-$name.raw" > "$R/spy-$role-$name.txt"
  done
  python -m benchmarks.bench.proc_cpu snapshot /tmp/cpu-after.json "$serve"
  python -m benchmarks.bench.proc_cpu diff /tmp/cpu-before.json /tmp/cpu-after.json \
    > "$R/$name-cpu.json"
  grep -E 'Successful|Failed|duration|Request throughput|Output token|Client CPU' "$R/$name.txt"
}

lscpu > "$R/host.txt"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv \
  >> "$R/host.txt"
for n in $REPLICAS; do
  if [ "$SECONDS" -gt "$DEADLINE_S" ]; then
    echo "== $n replicas and more skipped: $SECONDS s have passed (DEADLINE_S=$DEADLINE_S)"
    break
  fi
  port_free "$PORT" || exit 1
  # python itself in the background (exec: not a subshell around it), so that the kill
  # below reaches the launcher
  model=$MODEL; [ -e "$MODEL" ] && model=$(realpath "$MODEL")  # a path, from the tree
  (cd "$SERVE_TREE" && PYTHONPATH="/tmp/site:$PWD" exec python -m services.cli serve "$model" \
    $SERVE_FLAGS --tokenizer-replicas "$n" --detokenizer-replicas "$n" \
    --api-server-count "$API_SERVERS" --port "$PORT" --run-dir "/tmp/hr-scaling-$n" \
    --served-model-name scaling) > "$R/serve-$n.log" 2>&1 &
  serve=$!
  started=$SECONDS
  wait_healthy "$PORT"
  echo "== $n replicas (healthy after $(( SECONDS - started )) s)"
  for kind in $WORKLOADS; do
    prompts=TOK_PROMPTS; [ "$kind" = detok ] && prompts=DETOK_PROMPTS
    run_workload "$kind-$n" "${!prompts}"
  done
  kill -TERM $serve; wait $serve
  echo "== $n replicas done after $(( SECONDS - started )) s"
done
python -m benchmarks.bench.scaling_plot "$R" && cat "$R/scaling.md"
