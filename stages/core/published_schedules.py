"""The published Sparrow schedules (arXiv 2606.08446), as data that ships with the package.

A copy of `reference/sparrow_published_schedules.csv` (shared facts, outside the repository), kept
here as a Python module so that an installed Sparrow has it without package-data files; a test checks
that the two agree row by row. Each line of `_TABLE` is: model, threshold, then the total pages of
each 2,000-token bin (20 bins, the last one open-ended). Budget in tokens = pages x 16; the engine's
selected pages = pages - 3 (the sink page and the two most recent pages are always kept).
"""

from __future__ import annotations

from .definitions import PAGE_SIZE

BIN_TOKENS = 2000
NUM_BINS = 20
CONTEXT = 40960  # Qwen3's context; the published runs generate up to 37K tokens in a 40K context
REFERENCE_GEN_LEN = 32768  # the published speedups' 32K cutoff: what reference-profile plans are priced at

_TABLE = """
qwen3-1.7b 0.75 32 32 48 48 64 64 80 80 96 96 96 96 96 96 96 96 96 96 96 96
qwen3-1.7b 0.80 32 48 64 80 96 96 128 128 128 160 160 160 160 160 160 160 160 160 160 160
qwen3-1.7b 0.83 32 64 80 96 128 128 160 160 192 192 192 192 192 192 192 192 192 192 192 192
qwen3-1.7b 0.86 32 64 96 96 128 160 192 224 224 256 256 256 256 256 256 256 256 256 256 256
qwen3-1.7b 0.88 48 80 128 160 160 192 224 256 256 320 320 320 320 320 320 320 320 320 320 320
qwen3-1.7b 0.90 48 96 160 192 224 256 320 320 384 384 384 384 384 384 384 384 384 384 384 384
qwen3-1.7b 0.92 64 128 192 224 256 320 384 384 448 512 512 512 512 512 512 512 512 512 512 512
qwen3-1.7b 0.94 80 160 224 320 384 448 512 512 640 768 768 768 768 768 768 768 768 768 768 768
qwen3-4b 0.75 32 32 32 32 48 64 80 96 128 128 128 128 160 160 160 160 160 160 192 192
qwen3-4b 0.80 32 32 48 64 80 96 128 160 160 160 192 224 224 224 224 224 224 224 224 224
qwen3-4b 0.86 32 48 64 80 96 128 160 224 256 256 320 320 320 320 384 384 384 384 512 512
qwen3-4b 0.88 32 64 96 128 160 192 256 320 384 448 448 512 512 512 640 640 640 640 640 640
qwen3-4b 0.90 48 80 128 160 192 256 320 448 640 768 768 768 768 768 768 896 896 896 896 896
qwen3-4b 0.92 48 96 160 192 256 384 448 768 896 1024 1024 1152 1152 1152 1152 1152 1152 1152 1152 1152
qwen3-8b 0.75 32 32 32 48 48 80 80 80 96 96 96 96 128 128 128 128 128 128 160 160
qwen3-8b 0.80 32 32 48 64 80 96 128 128 160 160 192 192 192 224 224 224 224 256 256 256
qwen3-8b 0.86 32 48 64 80 128 160 192 256 256 256 256 320 320 320 320 320 320 388 448 448
qwen3-8b 0.87 32 64 80 96 160 192 224 320 320 320 320 384 384 384 384 384 448 448 512 512
qwen3-8b 0.92 48 96 128 192 256 448 512 640 768 768 768 896 896 896 896 896 1024 1024 1024 1024
qwen3-14b 0.86 32 48 80 128 256 384 384 384 384 384 384 384 384 384 384 512 640 640 896 896
"""


def _parse(table: str) -> dict[tuple[str, float], tuple[int, ...]]:
    out = {}
    for line in table.strip().splitlines():
        model, threshold, *pages = line.split()
        out[(model, float(threshold))] = tuple(int(p) for p in pages)
    return out


PUBLISHED_PAGES: dict[tuple[str, float], tuple[int, ...]] = _parse(_TABLE)


def published_budgets(model: str, threshold: float) -> tuple[int, ...] | None:
    """Budgets in tokens per bin of a published schedule, or None if none was published."""
    pages = PUBLISHED_PAGES.get((model.lower(), round(float(threshold), 6)))
    return None if pages is None else tuple(p * PAGE_SIZE for p in pages)


def published_models() -> list[str]:
    return sorted({m for m, _ in PUBLISHED_PAGES}, key=lambda m: float(m.split("-")[1].rstrip("b")))


def published_thresholds(model: str) -> list[float]:
    return sorted(t for m, t in PUBLISHED_PAGES if m == model.lower())


# Published results (4 x H200, AIME24 x 8 prompts, 32K cutoff, 0.86 schedule): rollout speedup of the
# sparse schedule over dense, and the dense / sparse generation throughputs in tokens per second.
PUBLISHED_SPEEDUP_THRESHOLD = 0.86
PUBLISHED_SPEEDUPS: dict[str, float] = {"qwen3-1.7b": 2.21, "qwen3-4b": 2.41, "qwen3-8b": 2.06,
                                        "qwen3-14b": 1.49}
PUBLISHED_THROUGHPUT: dict[str, tuple[int, int]] = {"qwen3-1.7b": (2561, 5662), "qwen3-4b": (1369, 3308),
                                                    "qwen3-8b": (1300, 2682), "qwen3-14b": (1544, 2289)}
