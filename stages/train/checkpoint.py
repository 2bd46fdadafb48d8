"""RUN/checkpoint/: the trainable weights, optimizer, step, history and RNG states of a step boundary, with
config.json and progress.json, replaced atomically: what a resume needs to match an uninterrupted run."""

from __future__ import annotations

import json
import random
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from sparrow.schemas.io import replace_dir

from .config import TrainConfig

RngStates = tuple  # (torch, numpy, python)


def rng_states() -> RngStates:
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def set_rng_states(state: dict) -> None:
    torch.set_rng_state(state["torch_rng"])
    np.random.set_state(state["numpy_rng"])
    random.setstate(state["python_rng"])


def save_checkpoint(run_dir: Path, state: dict, cfg: TrainConfig, rng: RngStates) -> None:
    """RUN/checkpoint/ replaced by `state` (state.pt, with the RNG states `rng`) and the configuration."""
    torch_rng, numpy_rng, python_rng = rng

    def fill(tmp: Path) -> None:
        torch.save({**state, "torch_rng": torch_rng, "numpy_rng": numpy_rng, "python_rng": python_rng},
                   tmp / "state.pt")
        (tmp / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
        (tmp / "progress.json").write_text(json.dumps({"step": state["step"], "steps": cfg.steps}))

    replace_dir(run_dir / "checkpoint", fill)


def load_checkpoint(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoint" / "state.pt", weights_only=False)


def drop_mismatch_after(run_dir: Path, step: int) -> None:
    """The per-step mismatch logs of steps a resume will run again (those after `step`, the updates the
    checkpoint holds)."""
    for f in (run_dir / "mismatch").glob("step=*.parquet"):
        if int(f.stem.split("=")[1]) > step:
            f.unlink()
