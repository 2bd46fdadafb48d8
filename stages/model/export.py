"""A trained model written as a Hugging Face checkpoint directory: config.json in transformers' layout for
its architecture, model.safetensors under Hugging Face parameter names and the tokenizer files, so that
`--model DIR`, `transformers.AutoModelForCausalLM.from_pretrained(DIR)` and vLLM load it.

Design decisions:
- The directory is written whole beside its place, then put in place (`replace_dir`): a reader sees the
  previous export or the new one, never half of one.
- config.json is `ModelConfig.to_hf()` with `torch_dtype` the weights' own dtype (bfloat16 after a CUDA run).
- Tied embeddings are written once (`model.embed_tokens.weight`), as transformers saves them.
- The directory also holds `sparrow_train.json` (what wrote it), which tells a run's export from a user's
  folder of the same name; transformers and vLLM ignore it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from sparrow.schemas.io import replace_dir

from .llama import Transformer, ours_to_hf
from .loading import save_weights

MARKER = "sparrow_train.json"


def hf_state(model: Transformer) -> dict[str, Tensor]:
    """The model's weights under Hugging Face names, each a host tensor of its own storage (safetensors
    refuses views of a shared storage); the tied output head is left out."""
    state = {}
    for name, t in model.state_dict().items():
        if name.startswith("rope_") or (model.cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue
        state[ours_to_hf(name)] = _host(t.detach())
    return state


def _host(t: Tensor) -> Tensor:
    """`t` on the host in a storage of its own: itself when it already is, else a copy."""
    whole = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if t.device.type == "cpu" and whole else t.to("cpu", copy=True).contiguous()


def hf_config(model: Transformer) -> dict:
    """config.json for transformers and vLLM, in the dtype the weights are."""
    dtype = next(model.parameters()).dtype
    return {**model.cfg.to_hf(), "torch_dtype": str(dtype).removeprefix("torch.")}


def export_model(model: Transformer, tokenizer, folder: Path, provenance: dict) -> Path:
    """Write `folder` (replaced whole) as a Hugging Face checkpoint of `model` with `tokenizer` (None: no
    tokenizer files); `provenance` (base model, steps, ...) goes to its sparrow_train.json."""
    folder = Path(folder)

    def fill(tmp: Path) -> None:
        save_weights(hf_state(model), tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(hf_config(model), indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        (tmp / MARKER).write_text(json.dumps(provenance, indent=2, default=str))

    with torch.no_grad():
        replace_dir(folder, fill)
    return folder


__all__ = ["MARKER", "export_model", "hf_config", "hf_state"]
