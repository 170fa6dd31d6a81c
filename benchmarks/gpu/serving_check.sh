#!/usr/bin/env bash
# The serving path on the GPU, as a user meets it. Every output under $OUT/r:
#   source .devkit/env.sh && bash benchmarks/gpu/serving_check.sh serve
#     one short chat at a time, two at a time, then 1000 synthetic-sharegpt requests at once, through
#     `headrace serve` over HTTP (client latencies beside the server's per-stage
#     breakdown) and the Redis errors in their logs, after the in-process decode step
#   source .devkit/env.sh && bash benchmarks/gpu/serving_check.sh throughput
#     the nano workload in-process and over HTTP in one command
# API_SERVERS (default 4) sets --api-server-count; DEFAULT_STAGES=1 gives serve no stage
# counts at all, so it sizes the gateways, tokenizers and detokenizers from the cores (as a
# user's plain `headrace serve MODEL` does; issue 31 item 5). With PROFILE=1 and py-spy on the PATH,
# the 1000-request run is also sampled for 15 s in one gateway, the scheduler and one
# detokenizer (profile-*.txt: the functions with the most samples).
set -uo pipefail
source benchmarks/gpu/common.sh
bench_serve() {  # NAME ARGS...: a timed run, after a warm-up on another seed's prompts
  local name=$1; shift
  timeout 200 python -m services.cli bench serve --base-url http://127.0.0.1:8800 \
    --seed 7 --disable-tqdm "$@" > "$R/warmup-$name.txt" 2>&1
  [ "${PROFILE:-0}" = 1 ] && [ "$name" = serve-sharegpt-1000 ] && profile_stages &
  timeout 300 python -m services.cli bench serve --base-url http://127.0.0.1:8800 \
    --seed 1 --disable-tqdm --save-result "$R/$name.json" "$@" > "$R/$name.txt" 2>&1
}

serve_checks() {
  # the in-process decode step first: the served worker would still hold the GPU memory
  timeout 200 python -m services.cli bench latency --model $M/qwen3-0.6b-shape \
    --load-format dummy --context-len 62 --batch-size 1 --output-len 64 --iterations 3 \
    > "$R/latency-c62-b1.txt" 2>&1
  port_free 8800 || return 1
  # python itself in the background (not a shell function's subshell), so that
  # the kill below reaches the launcher
  local stages=(--tokenizer-replicas 2 --detokenizer-replicas 2
                --api-server-count "${API_SERVERS:-4}")
  [ "${DEFAULT_STAGES:-0}" = 1 ] && stages=()
  python -m services.cli serve $M/qwen3-0.6b-shape --load-format dummy "${stages[@]}" \
    --port 8800 --run-dir /tmp/hr-serve --served-model-name qwen3 > "$R/serve.log" 2>&1 &
  local serve=$!
  wait_healthy 8800
  bench_serve serve-chat-c1 --endpoint chat --num-prompts 64 --max-concurrency 1 \
    --dataset random --random-input-len 32 --random-output-len 64 --ignore-eos
  # two at a time, of outputs 32 to 96 tokens long: requests arrive while another decodes,
  # so TTFT shows how many queued steps a new prefill waits behind
  bench_serve serve-chat-c2 --endpoint chat --num-prompts 64 --max-concurrency 2 \
    --dataset random --random-input-len 32 --random-output-len 64 \
    --random-range-ratio 0.5 --ignore-eos
  bench_serve serve-sharegpt-1000 --num-prompts 1000 --dataset synthetic-sharegpt \
    --ignore-eos
  kill -TERM $serve; wait $serve
  grep -ciE 'too many connections|MaxConnectionsError|ConnectionError|cannot (read|write)' \
    "$R/serve.log" /tmp/hr-serve/*.log > "$R/redis-errors.txt" 2>&1
  # the pauses each process logged (common/stalls.py), and the host they ran on: the
  # host side of these figures differs by up to 1.5x between machine starts
  grep -h '"slow \|"event loop stalled"' "$R/serve.log" > "$R/stalls.jsonl"
  lscpu | grep -E '^(Model name|CPU\(s\)|CPU max MHz)' > "$R/host.txt"
  grep -hv '"event"' "$R/serve-chat-c1.txt" "$R/serve-chat-c2.txt" "$R/serve-sharegpt-1000.txt" \
    "$R/redis-errors.txt" "$R/latency-c62-b1.txt" "$R/host.txt" | tail -n 90
}

profile_stages() {  # sample a gateway, the scheduler and a detokenizer for 15 s
  sleep 3
  for stage in gateway scheduler detokenizer; do
    local pid; pid=$(pgrep -f "services.cli $stage .*--replica 0" | head -n 1)
    py-spy record --nonblocking -d 15 -r 200 -f raw -o "$R/profile-$stage.raw" -p "$pid" \
      > /dev/null 2>&1 &
  done
  sleep 17
  for raw in "$R"/profile-*.raw; do
    python benchmarks/gpu/top_frames.py "$raw" > "${raw%.raw}.txt" && rm "$raw"
  done
}

throughput_checks() {
  timeout 560 python -m services.cli bench throughput --model $M/qwen3-0.6b-shape \
    --load-format dummy --workload nano --path inprocess,http --detokenizer-replicas 2 \
    --json "$R/throughput-nano.json" > "$R/throughput-nano.txt" 2>&1
  grep -hv '"event"' "$R/throughput-nano.txt" | tail -n 40
}

case "${1:-serve}" in
  serve) serve_checks ;;
  throughput) throughput_checks ;;
  *) echo "usage: $0 serve|throughput" >&2; exit 2 ;;
esac
