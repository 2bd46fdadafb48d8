"""`GpuRunner`: the runner on a CUDA device: Triton kernels, CUDA graphs, a pool sized from device memory.

Decode steps run in the model's inference form (layers.py) and are replayed from CUDA graphs
(static_decode.py); selection is bounded on the host (`kept_pages`) so that no step waits on the device.
The pool is sized after a profiling run of the largest forwards (docs/engine.md, "Pool sizing"). Under
TRITON_INTERPRET=1 the same runner runs the Triton kernels on CPU tensors, with the pool sized from the
workload.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...attention.kv_cache import PagedKVCache
from ...attention.paged import DecodeAttention
from ...model.llama import Transformer
from ..block_manager import BlockManager
from ..config import DecodeStep, EngineConfig
from ..memory import Workload, pages_for, pool_pages
from ..runner import ModelRunner
from ..static_decode import kept_pages, release_device_memory
from .layers import GpuDecode, decode_hidden


class GpuRunner(ModelRunner):
    def __init__(self, model: Transformer, config: EngineConfig, fused_decode: bool = True):
        """`fused_decode`: decode steps in the inference form (layers.py); False: the model's modular
        forward (what the tests and benches compare it with)."""
        if config.cascade:
            raise ValueError("cascade attention runs on the torch path (the CPU), not the Triton kernels")
        super().__init__(model, config)
        self.utilization = config.gpu_memory_utilization
        self.capped = False  # the pool is as large as memory allows, not as the workload needs
        self.memory: dict[str, int] = {}  # the last sizing's numbers, in bytes (and pages)
        self.decode_form = GpuDecode(model, self.ops) if fused_decode and isinstance(model, Transformer) \
            else None
        # bf16 weights: bf16 page centroids, half the bytes selection reads (each page's mean rounded once)
        self.centroid_dtype = torch.bfloat16 if self.dtype == torch.bfloat16 else torch.float32
        self._weights = self._weight_stamp()

    def _static_hidden(self) -> Callable | None:
        return functools.partial(decode_hidden, self.decode_form, self.model)

    def _decode_logits(self, tokens: list[int], pos: list[int], positions: Tensor,
                       attention: DecodeAttention) -> Tensor:
        tokens_t = torch.tensor(tokens, device=self.device)[:, None]
        hidden = decode_hidden(self.decode_form, self.model, tokens_t, positions[:, None], attention, None)
        return self._head(hidden)

    def _max_selected(self, budgets: Sequence[int], width: int) -> int | None:
        return kept_pages(budgets, self.page_size, width)

    def _too_small(self, workload: Workload) -> bool:
        # a pool that memory capped stays: re-profiling would find the same room
        keep = self.capped and workload.one_sample() <= self.cache.num_pages
        return super()._too_small(workload) and not keep

    def _pool_size(self, workload: Workload) -> int:
        dev, cfg = self.device, self.cfg
        if dev.type != "cuda":  # the Triton kernels on CPU tensors (tests): no device memory to fill
            return super()._pool_size(workload)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        longest = workload.longest()
        scratch = PagedKVCache(cfg, pages_for(min(self.max_prefill_tokens, longest), self.page_size) + 1,
                               self.page_size, self.dtype, dev)
        prefill, decode = self._peaks(longest, scratch)
        del scratch
        torch.cuda.empty_cache()
        # the static step's log-probs buffer and the temperature-scaled logits its sampling makes, over
        # every fed token of a speculative cycle's scoring step (K + 1 rows a sample), whose activations
        # grow with its rows as the decode step's do
        rows = self.config.speculate + 1
        decode *= rows
        static = 2 * self.max_batch * rows * cfg.vocab_size * 4 if self.decode_step != DecodeStep.PLAIN else 0
        static += PagedKVCache.query_ring_bytes(cfg, self.max_batch, workload.window, self.dtype)  # eviction
        activations = prefill + decode + static
        free, total = torch.cuda.mem_get_info(dev)
        page_bytes = PagedKVCache.bytes_per_page(cfg, self.page_size, self.dtype, self.centroid_dtype)
        pages = pool_pages(free, total, activations, page_bytes, workload, self.utilization)
        self.capped = pages < workload.pages()
        self.memory = {"total": total, "in_use": total - free, "prefill_peak": prefill, "decode_peak": decode,
                       "static": static, "page_bytes": page_bytes, "pages": pages}
        return pages

    def _peaks(self, longest: int, scratch: PagedKVCache) -> tuple[int, int]:
        """Bytes above the scratch pool at the peak of the largest prefill chunk and of the decode step."""
        dev = self.device
        base = torch.cuda.memory_allocated(dev)
        peaks = []
        with torch.inference_mode():
            for part in ("prefill", "decode"):
                torch.cuda.reset_peak_memory_stats(dev)
                self.profile_forwards(longest, scratch, part)
                torch.cuda.synchronize(dev)
                peaks.append(max(torch.cuda.max_memory_allocated(dev) - base, 0))
        return peaks[0], peaks[1]

    def begin(self, blocks: BlockManager) -> None:
        self.refresh_weights()
        super().begin(blocks)

    def refresh_weights(self) -> None:
        """CUDA graphs read the weights at their addresses and bake in the Python-level choices of the
        forward: weights updated in place need nothing, but replaced ones (a new tensor) or another set
        of active peft adapters make the graphs stale, so they are captured again (checked at the start
        of every run, and when the engine is told of an update). Projections whose parameters were
        replaced are stacked again first (layers.py)."""
        if self.decode_form is not None:
            self.decode_form.refresh()
        stamp = self._weight_stamp()
        if stamp != self._weights and self.static is not None:
            self.static.drop_graphs()
        self._weights = stamp

    def _weight_stamp(self) -> tuple:
        adapters = tuple((tuple(m.active_adapters), bool(m.disable_adapters)) for m in self.model.modules()
                         if hasattr(m, "active_adapters") and hasattr(m, "disable_adapters"))
        return tuple(p.data_ptr() for p in self.model.parameters()), adapters

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        super().close()
        if self.device.type == "cuda":
            release_device_memory()

