"""The tokenizer of a `--model` argument, without loading its weights.

Prompt building needs only the tokenizer and chat template, so a preset, a checkpoint directory
or a GGUF file is resolved to its tokenizer alone (None when the source has none).
"""

from __future__ import annotations

from pathlib import Path

from ..model import loading
from ..model.presets import PRESETS, get_preset


def load_model_tokenizer(spec: str):
    """A transformers tokenizer for `spec`, or None when the model ships without one."""
    if spec.lower() in PRESETS:
        return loading.load_tokenizer(get_preset(spec).tokenizer)
    path = Path(spec)
    if path.is_dir():
        return loading._dir_tokenizer(path)
    if path.suffix.lower() == ".gguf" and path.is_file():
        return loading.gguf_tokenizer(path)
    loading.resolve_config(spec)  # raises the one-line "unknown model" error
    return None
