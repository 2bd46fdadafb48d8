"""A model's names: its identity in artifacts, its name for display, and whether a record names it.

Artifacts identify a model by `model_name`: a preset by its name, a checkpoint directory or GGUF file by
its absolute path, so that checkpoints in folders of the same name (`.../actor/huggingface`, `RUN/model`)
stay apart; `short_name` is the last path component, for display. No torch here: the CLI compares
models before anything loads.
"""

from __future__ import annotations

import os
from pathlib import Path

from .presets import PRESETS


def model_name(spec: str) -> str:
    """A model's identity in artifacts' metadata: a preset's name, else the absolute path of the
    checkpoint directory or GGUF file (`~` expanded, symlinks kept as given)."""
    if spec.lower() in PRESETS:
        return spec.lower()
    return os.path.abspath(os.path.expanduser(spec))


def short_name(spec: str) -> str:
    """A model's name for display: a preset's name, a GGUF file's stem, a directory's last component."""
    p = Path(spec.rstrip("/") or spec)
    return spec.lower() if spec.lower() in PRESETS else (p.stem if p.suffix.lower() == ".gguf" else p.name)


def same_model(recorded: object, given: str) -> bool:
    """Whether the model an artifact records is `given` (a --model, or another artifact's record): a
    preset by its name, a checkpoint by its absolute path; a record that is a relative path (a run's config
    keeps --model as it was given, from a folder unknown) by its parts, which must end the given path. An
    artifact that records none is taken as the model's."""
    if not recorded:
        return True
    record = str(recorded).rstrip("/") or str(recorded)
    named = model_name(given.rstrip("/") or given)
    if record.lower() in PRESETS or os.path.isabs(os.path.expanduser(record)):
        return model_name(record) == named
    tail = tuple(part for part in Path(os.path.normpath(record)).parts if part != "..")
    return bool(tail) and Path(named).parts[-len(tail):] == tail
