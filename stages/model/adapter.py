"""Training a LoRA through peft on our decoder (injected in place: learner, engine and scoring run the same
modules), saved in peft's format under Hugging Face module names (docs/training.md, adapters)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from .llama import hf_to_ours, ours_to_hf

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."


def add_lora(model: nn.Module, rank: int, alpha: float, dropout: float = 0.0):
    """Inject a LoRA of `rank` into every attention and MLP projection; freeze everything else.
    Returns the peft `LoraConfig`."""
    from peft import LoraConfig, inject_adapter_in_model

    if rank < 1:
        raise ValueError(f"--lora-rank must be at least 1, got {rank}")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(TARGET_MODULES),
                        bias="none", task_type="CAUSAL_LM")
    inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
        if "lora_" in name and p.dtype in (torch.bfloat16, torch.float16):
            p.data = p.data.float()  # as peft's autocast_adapter_dtype: AdamW on a 16-bit LoRA loses updates
    return config


def lora_state(model: nn.Module, adapter: str = "default") -> dict[str, Tensor]:
    """The tensors of one injected adapter (peft's default, or another name) under peft's names for the
    Hugging Face model."""
    out = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            module, _, kind = name.partition(".lora_")  # kind: "A.default.weight"
            ab, owner = kind.split(".")[:2]
            if owner == adapter:
                out[f"{PEFT_PREFIX}{ours_to_hf(module)}.lora_{ab}.weight"] = p.detach().cpu().contiguous()
    return out


def load_lora_state(model: nn.Module, state: dict[str, Tensor], adapter: str = "default") -> None:
    """Copy an adapter saved by `save_adapter` into the injected LoRA parameters of `adapter` (same rank)."""
    params = dict(model.named_parameters())
    for key, value in state.items():
        module, _, kind = key.removeprefix(PEFT_PREFIX).partition(".lora_")
        name = f"{hf_to_ours(module)}.lora_{kind.split('.')[0]}.{adapter}.weight"
        if name not in params:
            raise ValueError(f"the adapter has {key!r}, which this model has no LoRA layer for")
        if params[name].shape != value.shape:
            raise ValueError(f"the adapter's {key!r} has shape {tuple(value.shape)}, the model's LoRA "
                             f"{tuple(params[name].shape)} (another rank or base model?)")
        with torch.no_grad():
            params[name].copy_(value)


def adapter_base(spec: str, random_weights: bool = False) -> str:
    """What an adapter_config.json names as its base model (`base_model_name_or_path`, which peft's
    AutoPeftModelForCausalLM loads): a preset with weights by its converted checkpoint's absolute path (a
    Hugging Face directory), a checkpoint directory by its absolute path. A GGUF file is named by its
    absolute path too, which identifies the base but which peft cannot load; a shapes-only preset, or
    random weights, by the preset's name (no checkpoint holds them)."""
    from .loading import embedded_checkpoint
    from .names import model_name
    from .presets import PRESETS

    preset = PRESETS.get(spec.lower())
    if preset is None:
        return model_name(spec)
    if preset.weights == "embedded" and not random_weights:
        return str(embedded_checkpoint(preset.name).resolve())
    return preset.name


def save_adapter(model: nn.Module, config, folder: str | os.PathLike, base_model: str,
                 adapter: str = "default", beside: Callable[[Path], None] | None = None) -> Path:
    """Write the adapter directory atomically (`replace_dir`: a hidden sibling, then a rename; the old
    directory's access kept, a killed writer's leftovers removed by the next write). What the old folder
    holds beside what an adapter writer writes (`WRITTEN`: a user's notes, a `sparrow report` of it) is
    copied into the new one, so replacing an adapter never deletes it. The weights file is written as the
    others are, so its mode follows the umask (safetensors' save_file makes it 0600, which a group sharing
    the folder could not load); an adapter is small enough to be serialized in memory."""
    from safetensors.torch import save

    from sparrow.schemas import output_target
    from sparrow.schemas.io import replace_dir

    folder = Path(folder)
    target = output_target(folder, directory=True)  # a symlink is written through, not replaced

    def fill(tmp: Path) -> None:
        cfg = config.to_dict()
        cfg["base_model_name_or_path"] = base_model
        cfg["target_modules"] = sorted(cfg["target_modules"])
        (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=2, default=str))
        (tmp / "adapter_model.safetensors").write_bytes(save(lora_state(model, adapter)))
        if beside is not None:  # the files the folder holds beside the adapter, in place with it at once
            beside(tmp)
        _keep_others(target, tmp)

    replace_dir(target, fill)
    return folder


# what an adapter's writers write (peft's files, distill's record and mismatch): replaced, never kept
WRITTEN = frozenset({"adapter_config.json", "adapter_model.safetensors", "adapter_model.bin",
                     "sparrow_distill.json", "mismatch"})


def _keep_others(old: Path, new: Path) -> None:
    """Copy what the old adapter folder holds that is not `WRITTEN` (nor hidden) into the new one."""
    import shutil

    if not old.is_dir():
        return
    for entry in old.iterdir():
        if entry.name in WRITTEN or entry.name.startswith(".") or (new / entry.name).exists():
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / entry.name, symlinks=True)
        else:
            shutil.copy2(entry, new / entry.name, follow_symlinks=False)
