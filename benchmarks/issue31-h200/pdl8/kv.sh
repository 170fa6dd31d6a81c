#!/usr/bin/env bash
# source .devkit/env.sh && R=$OUT/r bash benchmarks/issue31-h200/pdl8/kv.sh
# The model (pdl_bisect.py, all plain), then pdl_kv.py after one token and after two
export HEADRACE_WORKER_PROCESS=0
D=benchmarks/issue31-h200/pdl8
ONLY=none python $D/pdl_bisect.py > $R/model.log 2>&1; grep RESULT $R/model.log
STEPS=1 python $D/pdl_kv.py > $R/kv1.log 2>&1 &
STEPS=2 python $D/pdl_kv.py > $R/kv2.log 2>&1 &
wait
grep -v Warn $R/kv1.log | tail -12; grep -v Warn $R/kv2.log | tail -12
