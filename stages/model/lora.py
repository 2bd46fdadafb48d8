"""LoRA for the sparse actor, merged into the linear weights before rollouts (W + scale B @ A costs
nothing per token); `unmerge_lora` / `lora_merged` put the original weights back bit for bit, and a layer
peft has wrapped is merged into its `base_layer`.

A peft adapter is read with peft's per-module rank and scale (`LoraScaling`): alpha / r, or alpha / sqrt(r)
with `use_rslora`, where `rank_pattern` and `alpha_pattern` may set r and alpha per module by peft's own
matching rule. Every other adapter_config.json setting that makes peft compute something other than
W + scale B @ A from the saved matrices (DoRA, biases, modules_to_save, a base model changed by its
initialisation, LoRA variants, ...) is refused in one sentence (`check_adapter_config`) rather than merged
wrongly. Settings that only choose which layers were adapted (target_modules, exclude_modules,
layers_to_transform, layers_pattern) need nothing: the saved matrices name the layers."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from .config import ModelConfig
from .llama import Transformer, hf_to_ours

_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_]+)?\.weight$")


# peft's initialisations that change the base model's weights (the adapter is trained against the residual);
# peft saves such an adapter as a plain one only when asked to (path_initial_model_for_weight_conversion).
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
# peft's LoRA variants (tagged `is_lora_variant` in its LoraConfig) and QA-LoRA: not W + scale B @ A, or
# not from the saved A and B alone.
_VARIANTS = {"alora_invocation_tokens": "aLoRA", "arrow_config": "Arrow", "kasa_config": "KaSA",
             "monteclora_config": "MonteCLoRA", "use_bdlora": "BD-LoRA", "velora_config": "VeLoRA",
             "use_qalora": "QA-LoRA"}


def pattern_key(patterns: Mapping[str, object], module: str) -> str:
    """peft's `get_pattern_key`: the first key of `patterns` that is a regex matching `module` (a Hugging Face
    module name such as model.layers.0.self_attn.q_proj) whole or after a dot; else `module` itself."""
    for key in patterns:
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return key
        except re.error as e:
            raise ValueError(f"adapter_config.json's pattern key {key!r} is not a regular expression ({e})") \
                from None
    return module


@dataclass(frozen=True)
class LoraScaling:
    """peft's rank and alpha of each adapted module (adapter_config.json's r, lora_alpha, rank_pattern,
    alpha_pattern) and its scale: alpha / r, or alpha / sqrt(r) with use_rslora."""

    r: int
    alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: Mapping) -> LoraScaling:
        return cls(int(cfg["r"]), float(cfg["lora_alpha"]), bool(cfg.get("use_rslora")),
                   dict(cfg.get("rank_pattern") or {}), dict(cfg.get("alpha_pattern") or {}))

    def rank(self, module: str) -> int:
        return int(self.rank_pattern.get(pattern_key(self.rank_pattern, module), self.r))

    def scale(self, module: str) -> float:
        r = self.rank(module)
        alpha = float(self.alpha_pattern.get(pattern_key(self.alpha_pattern, module), self.alpha))
        return alpha / (math.sqrt(r) if self.use_rslora else r)


@dataclass
class LoraWeights:
    modules: dict[str, tuple[Tensor, Tensor]]  # our module name -> (A [r, in], B [out, r])
    alpha: float
    r: int
    # our module name -> its scale where it is not alpha / r (use_rslora, alpha_pattern, rank_pattern)
    scales: dict[str, float] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        """The scale of a module without its own (alpha / r)."""
        return self.alpha / self.r

    def scale_of(self, name: str) -> float:
        return self.scales.get(name, self.scale)

    @classmethod
    def from_state_dict(cls, state: dict[str, Tensor], alpha: float, r: int,
                        scaling: LoraScaling | None = None) -> LoraWeights:
        """Keys like `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` (peft), with or
        without the adapter name (`lora_A.default.weight`) or the prefixes; `scaling`: peft's per-module
        rank and scale (None: rank r and alpha / r everywhere)."""
        scaling = scaling or LoraScaling(int(r), float(alpha))
        parts: dict[str, dict[str, Tensor]] = {}
        hf_names: dict[str, str] = {}
        for key, value in state.items():
            m = _KEY.match(key)
            if m is None:
                raise ValueError(unexpected_key(key))
            hf_name = m["module"].removeprefix("base_model.model.")
            name = hf_to_ours(hf_name)
            hf_names[name] = hf_name
            parts.setdefault(name, {})[m["ab"]] = value
        modules, scales = {}, {}
        for name, ab in parts.items():
            if set(ab) != {"A", "B"}:
                raise ValueError(f"LoRA module {name!r} lacks lora_{'A' if 'A' not in ab else 'B'}")
            rank = scaling.rank(hf_names[name])
            if ab["A"].shape[0] != rank or ab["B"].shape[1] != rank:
                raise ValueError(f"LoRA module {name!r} does not have rank {rank}")
            modules[name] = (ab["A"], ab["B"])
            if (scale := scaling.scale(hf_names[name])) != alpha / r:
                scales[name] = scale
        return cls(modules, float(alpha), int(r), scales)


def unexpected_key(key: str) -> str:
    """Why a key of adapter_model.safetensors is not a LoRA matrix, in one sentence."""
    if "lora_magnitude_vector" in key:
        return "DoRA adapters are not supported (adapter_model.safetensors holds lora_magnitude_vector)"
    if "lora_" not in key:
        module = key.removeprefix("base_model.model.").rsplit(".", 1)[0]
        if key.endswith(".bias"):
            return f"an adapter that trains the layers' biases ({module}) is not supported"
        return (f"an adapter with modules_to_save ({module}) is not supported (adapter_model.safetensors "
                "holds whole weights beside the LoRA matrices)")
    return f"unexpected key {key!r} in a LoRA state dict (only lora_A and lora_B matrices are supported)"


def check_adapter_config(cfg: Mapping) -> None:
    """One sentence if a peft adapter_config.json asks for something Sparrow does not merge as peft does."""
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"a {peft_type} adapter is not supported (adapter_config.json's peft_type); only "
                         "LoRA is")
    merged = "; peft's merge_and_unload merges it into a checkpoint that --model takes"
    if cfg.get("use_dora"):
        raise ValueError(f"DoRA adapters are not supported (adapter_config.json sets use_dora){merged}")
    if saved := cfg.get("modules_to_save"):
        names = ", ".join(saved) if isinstance(saved, list) else str(saved)
        raise ValueError(f"an adapter with modules_to_save ({names}) is not supported{merged}")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"an adapter that trains the layers' biases (adapter_config.json's bias "
                         f"{cfg['bias']!r}) is not supported{merged}")
    for key, what in (("lora_bias", "a bias on lora_B"), ("fan_in_fan_out", "transposed weights"),
                      ("trainable_token_indices", "trained embedding rows"),
                      ("layer_replication", "repeated layers"), ("target_parameters", "LoRA on parameters")):
        if cfg.get(key):
            raise ValueError(f"an adapter with {key} ({what}) is not supported{merged}")
    for key, name in _VARIANTS.items():
        if cfg.get(key):
            raise ValueError(f"{name} adapters are not supported (adapter_config.json sets {key}){merged}")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise ValueError(f"an adapter initialised with {init} is not supported: it was trained against base "
                         "weights that initialisation changed (save it with peft's "
                         "path_initial_model_for_weight_conversion to get a plain LoRA)")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(cfg.get(key) or {}, dict):
            raise ValueError(f"adapter_config.json's {key} must be an object of module patterns, got "
                             f"{cfg[key]!r}")


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
    """A peft adapter directory: adapter_config.json + adapter_model.safetensors, its config checked
    (`check_adapter_config`) before the weights are read."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    check_adapter_config(cfg)
    return LoraWeights.from_state_dict(load_file(folder / "adapter_model.safetensors"),
                                       cfg["lora_alpha"], cfg["r"], LoraScaling.from_config(cfg))


def merge_lora(model: Transformer, lora: LoraWeights) -> dict[str, Tensor]:
    """W <- W + scale * B @ A for every adapted linear layer, in place (the delta is computed in
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
        delta = lora.scale_of(name) * (b.to(w.device, torch.float32) @ a.to(w.device, torch.float32))
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
