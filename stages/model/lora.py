"""LoRA for the sparse actor, merged into the linear weights before rollouts (W + (alpha / r) B @ A costs
nothing per token); `unmerge_lora` / `lora_merged` put the original weights back bit for bit, and a layer
peft has wrapped is merged into its `base_layer`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from .config import ModelConfig
from .llama import Transformer, hf_to_ours

_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_]+)?\.weight$")


@dataclass
class LoraWeights:
    modules: dict[str, tuple[Tensor, Tensor]]  # our module name -> (A [r, in], B [out, r])
    alpha: float
    r: int

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    @classmethod
    def from_state_dict(cls, state: dict[str, Tensor], alpha: float, r: int) -> LoraWeights:
        """Keys like `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` (peft), with or
        without the adapter name (`lora_A.default.weight`) or the prefixes."""
        parts: dict[str, dict[str, Tensor]] = {}
        for key, value in state.items():
            m = _KEY.match(key)
            if m is None:
                raise ValueError(f"unexpected key {key!r} in a LoRA state dict")
            name = hf_to_ours(m["module"].removeprefix("base_model.model."))
            parts.setdefault(name, {})[m["ab"]] = value
        modules = {}
        for name, ab in parts.items():
            if set(ab) != {"A", "B"}:
                raise ValueError(f"LoRA module {name!r} lacks lora_{'A' if 'A' not in ab else 'B'}")
            if ab["A"].shape[0] != r or ab["B"].shape[1] != r:
                raise ValueError(f"LoRA module {name!r} does not have rank {r}")
            modules[name] = (ab["A"], ab["B"])
        return cls(modules, float(alpha), int(r))


def check_lora_fits(lora: LoraWeights, cfg: ModelConfig, subject: str) -> None:
    """One sentence if an adapted module is missing from, or shaped unlike, the model `cfg` describes (an
    adapter trained on another base model); shapes come from a weightless (meta-device) model."""
    with torch.device("meta"):
        linears = {n: m for n, m in Transformer(cfg).named_modules() if isinstance(m, nn.Linear)}
    for name, (a, b) in lora.modules.items():
        if name not in linears:
            raise ValueError(f"{subject}: the adapter adapts {name!r}, which this model does not have "
                             "(an adapter for another base model?)")
        want, got = tuple(linears[name].weight.shape), (b.shape[0], a.shape[1])
        if want != got:
            raise ValueError(f"{subject}: the adapter's {name!r} maps {got[1]} -> {got[0]} features, this "
                             f"model's {want[1]} -> {want[0]} (an adapter for another base model?)")


def load_lora(folder: str | Path) -> LoraWeights:
    """A peft adapter directory: adapter_config.json + adapter_model.safetensors."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    return LoraWeights.from_state_dict(load_file(folder / "adapter_model.safetensors"),
                                       cfg["lora_alpha"], cfg["r"])


def merge_lora(model: Transformer, lora: LoraWeights) -> dict[str, Tensor]:
    """W <- W + (alpha / r) * B @ A for every adapted linear layer, in place (the delta is computed in
    fp32). Returns the original weights for `unmerge_lora`."""
    linears = dict(model.named_modules())
    originals = {}
    for name, (a, b) in lora.modules.items():
        layer = linears.get(name)
        layer = getattr(layer, "base_layer", layer)  # peft's wrapper: merge into the wrapped linear
        if not isinstance(layer, nn.Linear):
            raise ValueError(f"LoRA module {name!r} is not a linear layer of the model")
        if name == "lm_head" and model.cfg.tie_word_embeddings:
            raise ValueError("a LoRA on lm_head cannot be merged into tied embeddings")
        w = layer.weight
        if (b.shape[0], a.shape[1]) != tuple(w.shape):
            raise ValueError(f"LoRA module {name!r} has shape {(b.shape[0], a.shape[1])}, the layer "
                             f"{tuple(w.shape)}")
        originals[name] = w.detach().clone()
        delta = lora.scale * (b.to(w.device, torch.float32) @ a.to(w.device, torch.float32))
        with torch.no_grad():
            w.copy_((w.float() + delta).to(w.dtype))
    return originals


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """The base model: every injected peft LoRA switched off inside the block."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)


def unmerge_lora(model: Transformer, originals: dict[str, Tensor]) -> None:
    linears = dict(model.named_modules())
    with torch.no_grad():
        for name, w in originals.items():
            getattr(linears[name], "base_layer", linears[name]).weight.copy_(w)


@contextmanager
def lora_merged(model: Transformer, lora: LoraWeights | None) -> Iterator[Transformer]:
    """The model with the LoRA merged inside the block, its own weights again after it."""
    if lora is None:
        yield model
        return
    originals = merge_lora(model, lora)
    try:
        yield model
    finally:
        unmerge_lora(model, originals)
