"""`CpuRunner`: the runner on a CPU: C++ kernels, packed weights, fused decode layers, cascade attention.

On top of the shared path: glibc's allocator tuned (allocator.py), linears on prepacked weights
(packed_linears.py), the norms and rotary embedding as C++ ops (layers.py), a decode layer as two C++
ops (fused_decode.py), reused gather buffers, and cascade attention over prompt copies taken at prefill
(prefix_store.py, attention.py). The pool is sized for the workload: pages nobody writes cost nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace

import torch
from torch import Tensor

from sparrow.kernels import cpu_attention
from sparrow.kernels.cascade_decode import suffix_pages
from sparrow.kernels.ops import CPU, GatherWorkspace

from ...attention.paged import DecodeAttention, DecodeBatch, KeyTap
from ...core.notes import note
from ...model.bf16_products import bf16_products_are_slow, fp32_products
from ...model.llama import Transformer
from ..block_manager import BlockManager
from ..config import EngineConfig
from ..memory import Workload
from ..runner import ModelRunner, PrefillRow, Segment
from ..sequence import Sequence as Sample
from .allocator import tune_cpu_allocator
from .attention import Cascade, CpuDecodeAttention
from .fused_decode import FusedCpuDecode
from .layers import CpuLayerOps, cpu_layers_available
from .packed_linears import PackedLinears, dot_product, onednn_runs_bf16, packing_available, row_exact_linears
from .prefix_store import PrefixStore, SharedPrefix


class CpuRunner(ModelRunner):
    def __init__(self, model: Transformer, config: EngineConfig):
        super().__init__(model, config)
        tune_cpu_allocator()
        self.cascade = config.cascade is not False
        own = self.ops is CPU  # the torch references: no C++ kernel anywhere in the step
        self.workspace = GatherWorkspace()  # the torch references' K/V gather buffers, reused every step
        self.packed = PackedLinears(model, self.max_batch, own) if packing_available(model, own) else None
        if self.dtype == torch.bfloat16 and not onednn_runs_bf16() and not (self.packed and self.packed.dot):
            note("this CPU has no bf16 products (no AVX512 or AVX-NE-CONVERT), so bfloat16 decode steps run "
                 "through torch's generic kernels (a prefill's products in float32), slower than float32 "
                 "here: --dtype float32 is faster on this machine")
        self.layer_ops = CpuLayerOps(model) if own and cpu_layers_available(model) else None
        self.fused = FusedCpuDecode(model, self.packed) if (
            self.packed is not None and self.packed.dot and self.layer_ops is not None
            and isinstance(model, Transformer)) else None
        self.store: PrefixStore | None = None
        self._copies: dict[int, SharedPrefix] = {}

    @property
    def prefixes(self) -> dict[int, SharedPrefix]:
        """The current run's prompt copies by request id."""
        return self.store.prefixes if self.store is not None else {}

    def _pages_needed(self, workload: Workload) -> int:
        return replace(workload, prefix_copies=self.cascade).pages()

    def _static_attention(self) -> Callable[[DecodeBatch], DecodeAttention]:
        return functools.partial(CpuDecodeAttention, self.cache, dense_layers=self.dense_layers,
                                 scale=self.scale, ops=self.ops, workspace=self.workspace)

    def close(self) -> None:
        self.store = None
        super().close()

    def begin(self, blocks: BlockManager) -> None:
        super().begin(blocks)
        self.store = PrefixStore(blocks, self.cache, self._pack_prefixes()) if self.cascade else None

    def _pack_prefixes(self) -> bool:
        """Prefix copies in the C++ prefix kernel's layouts (bf16 or fp32) on a CPU that runs it."""
        return (cpu_attention.supports(self.cfg.head_dim, self.page_size, self.dtype)
                and cpu_attention.available())

    def on_finish(self, request_id: int) -> None:
        if self.store is not None:
            self.store.release(request_id)

    def refresh_weights(self) -> None:
        """Repack every weight at the next decode step (the packed copies also follow each weight's
        version counter, which an in-place change through `.data` does not move)."""
        if self.packed is not None:
            self.packed.stamps.clear()
        if self.fused is not None:
            self.fused.layers = None

    # ------------------------------------------------------------------ prefill

    def prefill(self, rows: list[PrefillRow]) -> Tensor | None:
        """As the plain path, with each row's products independent of the rows beside it
        (`row_exact_linears`; bf16 without oneDNN's bf16 products: in fp32, `fp32_products`), and each
        fresh prompt's full pages copied for cascade attention where the pool can spare them."""
        self._copies: dict[int, SharedPrefix] = {}  # by row: the prompt copies this prefill fills
        if self.store is not None:
            for i, row in enumerate(rows):
                full = row.prompt_len // self.page_size
                if row.budgets is None and full and not row.window:  # no copy for an evicting request
                    prefix = self.store.take(row.request_id, row.pages[:full], row.samples,
                                             min(row.samples, self.max_batch))
                    if prefix is not None:
                        self._copies[i] = prefix
        if self.packed is not None:
            self.packed.refresh()  # the packed head (`_head`) now, not at the first decode step
        try:
            row_exact = self.packed is not None and not bf16_products_are_slow(self.model)
            with row_exact_linears(self.model) if row_exact else fp32_products(self.model):
                return super().prefill(rows)
        finally:
            self._copies = {}

    def _key_taps(self, forward: list[Segment]) -> list[KeyTap]:
        """The prompt copies whose last position this forward reaches take the row's keys and values."""
        return [functools.partial(_fill_copy, j, self._copies[i]) for j, (i, start, end) in enumerate(forward)
                if i in self._copies and start < self._copies[i].tokens <= end]

    def verify(self, seqs: list[Sample], starts: list[int]) -> Tensor:
        """As the plain path, on the packed weights and C++ layer ops: a verification forward is a few rows
        per sample, a decode step's shape more than a prefill's."""
        if self.packed is not None:
            self.packed.refresh()
        with (self.packed.active() if self.packed is not None else fp32_products(self.model),
              self.layer_ops.active() if self.layer_ops is not None else nullcontext()):
            return super().verify(seqs, starts)

    # ------------------------------------------------------------------ decode

    def _decode_attention(self, batch: DecodeBatch, seqs: list[Sample]) -> DecodeAttention:
        return CpuDecodeAttention(self.cache, batch, self.dense_layers, self.scale, self.ops, self.workspace,
                                  self._cascade(seqs))

    def _decode_logits(self, tokens: list[int], pos: list[int], positions: Tensor,
                       attention: DecodeAttention) -> Tensor:
        if self.fused is not None and self.fused.ready():
            return self._head(self.fused.hidden(tokens, pos, attention))
        with (self.packed.active() if self.packed is not None else nullcontext(),
              self.layer_ops.active() if self.layer_ops is not None else nullcontext()):
            return super()._decode_logits(tokens, pos, positions, attention)

    def _head(self, hidden: Tensor) -> Tensor:
        """The head in our product over its packed copy where it is packed so (rows in blocks of 16), with
        fp32 output: in bf16 the products are exact and summed in fp32, so this is the model's fp32 head
        (`Transformer.logits`) up to summation order, reading the bf16 weight rather than an fp32 copy of
        it (half the bytes a step); the fused and the modular step both end here."""
        packed = self.packed.dot_weight(self.model.lm_head) if self.packed is not None else None
        if packed is None:
            return self.model.logits(hidden)
        return dot_product(hidden, packed, self.model.lm_head.bias, fp32_out=True)

    def _cascade(self, seqs: list[Sample]) -> Cascade | None:
        """Group the decode batch's samples by the shared prompt pages their block tables start with."""
        prefixes = self.prefixes
        if not prefixes:
            return None
        groups: dict[int, list[int]] = {}
        first = [0] * len(seqs)
        for i, s in enumerate(seqs):
            prefix = None if s.policy.evicts else prefixes.get(s.request.request_id)
            if prefix is not None and tuple(s.pages[: len(prefix.pages)]) == prefix.pages:
                groups.setdefault(s.request.request_id, []).append(i)
                first[i] = len(prefix.pages)
        if not groups:
            return None
        dev = self.device
        return Cascade([(torch.tensor(rows, device=dev), prefixes[rid]) for rid, rows in groups.items()],
                       suffix_pages(first, [len(s.pages) for s in seqs], self.cfg.num_kv_heads, dev))


def _fill_copy(row: int, prefix: SharedPrefix, layer: int, keys: Tensor, values: Tensor,
               centroids: Tensor) -> None:
    t = prefix.tokens
    prefix.store(layer, keys[row, :, :t], values[row, :, :t], centroids[list(prefix.pages)])
