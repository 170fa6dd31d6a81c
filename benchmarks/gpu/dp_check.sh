#!/usr/bin/env bash
# The device script for data parallelism, on nvidia-h200-x2 (every output under $OUT/r).
#   source .devkit/env.sh && bash benchmarks/gpu/dp_check.sh nano [NUM_PROMPTS]
#     the nano workload (256 prompts, or NUM_PROMPTS of its lengths) over HTTP with two
#     shards and with one, in one command (Qwen3-0.6B shapes, dummy weights; the
#     in-process engine on one GPU first, as always)
#   source .devkit/env.sh && bash benchmarks/gpu/dp_check.sh prefix
#     `headrace serve --data-parallel-size 2` with prefix routing, then round robin: 16
#     system prompts of 1000 tokens x 32 user turns of 100 tokens, in random order, all at
#     once, 128 output tokens each; a warm-up on other prompts (seed 7) before each timed
#     run (seed 1); each shard's prefix-cache hit rate comes from /metrics
#   source .devkit/env.sh && bash benchmarks/gpu/dp_check.sh prefix-small-kv
#     the same with 1024 KV blocks per shard (16,384 tokens), fewer than the 16 system
#     prompts and the running requests need together: a shard must evict prefixes
set -uo pipefail
source benchmarks/gpu/common.sh

nano_check() {  # [NUM_PROMPTS]
  local n=${1:-256}
  bench 570 throughput --model $M/qwen3-0.6b-shape --load-format dummy --workload nano \
    --num-prompts "$n" --path http --data-parallel-size 2 --compare-data-parallel \
    --tokenizer-replicas 2 --detokenizer-replicas 2 --api-server-count 4 \
    --json "$R/throughput-nano$n-dp2.json" > "$R/throughput-nano$n-dp2.txt" 2>&1
  grep -hv '"event"' "$R/throughput-nano$n-dp2.txt" | tail -n 30
}

prefix_run() {  # ROUTING TAG [SERVE ARGS...]: serve two shards, warm up, time the
  local routing=$1 tag=$2  # shared-prefix workload
  shift 2
  port_free 8800 || return 1
  # python itself in the background (not a shell function's subshell), so that
  # the kill below reaches the launcher
  python -m services.cli serve $M/qwen3-0.6b-shape --load-format dummy --data-parallel-size 2 \
    --data-parallel-routing "$routing" --tokenizer-replicas 2 --detokenizer-replicas 2 \
    --api-server-count 4 --port 8800 --run-dir "/tmp/hr-dp-$routing" \
    --served-model-name qwen3 "$@" > "$R/serve-$tag-$routing.log" 2>&1 &
  local serve=$!
  wait_healthy 8800
  sleep 5  # /health says 200 once one shard is up: give the other its first stats
  local workload=(--dataset prefix_repetition --num-prompts 512
    --prefix-repetition-num-prefixes 16 --prefix-repetition-prefix-len 1000
    --prefix-repetition-suffix-len 100 --prefix-repetition-output-len 128
    --token-id-prompts 10000 --base-url http://127.0.0.1:8800 --disable-tqdm)
  timeout 200 python -m services.cli bench serve "${workload[@]}" --seed 7 \
    > "$R/warmup-$tag-$routing.txt" 2>&1
  timeout 200 python -m services.cli bench serve "${workload[@]}" --seed 1 \
    --save-result "$R/serve-$tag-$routing.json" > "$R/serve-$tag-$routing.txt" 2>&1
  kill -TERM $serve; wait $serve
  grep -hv '"event"' "$R/serve-$tag-$routing.txt" | tail -n 25
}

case "${1:-nano}" in
  nano) nano_check "${2:-256}" ;;
  prefix) prefix_run prefix prefix; prefix_run round_robin prefix ;;
  prefix-small-kv)
    for routing in prefix round_robin; do
      prefix_run $routing prefix-small-kv --num-gpu-blocks-override 1024
    done ;;
  *) echo "usage: $0 nano [NUM_PROMPTS]|prefix|prefix-small-kv" >&2; exit 2 ;;
esac
