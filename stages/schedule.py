"""Sparsity schedules: the budget as a non-decreasing, piecewise-constant function of position.

`Schedule.budget_at(cache_len)` is the one place where a position becomes a budget; the generator,
the teacher-forced scorer and the rollout engine all call it with the cache length at which the
token is produced (so the decode step whose query sits at position t uses `budget_at(t + 1)`).
Budget 0 means dense.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Schedule:
    bin_starts: tuple[int, ...]  # first position of each bin, increasing, starting at 0
    budgets: tuple[int, ...]  # budget per bin (0 = dense)
    page_size: int = 16

    def budget_at(self, cache_len: int) -> int:
        i = int(np.searchsorted(self.bin_starts, cache_len, side="right")) - 1
        return self.budgets[max(i, 0)]

    def budgets_at(self, cache_lens: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(np.asarray(self.bin_starts), cache_lens, side="right") - 1
        return np.asarray(self.budgets)[np.clip(idx, 0, None)]

    @classmethod
    def constant(cls, budget: int, page_size: int = 16) -> Schedule:
        return cls((0,), (budget,), page_size)

    @classmethod
    def from_artifact(cls, path: str | Path) -> Schedule:
        from sparrow.schemas import artifact_metadata, read_artifact

        table = read_artifact(path, "schedule").sort_by("bin")
        meta = artifact_metadata(table)
        budgets = [0 if b is None else int(b) for b in table.column("budget").to_pylist()]
        starts = [int(s) for s in table.column("bin_start").to_pylist()]
        return cls(tuple(starts), tuple(budgets), int(meta.get("page_size", 16)))
