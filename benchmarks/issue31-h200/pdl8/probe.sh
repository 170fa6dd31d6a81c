#!/usr/bin/env bash
# source .devkit/env.sh && R=$OUT/r bash benchmarks/issue31-h200/pdl8/probe.sh
set -u
export HEADRACE_PDL=1 HEADRACE_WORKER_PROCESS=0 ONLY=activation
P=benchmarks/issue31-h200/pdl8/pdl_probe.py
one() { local name=$1; shift; env "$@" python $P > $R/$name.log 2>&1; grep -A9 RESULT $R/$name.log || tail -3 $R/$name.log; }
for m in ${MODES:-dump sync_load sync_prepare sync_replay none}; do one $m MODE=$m & done
wait
