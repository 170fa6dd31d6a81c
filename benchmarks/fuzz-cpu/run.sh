#!/usr/bin/env bash
# The long fuzz run: tests/test_fuzz.py with many more hypothesis bodies per endpoint than
# make test-long's 500 (make test's 100), against a real `headrace serve` of the demo model;
# the statuses per endpoint go to benchmarks/fuzz-cpu/table.md.
# Usage: bash benchmarks/fuzz-cpu/run.sh [EXAMPLES]
set -euo pipefail
cd "$(dirname "$0")/../.."
examples="${1:-2500}"
HEADRACE_FUZZ_EXAMPLES="$examples" HEADRACE_FUZZ_TABLE=benchmarks/fuzz-cpu/table.md \
  .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_fuzz.py -k "not quick"
