#!/usr/bin/env bash
# source .devkit/env.sh && R=$OUT/r bash benchmarks/issue31-h200/pdl8/bisect.sh
set -u
S=benchmarks/issue31-h200/pdl8/pdl_bisect.py
export HEADRACE_PDL=1 HEADRACE_WORKER_PROCESS=0  # the kernels patched here, not in a child
one() { local name=$1; shift; env "$@" python $S > $R/$name.log 2>&1; grep RESULT $R/$name.log || tail -3 $R/$name.log; }
# the model, and the PDL and plain variants of every kernel, compiled first
one all-on OFF=
one all-off ONLY=none &
one eager EAGER=1 &
wait
for m in activation attention_inputs gemv norm triton_attention; do one off-$m OFF=$m & done
wait
for m in activation attention_inputs gemv norm triton_attention; do one only-$m ONLY=$m & done
wait
