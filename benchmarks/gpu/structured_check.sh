#!/usr/bin/env bash
# The device script for structured output and tools (issue 15), every output under $OUT/r:
#   source .devkit/env.sh && bash benchmarks/gpu/structured_check.sh
# `headrace bench validation` on the device's CPU, then `headrace serve` of Qwen2.5-1.5B
# shapes (dummy weights, its real tokenizer and chat template) with the hermes tool
# parser, and benchmarks/gpu/structured_check.py's requests all at once over HTTP.
set -uo pipefail
source benchmarks/gpu/common.sh
bench 120 validation --json "$R/validation.json" | tee "$R/validation.txt"
port_free 8800 || exit 1
python -m services.cli serve $M/qwen2.5-1.5b-shape --load-format dummy --port 8800 \
  --served-model-name m --enable-auto-tool-choice --tool-call-parser hermes \
  --run-dir /tmp/hr-structured > "$R/serve.log" 2>&1 &
serve=$!
wait_healthy 8800
timeout 300 python benchmarks/gpu/structured_check.py --base-url http://127.0.0.1:8800 \
  --json "$R/structured.json" | tee "$R/structured.txt"
status=${PIPESTATUS[0]}
kill -TERM $serve; wait $serve
tail -n 5 "$R/serve.log"
exit $status
