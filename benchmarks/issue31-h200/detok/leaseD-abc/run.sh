#!/usr/bin/env bash
# one-off: the detokenizer-bound workload at 4 replicas through three trees (.base, this
# tree without its early plans, this tree), two rounds in rotated order; then the 0.6B
# batch-1 step with logprobs=1 in process, .base and this tree alternating
set -uo pipefail
source benchmarks/gpu/common.sh
rm -rf /tmp/noearly && mkdir /tmp/noearly && cp -r services common kernels /tmp/noearly/
sed -i 's/^EARLY_PLAN_ROWS = 64$/EARLY_PLAN_ROWS = 10**9/' /tmp/noearly/services/scheduler/shell.py
grep -n "^EARLY_PLAN_ROWS" /tmp/noearly/services/scheduler/shell.py | tee "$R/noearly.txt"
lscpu > "$R/host.txt"
base=$R
for order in "base noearly new" "new noearly base"; do
  round=$((${round:-0} + 1))
  for tree in $order; do
    dir=$PWD; [ $tree = base ] && dir=$PWD/.base; [ $tree = noearly ] && dir=/tmp/noearly
    echo "== $tree round $round"
    R=$base/$tree-$round SERVE_TREE=$dir WORKLOADS=detok REPLICAS=4 DEADLINE_S=100000 \
      timeout 100 bash benchmarks/gpu/stage_scaling.sh 2>&1 | grep -E "^\| [0-9]"
  done
done
R=$base
for round in 1 2; do
  for tree in base new; do
    bench_in $tree 60 latency --model "$(realpath $M/qwen3-0.6b-shape)" --load-format dummy \
      --context-len 62 --batch-size 1 --output-len 64 --iterations 3 --max-model-len 2048 \
      --logprobs 1 --json "$R/latency-b1-lp1-$tree-$round.json" 2>&1 | grep "NVIDIA"
  done
done
