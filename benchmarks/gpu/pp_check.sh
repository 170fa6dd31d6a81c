#!/usr/bin/env bash
# The device script for pipeline parallelism, on nvidia-h200-x2 (every output under $R), in
# under 8 minutes: the two-GPU test of stages in CUDA graphs (tests/test_gpu.py -k
# two_stages: greedy tokens against the stages eager and one GPU), then Llama-3.1-8B
# shapes, the nano lengths over 1,024 requests in-process: two stages in CUDA graphs (the
# default), two stages eager, two tensor-parallel ranks, and one GPU (issue 32's goal: two
# stages at 1.7x one GPU or more); EAGER=0 leaves out the eager stages. A run past the budget
# (BUDGET_S seconds, 470 unless set) is cut short; PYTEST=0 leaves out the test. RUNS picks
# the runs (default "pp2 pp2-eager tp2 pp1"; tp2pp2 needs four GPUs: two stages of two
# tensor-parallel ranks; pp1-seqs512 is one GPU seating as many requests as two stages do
# by default, pp2-seqs512 two stages seating twice that, pp2-seqs1024 two stages seating
# every request at once, pp1-seqs1024 and tp2-seqs1024 one GPU and two tensor-parallel
# ranks seating every request at once; pp2-wp and pp1-wp run the in-process engine's executor in its
# worker process (HEADRACE_WORKER_PROCESS=1: where a model on GPUs goes by default);
# pp2-http and pp1-http time `serve`).
#   source .devkit/env.sh && bash benchmarks/gpu/pp_check.sh
set -uo pipefail
source benchmarks/gpu/common.sh
deadline=$((SECONDS + ${BUDGET_S:-470}))
limit() {  # CAP: seconds a run may take, CAP or what is left of the budget
  local left=$((deadline - SECONDS))
  echo $((left < $1 ? (left > 1 ? left : 1) : $1))
}
nano() {  # NAME CAP ARGS...: the nano workload's throughput (in-process, or over NANO_PATH)
  bench "$(limit "$2")" throughput --model $M/llama-3.1-8b-shape --load-format dummy \
    --workload nano --num-prompts 1024 --path "${NANO_PATH:-inprocess}" "${@:3}" \
    --json "$R/throughput-nano1024-$1.json" > "$R/throughput-nano1024-$1.txt" 2>&1
}
[ "${PYTEST:-1}" = 1 ] && timeout "$(limit 150)" python -m pytest -q -p no:cacheprovider \
  tests/test_gpu.py -k two_stages > "$R/pytest-pp.txt" 2>&1
for run in ${RUNS:-pp2 pp2-eager tp2 pp1}; do
  case $run in
    pp2) nano pp2 120 --pipeline-parallel-size 2 ;;
    pp2-eager) [ "${EAGER:-1}" = 1 ] && nano pp2-eager 150 --pipeline-parallel-size 2 --enforce-eager ;;
    tp2) nano tp2 120 --tensor-parallel-size 2 ;;
    tp2-seqs1024) nano tp2-seqs1024 150 --tensor-parallel-size 2 --max-num-seqs 1024 ;;
    tp2pp2) nano tp2pp2 150 --tensor-parallel-size 2 --pipeline-parallel-size 2 ;;
    pp1) nano pp1 200 ;;  # with the worker process the model loads twice (measure_model)
    pp1-seqs512) nano pp1-seqs512 120 --max-num-seqs 512 ;;
    pp1-seqs1024) nano pp1-seqs1024 200 --max-num-seqs 1024 ;;
    pp2-seqs512) nano pp2-seqs512 200 --pipeline-parallel-size 2 --max-num-seqs 512 ;;
    pp2-seqs1024) nano pp2-seqs1024 200 --pipeline-parallel-size 2 --max-num-seqs 1024 ;;
    pp2-wp) HEADRACE_WORKER_PROCESS=1 nano pp2-wp 200 --pipeline-parallel-size 2 ;;
    pp1-wp) HEADRACE_WORKER_PROCESS=1 nano pp1-wp 120 ;;
    pp2-http) NANO_PATH=http nano pp2-http 240 --pipeline-parallel-size 2 ;;
    pp1-http) NANO_PATH=http nano pp1-http 180 ;;
  esac
done
lscpu | grep -E "Model name|^CPU\(s\)" > "$R/host.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv >> "$R/host.txt"
[ -f "$R/pytest-pp.txt" ] && tail -n 3 "$R/pytest-pp.txt"
grep -H "tok/s\|^inprocess\|floor of" "$R"/throughput-*.txt
