"""`EngineConfig`: how an engine is built (batch, KV pool, kernels, decode step), one frozen record."""

from __future__ import annotations

import enum
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from sparrow.kernels.ops import Backend

from ..core.definitions import DEFAULT_DENSE_LAYERS, PAGE_SIZE
from .memory import check_memory_utilization
from .sequence import whole_number


class DecodeStep(enum.Enum):
    """How decode steps run: AUTO picks GRAPHS on CUDA and PLAIN elsewhere. GRAPHS and EAGER run the
    static padded step that samples on the device (captured as CUDA graphs, or eagerly on any device);
    PLAIN samples on the host with each sample's generator."""

    AUTO = "auto"
    GRAPHS = "cuda"
    EAGER = "eager"
    PLAIN = "off"


@dataclass(frozen=True)
class EngineConfig:
    """`num_pages`: the KV pool's pages (None: sized for each run, every sample at full length, on CUDA
    no more than fits in `gpu_memory_utilization` of the device). `max_prefill_tokens`: the most tokens
    one prefill forward takes (longer prompts are chunked). `cascade`: on a CPU, dense decode attention
    reads a prompt's shared pages once per step for all its samples (None: yes). `speculate` = K > 0:
    exact speculative decoding, every request's own policy drafting up to K tokens per cycle and the dense
    model verifying them (speculative.py; no eviction policy). `reuse_draft_pages`: on the static step a
    cycle's later drafts attend to the pages its first draft selected (and the page the drafts move into)
    instead of selecting again; still exact, since the verification keeps the dense law whatever drafted.
    `page_size` is Sparrow's only one, PAGE_SIZE; `dense_layers` are indices of the model's layers."""

    max_batch: int = 16
    num_pages: int | None = None
    page_size: int = PAGE_SIZE
    dense_layers: tuple[int, ...] = DEFAULT_DENSE_LAYERS
    eos_ids: tuple[int, ...] | None = None
    max_prefill_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    kernels: Backend = Backend.AUTO
    decode_step: DecodeStep = DecodeStep.AUTO
    cascade: bool | None = None
    speculate: int = 0
    reuse_draft_pages: bool = True

    def __post_init__(self):
        """Each field of a wrong type or range refused in one sentence naming it (dense layers past the
        model's are refused by `Engine`, which knows the model)."""
        counts = ("max_batch", "max_prefill_tokens") + (("num_pages",) if self.num_pages is not None else ())
        for name in counts:
            object.__setattr__(self, name, whole_number(name, getattr(self, name), 1, "at least 1"))
        page = self.page_size
        if isinstance(page, bool) or not isinstance(page, numbers.Integral) or page != PAGE_SIZE:
            raise ValueError(f"page_size must be {PAGE_SIZE}, Sparrow's page size (budgets, schedules, "
                             f"kernels and artifacts are in pages of {PAGE_SIZE} tokens), got {page!r}")
        object.__setattr__(self, "page_size", PAGE_SIZE)
        if not isinstance(self.decode_step, DecodeStep):
            raise ValueError(f"decode_step must be a DecodeStep, got {self.decode_step!r}")
        if not isinstance(self.kernels, Backend):
            raise ValueError(f"kernels must be a Backend, got {self.kernels!r}")
        check_memory_utilization(self.gpu_memory_utilization, "gpu_memory_utilization")
        if isinstance(self.speculate, bool) or not isinstance(self.speculate, numbers.Integral):
            raise ValueError(f"speculate must be a whole number of draft tokens per cycle, got "
                             f"{self.speculate!r}")
        if self.speculate < 0:
            raise ValueError(f"speculate must be >= 0 (draft tokens per cycle), got {self.speculate}")
        if not isinstance(self.reuse_draft_pages, bool):
            raise ValueError(f"reuse_draft_pages must be True or False, got {self.reuse_draft_pages!r}")
        if self.cascade is not None and not isinstance(self.cascade, bool):
            raise ValueError(f"cascade must be True, False or None (the device's choice), got "
                             f"{self.cascade!r}")
        object.__setattr__(self, "dense_layers", id_tuple("dense_layers", self.dense_layers, "layer indices"))
        if self.eos_ids is not None:
            object.__setattr__(self, "eos_ids", id_tuple("eos_ids", self.eos_ids, "token ids"))

    def for_device(self, device: torch.device) -> EngineConfig:
        """This config with AUTO's decode step resolved for `device`."""
        step = self.decode_step
        if step == DecodeStep.AUTO:
            step = DecodeStep.GRAPHS if device.type == "cuda" else DecodeStep.PLAIN
        if step == DecodeStep.GRAPHS and device.type != "cuda":
            raise ValueError("decode_step GRAPHS needs the model on a CUDA device")
        return replace(self, decode_step=step)


def id_tuple(name: str, values: object, what: str) -> tuple[int, ...]:
    """`values` as a tuple of ints, each a whole number >= 0, else one sentence naming the field."""
    items = None if isinstance(values, (str, bytes)) or not isinstance(values, Iterable) else tuple(values)
    if items is None or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0
                            for v in items):
        raise ValueError(f"{name} must be a sequence of {what}, each a whole number >= 0, got {values!r}")
    return tuple(int(v) for v in items)
