#!/usr/bin/env bash
# The serving path on the GPU: one short chat at a time through `headrace serve` over HTTP
# (TTFT and the gaps between tokens), then the first 64 nano prompts in-process and through
# the pipeline in one command. Every output under $OUT/r:
#   source .devkit/env.sh && bash benchmarks/gpu/serving_check.sh
set -uo pipefail
M=.devkit/models
R="$OUT/r"
mkdir -p "$R"
export HEADRACE_SHAPES=$M
hr() { python -m services.cli "$@"; }
hr serve $M/qwen3-0.6b-shape --load-format dummy --detokenizer-replicas 2 --port 8800 \
  --run-dir /tmp/hr-serve --served-model-name qwen3 > "$R/serve.log" 2>&1 &
serve=$!
python - <<'PY'
import time, urllib.request
for _ in range(240):
    try:
        if urllib.request.urlopen("http://127.0.0.1:8800/health", timeout=1).status == 200:
            break
    except OSError:
        pass
    time.sleep(1)
PY
# warm-up on other prompts (another seed) of the same lengths
timeout 120 python -m services.cli bench serve --base-url http://127.0.0.1:8800 --endpoint chat \
  --num-prompts 16 --max-concurrency 1 --dataset random --random-input-len 32 \
  --random-output-len 64 --ignore-eos --seed 7 --disable-tqdm > "$R/warmup.txt" 2>&1
timeout 200 python -m services.cli bench serve --base-url http://127.0.0.1:8800 --endpoint chat \
  --num-prompts 64 --max-concurrency 1 --dataset random --random-input-len 32 \
  --random-output-len 64 --ignore-eos --seed 1 --disable-tqdm \
  --save-result "$R/serve-chat-c1.json" > "$R/serve-chat-c1.txt" 2>&1
kill -TERM $serve; wait $serve
timeout 240 python -m services.cli bench throughput --model $M/qwen3-0.6b-shape --load-format dummy \
  --workload nano --num-prompts 64 --path both --detokenizer-replicas 2 \
  > "$R/throughput-nano-64.txt" 2>&1
grep -hv '"event"' "$R/serve-chat-c1.txt" "$R/throughput-nano-64.txt" | tail -n 40
