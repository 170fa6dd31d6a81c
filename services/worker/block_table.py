"""Every request's KV block ids in one array kept across steps, a row a request.

A step's block table was built anew from each request's list of ids. At 256 rows of the
nano workload's lengths (5 to 70 blocks each) that took 225 us on the 2-CPU box (a
throwaway timing), and it was 5% of the served worker's samples at four replicas of the
detokenizer-bound workload on an H200 host (benchmarks/issue31-h200, eleventh session).
Here a request's row is written when it arrives and grows by the ids its steps add, and a
step's table is one gather of its requests' rows (22 us in the same timing), as vLLM's
input batch keeps its block table.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

INITIAL_ROWS = 64
INITIAL_WIDTH = 16


class BlockTable:
    def __init__(self, rows: int = INITIAL_ROWS, width: int = INITIAL_WIDTH) -> None:
        self.ids = np.zeros((rows, width), dtype=np.int32)
        self.lengths = np.zeros(rows, dtype=np.int64)
        self._free = list(range(rows - 1, -1, -1))  # popped from the end: lowest first

    def add(self, block_ids: Sequence[int]) -> int:
        """A row for a new request's blocks; returns it."""
        if not self._free:
            self._grow(rows=2 * len(self.lengths))
        row = self._free.pop()
        self.extend(row, block_ids)
        return row

    def extend(self, row: int, block_ids: Sequence[int]) -> None:
        start = int(self.lengths[row])
        end = start + len(block_ids)
        if end > self.ids.shape[1]:
            self._grow(width=max(end, 2 * self.ids.shape[1]))
        self.ids[row, start:end] = block_ids
        self.lengths[row] = end

    def release(self, row: int) -> None:
        """The request ended: its row is zeroed, since a step's table is zero-padded past
        each request's blocks, and goes to the next request."""
        self.ids[row, :self.lengths[row]] = 0
        self.lengths[row] = 0
        self._free.append(row)

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """int32 [len(rows), the most blocks of one]: these rows' ids, zero-padded."""
        return self.ids[rows, :int(self.lengths[rows].max())]

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        old_rows, old_width = self.ids.shape
        ids = np.zeros((rows or old_rows, width or old_width), dtype=np.int32)
        ids[:old_rows, :old_width] = self.ids
        self.ids = ids
        if rows is not None:
            self.lengths = np.concatenate([self.lengths, np.zeros(rows - old_rows, np.int64)])
            self._free += range(rows - 1, old_rows - 1, -1)
