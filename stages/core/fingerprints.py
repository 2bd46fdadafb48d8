"""Content digests of what a run reads, which a resume compares against the run it continues: a rollout's
journal (rollout_journal.py) and a training run's checkpoint (train/run_dir.py) record the same ones.

A checkpoint folder is digested by its files' names, sizes and modification times, not their bytes: one
rewritten in place (a re-exported run) is told apart without reading gigabytes of weights, at the price
of a copy that does not keep the times (rsync without -t) counting as another model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def sha256_json(value: object) -> str:
    """The digest of `value` as sorted JSON; a value JSON has no type for (a Decimal, a date) by its text."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def model_files_sha256(model_path: Path | None) -> str:
    """The digest of a checkpoint's files as the file system lists them; "" for a preset (None), which this
    installation embeds."""
    if model_path is None:
        return ""
    files = sorted(model_path.rglob("*")) if model_path.is_dir() else [model_path]
    listing = [[str(f.relative_to(model_path)) if model_path.is_dir() else f.name, st.st_size, st.st_mtime_ns]
               for f in files if f.is_file() and (st := f.stat())]
    return sha256_json(listing)


def checkpoint_path(model: str) -> Path | None:
    """The local checkpoint a --model names; None for a preset."""
    from ..model.presets import PRESETS

    return None if model.lower() in PRESETS else Path(model).expanduser()


def schedule_sha256(schedule) -> str:
    """The digest of a `Schedule`'s budgets; "" for none (dense, a fixed budget, eviction)."""
    if schedule is None:
        return ""
    return sha256_json([schedule.page_size, list(schedule.bin_starts), list(schedule.budgets)])
