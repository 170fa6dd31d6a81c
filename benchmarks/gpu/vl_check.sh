#!/usr/bin/env bash
# Issue 35's figures: a vision-language model at Qwen2.5-VL-7B shapes (dummy weights)
# served with each given number of tokenizer replicas, its images made by
# `headrace bench serve --dataset random-mm`. One command per count fits a device call:
#   source .devkit/env.sh && bash benchmarks/gpu/vl_check.sh 1
#   source .devkit/env.sh && TTFT=0 bash benchmarks/gpu/vl_check.sh 2
# (several counts in one command take about 3 minutes each). Per count N, under $R:
#   ttft-tN.{txt,json}      first count only (TTFT=0: none): one 1024x1024 image plus a
#                           short question, one request at a time, 20 requests, 16 tokens
#   images200-tN.{txt,json} 200 requests of one 1024x1024 image each, all at once, 64
#                           tokens each (ignore_eos); the JSON holds the server's stages
#   warmup-*-tN.txt         the warm-ups before each (another seed: no cache hits)
#   serve-tN.log            the server's log
# and host.txt (lscpu). MODEL, MAX_MODEL_LEN, NUM_PROMPTS, TTFT_PROMPTS, WARMUP_PROMPTS,
# IMAGE (a bucket key), QUESTION_LEN, OUTPUT_LEN, PORT and SERVE_FLAGS (more serve flags)
# override the defaults, e.g. for a CPU run of a tiny model:
#   R=/tmp/vl MODEL=/tmp/tiny-qwen2_5_vl MAX_MODEL_LEN=512 NUM_PROMPTS=8 \
#     SERVE_FLAGS='--dtype float32' bash benchmarks/gpu/vl_check.sh 1 2
set -uo pipefail
source benchmarks/gpu/common.sh
MODEL=${MODEL:-$M/qwen2.5-vl-7b-shape}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-8192}
NUM_PROMPTS=${NUM_PROMPTS:-200}
TTFT_PROMPTS=${TTFT_PROMPTS:-20}
WARMUP_PROMPTS=${WARMUP_PROMPTS:-20}
IMAGE=${IMAGE:-(1024, 1024, 1)}
QUESTION_LEN=${QUESTION_LEN:-16}
OUTPUT_LEN=${OUTPUT_LEN:-64}
PORT=${PORT:-8800}
TOKENIZER=/tmp/hr-vl-tokenizer

bench_images() {  # NAME WARMUP_PROMPTS PROMPTS ARGS...: a warm-up on seed 7, then the run
  local name=$1 warmup=$2 prompts=$3; shift 3
  local common=(--base-url "http://127.0.0.1:$PORT" --endpoint chat --dataset random-mm
                --random-mm-base-items-per-request 1
                --random-mm-limit-mm-per-prompt '{"image": 1}'
                --random-mm-bucket-config "{$IMAGE: 1.0}"
                --random-input-len "$QUESTION_LEN" --ignore-eos --disable-tqdm)
  timeout 200 python -m services.cli bench serve "${common[@]}" --seed 7 \
    --num-prompts "$warmup" "$@" > "$R/warmup-$name.txt" 2>&1
  timeout 300 python -m services.cli bench serve "${common[@]}" --seed 1 \
    --num-prompts "$prompts" --save-result "$R/$name.json" "$@" > "$R/$name.txt" 2>&1
}

wait_serving() {  # PID: until /health answers 200 (0), the server exits or 300 s pass (1)
  for _ in $(seq 300); do
    kill -0 "$1" 2> /dev/null || return 1
    python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" \
      2> /dev/null && return 0
    sleep 1
  done
  return 1
}

stop_server() {  # PID: SIGTERM, then at most 90 s for the launcher to stop its processes
  kill -TERM "$1" 2> /dev/null
  for _ in $(seq 90); do kill -0 "$1" 2> /dev/null || break; sleep 1; done
  if kill -0 "$1" 2> /dev/null; then
    echo "the server ignored SIGTERM for 90 s: killed" >&2; kill -KILL "$1"
  fi
  wait "$1"
}

check_count() {  # N [ttft]: serve with N tokenizer replicas and run the benchmarks
  local n=$1 ttft=${2:-0}
  port_free "$PORT" || return 1
  rm -rf "/tmp/hr-vl-t$n"  # an earlier run's Redis would replay its streams and images
  # python itself in the background (not a shell function's subshell), so that the
  # SIGTERM reaches the launcher
  python -m services.cli serve "$MODEL" --load-format dummy --tokenizer "$TOKENIZER" \
    --hf-overrides "$(cat "$TOKENIZER/hf_overrides.json")" --tokenizer-replicas "$n" \
    --max-model-len "$MAX_MODEL_LEN" --limit-mm-per-prompt '{"image": 1}' --port "$PORT" \
    --run-dir "/tmp/hr-vl-t$n" --served-model-name vl ${SERVE_FLAGS:-} \
    > "$R/serve-t$n.log" 2>&1 &
  local serve=$!
  if ! wait_serving "$serve"; then
    echo "the server with $n tokenizer replicas did not come up:" >&2
    tail -n 30 "$R/serve-t$n.log" >&2; stop_server "$serve"; return 1
  fi
  if [ "$ttft" = 1 ]; then
    bench_images "ttft-t$n" 5 "$TTFT_PROMPTS" --max-concurrency 1 --random-output-len 16
  fi
  bench_images "images$NUM_PROMPTS-t$n" "$WARMUP_PROMPTS" "$NUM_PROMPTS" \
    --random-output-len "$OUTPUT_LEN"
  stop_server "$serve"
  # the run's Redis kept each image's float32 patches (26 MB at 1024x1024) in memory and
  # in its append-only file: gigabytes of disk per count
  rm -rf "/tmp/hr-vl-t$n"
}

[ $# -ge 1 ] || { echo "usage: $0 TOKENIZER_REPLICAS..." >&2; exit 2; }
lscpu > "$R/host.txt"
# the shape directory's stand-in tokenizer lacks the vision tokens: see vl_tokenizer.py
python benchmarks/gpu/vl_tokenizer.py "$MODEL" "$TOKENIZER" > /dev/null || exit 1
first=${TTFT:-1}
for n in "$@"; do
  check_count "$n" "$first"
  first=0
done
grep -hv '"event"' "$R"/ttft-t*.txt "$R"/images*-t*.txt 2> /dev/null | tail -n 150
