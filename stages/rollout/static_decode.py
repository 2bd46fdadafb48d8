"""`StaticDecode`: the engine's decode step over preallocated buffers, replayed from CUDA graphs.

A CUDA graph replays the same kernels on the same addresses, so every input of a decode step lives in
a buffer sized for the largest batch and the widest block table, and a step of B samples runs the
graph captured for the smallest batch bucket >= B. Rows past B are padding: slot -1 (no KV write)
and seq_len 0 (attention over nothing, output zero). Two more things are fixed at capture and key
the graphs with the bucket: whether the sparse layers select pages, and how many they keep, K (the
batch's largest budget / P, or the whole table when a dense request shares a sparse step). A
schedule has few distinct budgets, so there are few graphs; each is captured on first use, all in
one memory pool. Sampling stays outside the graph: it needs per-sample generators and host-side stop
decisions.

Nothing inside the step may wait on the device: the model gets `kv_len` from here instead of reading
the positions, selection gets `max_selected`, and the ops were written so (kernels/CONTRACT.md).
Warm-up and capture run with every row padded, so they write nothing to the cache; the real inputs
are copied in afterwards and the graph is replayed.

The logits go to one static buffer [max_batch, V] float32 that every graph writes, so the graphs' memory
pool holds one step's intermediates (reused from capture to capture) and no logits per graph; the
runner's profiling run measures that step before it sizes the KV pool (gpu_runner.py).

With `capture=False` the same padded step runs eagerly on any device. That is how the CPU tests hold
this path to the plain decode step and to teacher-forced scoring; only the capture needs CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np
import torch
from torch import Tensor

from ..model.llama import Transformer
from .attention import DecodeAttention, DecodeBatch
from .kv_cache import PagedKVCache


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes with a graph of their own: 1, 2, 4, 8, then every 16, and max_batch."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch, 16)) + [max_batch]


def kept_pages(budgets: Collection[int], page_size: int, max_pages: int) -> int:
    """K of the graph for these budgets: 0 = no selection (all dense), else the selected width."""
    if max(budgets) == 0:
        return 0
    if min(budgets) == 0:
        return max_pages  # a dense request in a sparse step keeps all of its pages
    return min(max(budgets) // page_size, max_pages)


class StaticDecode:
    def __init__(self, model: Transformer, cache: PagedKVCache, *, max_batch: int, max_pages: int,
                 attention: Callable[[DecodeBatch], DecodeAttention], capture: bool = True):
        """`max_pages`: block table width, enough for the longest sequence the engine will decode.
        `attention`: the runner's decode attention for a batch of static buffers (a plain function or
        partial, never a bound method of the runner, which holds this object)."""
        if capture and cache.k.device.type != "cuda":
            raise ValueError("CUDA graphs need the model and cache on a CUDA device")
        dev = cache.k.device
        self.model, self.cache, self.capture = model, cache, capture
        self.max_pages, self.page_size = max_pages, cache.page_size
        self.attention = attention
        self.buckets = batch_buckets(max_batch)
        rows = self.buckets[-1]
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.block_table = torch.full((rows, max_pages), -1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.budgets = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.slots = torch.full((rows,), -1, dtype=torch.int64, device=dev)
        # eviction: the row of the pool's query ring each row writes (the trash row for padding)
        self.trash = cache.queries.shape[1] - 1 if cache.queries is not None else None
        self.query_index = None if self.trash is None else torch.full((rows,), self.trash, dtype=torch.int64,
                                                                      device=dev)
        self.logits = torch.zeros(rows, model.cfg.vocab_size, dtype=torch.float32, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None

    def fits(self, batch: int, width: int) -> bool:
        return batch <= self.buckets[-1] and width <= self.max_pages

    def run(self, tokens: list[int], positions: list[int], block_table: np.ndarray, budgets: list[int],
            slots: list[int], seq_lens: list[int] | None = None, query_index: list[int] | None = None
            ) -> Tensor:
        """One decode step for B samples -> logits [B, V] float32 (a view of a static buffer on CUDA:
        consume it before the next step). block_table [B, width] int32, -1 past each sample's pages;
        `seq_lens`: each row's cached tokens including the new one (default: position + 1; an evicting
        policy's cache is shorter than its position); `query_index`: each row's row of the query ring
        (with a ring)."""
        b = len(tokens)
        n = next(s for s in self.buckets if s >= b)
        k = kept_pages(budgets, self.page_size, self.max_pages)
        graph = self._graph(n, k) if self.capture else None
        self._fill(b, n, tokens, positions, block_table, budgets, slots, seq_lens, query_index)
        if graph is None:
            self._forward(n, k)
        else:
            graph.replay()
        return self.logits[:b]

    def _fill(self, b: int, n: int, tokens, positions, block_table: np.ndarray, budgets, slots,
              seq_lens=None, query_index=None) -> None:
        width = block_table.shape[1]
        pos = torch.as_tensor(positions)
        self.tokens[:b, 0].copy_(torch.as_tensor(tokens))
        self.positions[:b, 0].copy_(pos)
        self.block_table[:b, :width].copy_(torch.from_numpy(block_table))
        self.block_table[:b, width:] = -1
        self.seq_lens[:b].copy_(pos + 1 if seq_lens is None else torch.as_tensor(seq_lens))
        self.budgets[:b].copy_(torch.as_tensor(budgets))
        self.slots[:b].copy_(torch.as_tensor(slots))
        if self.query_index is not None:
            self.query_index[:b].copy_(torch.as_tensor(query_index))
        self._pad(b, n)

    def _pad(self, start: int, end: int) -> None:
        self.tokens[start:end] = 0
        self.positions[start:end] = 0
        self.seq_lens[start:end] = 0
        self.budgets[start:end] = 0
        self.slots[start:end] = -1
        if self.query_index is not None:
            self.query_index[start:end] = self.trash

    def _forward(self, n: int, k: int) -> None:
        """The step of bucket n with K = k into `self.logits[:n]`."""
        queries = None if self.query_index is None else self.query_index[:n]
        attn = self.attention(DecodeBatch(self.block_table[:n], self.seq_lens[:n], self.budgets[:n],
                                          self.slots[:n], any_sparse=k > 0, max_selected=k or None,
                                          query_index=queries))
        hidden = self.model.hidden_states(self.tokens[:n], positions=self.positions[:n], attention=attn,
                                          kv_len=self.max_pages * self.page_size)
        self.logits[:n].copy_(self.model.logits(hidden[:, 0]))

    def _graph(self, n: int, k: int) -> torch.cuda.CUDAGraph:
        key = (n, k)
        if key not in self.graphs:
            self._pad(0, n)  # warm-up and capture see only padding rows: they write nothing
            side = torch.cuda.Stream(self.cache.k.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(n, k)  # Triton compiles and cuBLAS sets up outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._forward(n, k)
            self.pool = graph.pool()
            self.graphs[key] = graph
        return self.graphs[key]

    def drop_graphs(self) -> None:
        """Forget the captured graphs (the weights they read were replaced); the next steps capture anew."""
        self.graphs.clear()
        self.pool = None
