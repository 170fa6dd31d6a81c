"""The functions with the most samples in a py-spy raw (collapsed) profile: self and total
share of all samples, top 30 of each. Usage: python top_frames.py profile.raw"""

from __future__ import annotations

import sys
from collections import Counter


def main(path: str) -> None:
    own, within, total = Counter(), Counter(), 0
    for line in open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        frames, n = stack.split(";"), int(count)
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            within[frame] += n
    print(f"{path}: {total} samples")
    for title, counter in (("self", own), ("total", within)):
        print(f"--- {title} ---")
        for frame, n in counter.most_common(30):
            print(f"{100 * n / total:5.1f}%  {frame}")


if __name__ == "__main__":
    main(sys.argv[1])
