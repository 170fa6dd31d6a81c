"""What logprobs cost the served batch-1 chats of issue31_check.sh's itl stages, per server:
the mean of the median ITLs with logprobs=1 less the mean of those without, over the
server's timed runs (`serve-chatc1[logprobs1]-sSEED[SUFFIX].json`, SUFFIX naming the
server). Beside it, the same for the worker's `step` stage (launched to tokens on the
host, its p50), which the ITL follows; then, over every run read, how closely (their
correlation and largest gap) and the p50s of the stages after the worker, without and with
logprobs (each the median over the runs).

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


LATER_STAGES = ("result_to_detokenizer", "detokenizer", "detokenizer_to_client")


def medians(path: Path) -> dict[str, float]:
    """The ITL median and each server stage's p50 of one timed run, in ms."""
    result = json.loads(path.read_text())
    stages = {s["stage"]: s["p50_ms"] for s in result["server_stages"]}
    return {"itl": result["summary"]["itl"]["median_ms"], **stages}


def main(folders: list[str]) -> None:
    every: dict[bool, list[dict[str, float]]] = {False: [], True: []}
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
            every[False] += by_lp[False]
            every[True] += by_lp[True]
            itl, step = ([statistics.fmean(m[k] for m in by_lp[lp]) for lp in (False, True)]
                         for k in ("itl", "step"))
            print(f"{folder} {server or '-'}: ITL {itl[0]:.3f} -> {itl[1]:.3f} ms "
                  f"({itl[1] - itl[0]:+.3f}); step {step[0]:.3f} -> {step[1]:.3f} "
                  f"({step[1] - step[0]:+.3f}); {len(by_lp[False])}+{len(by_lp[True])} runs")
    runs = every[False] + every[True]
    if len(runs) < 2:
        return
    itls, steps = [m["itl"] for m in runs], [m["step"] for m in runs]
    print(f"{len(runs)} runs: ITL against step p50, correlation "
          f"{statistics.correlation(itls, steps):.3f}, at most "
          f"{max(abs(a - b) for a, b in zip(itls, steps)):.3f} ms apart")
    for stage in LATER_STAGES:
        without, with_lp = (statistics.median(m[stage] for m in every[lp]) for lp in (False, True))
        print(f"  {stage} p50: {without:.3f} -> {with_lp:.3f} ms with logprobs")


if __name__ == "__main__":
    main(sys.argv[1:])
