#!/usr/bin/env bash
# source .devkit/env.sh && R=$OUT/r bash benchmarks/issue31-h200/pdl8/gemv_fixed.sh
# PDL on and off with the GEMV choice fixed, then with it timed, twice each
set -u
export HEADRACE_PDL=1 HEADRACE_WORKER_PROCESS=0
S=benchmarks/issue31-h200/pdl8/pdl_bisect.py
one() { local name=$1; shift; env "$@" python $S > $R/$name.log 2>&1; grep RESULT $R/$name.log || tail -3 $R/$name.log; }
one model ONLY=none HEADRACE_GEMV=cublas
for g in gemv cublas; do one on-$g OFF= HEADRACE_GEMV=$g & one off-$g ONLY=none HEADRACE_GEMV=$g & done
wait
for i in 1 2; do one on-timed-$i OFF= & one off-timed-$i ONLY=none & done
wait
