"""What logprobs cost the served batch-1 chats of issue31_check.sh's itl stages, per server:
the mean of the median ITLs with logprobs=1 less the mean of those without, over the
server's timed runs (`serve-chatc1[logprobs1]-sSEED[SUFFIX].json`, SUFFIX naming the
server). Beside it, the same for the worker's `step` stage (launched to tokens on the
host, its p50), which the ITL follows.

    python benchmarks/gpu/itl_cost.py RESULTS_DIR...
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

RUN = re.compile(r"serve-chatc1(logprobs1)?-s(\d+)(.*)\.json")


def medians(path: Path) -> tuple[float, float]:
    """(ITL median, step stage p50) of one timed run, in ms."""
    result = json.loads(path.read_text())
    step = next(s["p50_ms"] for s in result["server_stages"] if s["stage"] == "step")
    return result["summary"]["itl"]["median_ms"], step


def main(folders: list[str]) -> None:
    for folder in folders:
        runs: dict[str, dict[bool, list[tuple[float, float]]]] = defaultdict(
            lambda: {False: [], True: []})
        for path in sorted(Path(folder).glob("serve-chatc1*-s*.json")):
            match = RUN.fullmatch(path.name)
            if match:
                runs[match.group(3)][bool(match.group(1))].append(medians(path))
        for server, by_lp in sorted(runs.items()):
            if not (by_lp[False] and by_lp[True]):
                continue
            itl, step = ([statistics.fmean(m[k] for m in by_lp[lp]) for lp in (False, True)]
                         for k in (0, 1))
            print(f"{folder} {server or '-'}: ITL {itl[0]:.3f} -> {itl[1]:.3f} ms "
                  f"({itl[1] - itl[0]:+.3f}); step {step[0]:.3f} -> {step[1]:.3f} "
                  f"({step[1] - step[0]:+.3f}); {len(by_lp[False])}+{len(by_lp[True])} runs")


if __name__ == "__main__":
    main(sys.argv[1:])
