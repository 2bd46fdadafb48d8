"""KV policies: what a decode step may attend to, one class per method (DESIGN.md "KV policies").

The engine (stages/engine), its runners and attention objects, and teacher-forced scoring
(stages/scoring/mismatch.py) ask a request's `KVPolicy` instead of branching on budgets:

- `Dense`: every cached token, nothing evicted.
- `BlockTopK` (Sparrow): keeps every token; a decode step reads the pages block top-k selects at the
  budget `read_budget(cache length)` of its schedule (DESIGN.md "Definitions").
- eviction (`SnapKV`, `RKV`, stages/kv_policies/eviction.py): keeps at most budget + buffer tokens per
  sample; the decode step attends densely to what is retained, and the cache is compressed back to
  `budget` tokens whenever it reaches budget + buffer.

A policy is a deterministic function of the prefix (the tokens and the model), so teacher-forced
scoring replays it exactly. This module is torch-free (the CLI's start-up parses specs with it); the
scoring rules that need torch are imported where they run.
"""

from .base import BlockTopK, BudgetFn, Dense, KVPolicy
from .eviction import EVICTION_POLICIES, RKV, Eviction, SnapKV, parse_eviction

__all__ = ["EVICTION_POLICIES", "RKV", "BlockTopK", "BudgetFn", "Dense", "Eviction", "KVPolicy", "SnapKV",
           "parse_eviction"]
