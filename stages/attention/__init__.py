"""Block top-k sparse attention (the rule of DESIGN.md "Definitions") in decode and teacher-forced form."""

from ..core.definitions import DEFAULT_DENSE_LAYERS, PAGE_SIZE, validate_budget
from .block_topk import kept_page_mask, page_centroids
from .sparse import SparseAttention, block_topk_sdpa

__all__ = [
    "DEFAULT_DENSE_LAYERS",
    "PAGE_SIZE",
    "SparseAttention",
    "block_topk_sdpa",
    "kept_page_mask",
    "page_centroids",
    "validate_budget",
]
