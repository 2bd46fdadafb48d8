"""The numbers that DESIGN.md's definitions fix, in one torch-free module every stage, kernel, bench and
CLI module imports (planning and the CLI's start-up never import torch for them).

- Page: PAGE_SIZE consecutive KV positions; RESERVED_PAGES (the first page and the two most recent) are
  always kept by block top-k selection, so a budget is at least RESERVED_PAGES pages.
  `validate_budget` refuses any other budget.
- Layers in DEFAULT_DENSE_LAYERS attend densely in every mode.
- Position bin: DEFAULT_BIN_WIDTH tokens unless a command is given --bin-width; a profile that records no
  width is read at this one where its `bin` column fits it.
- Tail statistic of a position bin: the TAIL_QUANTILE-quantile of alpha over its tokens.
- PRIOR_THRESHOLD: the published critical threshold on the tail, used when no runs calibrate one. It is a
  rule on PRIOR_QUANTILE (the per-bin 5th percentile) alone: at another quantile it says nothing, so no
  command applies it there.
"""

PAGE_SIZE = 16
RESERVED_PAGES = 3
DEFAULT_DENSE_LAYERS = (0, 1)
DEFAULT_BIN_WIDTH = 512
TAIL_QUANTILE = 0.05
PRIOR_THRESHOLD = 0.86
PRIOR_QUANTILE = 0.05


def validate_budget(budget: int, page: int = PAGE_SIZE) -> None:
    """A block top-k budget is a whole number of pages, at least the RESERVED_PAGES always kept. Budget 0
    stands for dense in schedules and artifacts, but is not a budget one asks for."""
    if budget == 0:
        raise ValueError("budget 0 is dense attention, not a block top-k budget")
    if budget % page:
        raise ValueError(f"budget {budget} is not a multiple of the page size {page}")
    if budget < RESERVED_PAGES * page:
        raise ValueError(
            f"budget {budget} is below three pages ({RESERVED_PAGES * page} tokens): the sink page "
            "and the two most recent pages are always kept"
        )
