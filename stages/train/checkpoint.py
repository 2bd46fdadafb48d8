"""RUN/checkpoint/: the trainable weights, optimizer, step, history and RNG states of a step boundary, with
config.json and progress.json, replaced atomically: what a resume needs to match an uninterrupted run.

A checkpoint that cannot be written (a full disk, a quota) stops the run in one sentence that names it,
the OS's reason and how to go on: the previous checkpoint is left as it was, and a resume from it drops
what was logged after it (metrics, mismatch logs, tracker lines) and trains those steps again.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from sparrow.schemas import ArtifactError
from sparrow.schemas.io import replace_dir

from .config import TrainConfig
from .run_dir import STEP_FOLDERS, checkpoint_step, finished, saved_config, unlocked_on_refusal, unwritten

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
        _torch_save({**state, "torch_rng": torch_rng, "numpy_rng": numpy_rng, "python_rng": python_rng},
                    tmp / "state.pt")
        (tmp / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
        (tmp / "progress.json").write_text(json.dumps({"step": state["step"], "steps": cfg.steps}))

    try:
        replace_dir(run_dir / "checkpoint", fill)
    except ArtifactError as e:
        raise ArtifactError(f"{e}; {_how_to_go_on(run_dir)}") from None


def _how_to_go_on(run_dir: Path) -> str:
    """After a failed checkpoint write: what the run directory keeps, and the flag that goes on from it."""
    at = checkpoint_step(run_dir)
    if at is None:
        return f"{run_dir} holds no checkpoint yet, so once it can be written, --force starts the run over"
    return (f"{run_dir} keeps its checkpoint at step {at}, so once it can be written, --resume continues "
            f"from there (the steps logged after step {at} are trained again)")


class _Sink:
    """The file torch.save writes through, keeping the OSError of a failed write, or the interrupt (Ctrl-C,
    SIGTERM) that came during one: torch reports either as a RuntimeError ("unexpected pos") that does not
    say why, and an interrupt must stay an interrupt."""

    def __init__(self, f: BinaryIO):
        self.f, self.error = f, None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except (OSError, KeyboardInterrupt) as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def _torch_save(obj: dict, path: Path) -> None:
    """torch.save, a failed write an OSError with the OS's reason (a full disk, a file size limit), an
    interrupt during it the interrupt."""
    with open(path, "wb") as f:
        sink = _Sink(f)
        try:
            torch.save(obj, sink)
        except RuntimeError as e:
            cause = sink.error or _interrupt_behind(e)
            if cause is None:
                raise
            raise cause from None


def _interrupt_behind(error: BaseException) -> KeyboardInterrupt | None:
    """The interrupt that a RuntimeError of torch's was raised while handling, if one was."""
    seen = error.__context__
    while seen is not None and not isinstance(seen, KeyboardInterrupt):
        seen = seen.__context__
    return seen


def load_checkpoint(run_dir: Path, mmap: bool = False) -> dict:
    """RUN/checkpoint/state.pt; ValueError in one sentence naming the file when it is missing or cannot be
    read (a truncated or overwritten file: torch and pickle fail in many ways, all of them a damaged file).
    `mmap`: the tensors stay on disk, so reading the file to check it costs little beside the weights."""
    path = run_dir / "checkpoint" / "state.pt"
    if not path.is_file():
        raise ValueError(f"--resume: {path} is missing, so the checkpoint cannot be resumed (damaged?); pass "
                         "--force instead of --resume to start the run over")
    try:
        state = torch.load(path, weights_only=False, mmap=mmap)
    except Exception:  # noqa: BLE001 - any failure to read it is a damaged file
        state = None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise ValueError(f"--resume: {path} cannot be read (damaged?); pass --force instead of --resume to "
                         "start the run over")
    return state


def check_resumable(run_dir: Path, steps: int) -> None:
    """Before any weights load: the checkpoint's state.pt reads, and --steps goes beyond the steps it holds,
    or equals them in a run stopped before it wrote its outputs and summary (the resume writes them;
    one with nothing left to do would load the model for nothing). A refusal lets go of the run
    directory's lock."""
    with unlocked_on_refusal(run_dir):
        _check_steps_left(run_dir, steps)


def _check_steps_left(run_dir: Path, steps: int) -> None:
    done = load_checkpoint(run_dir, mmap=True)["step"]
    if steps > done:
        return
    cfg, _ = saved_config(run_dir)
    if finished(run_dir, cfg, done):
        finish = ""
    elif steps == done:
        return
    else:
        finish = f"--steps {done} to finish it ({unwritten(cfg)} are not written yet) or "
    raise ValueError(f"--resume: {run_dir} already holds {done} step{'s' * (done != 1)}, so --steps {steps} "
                     f"leaves none to train; give {finish}--steps above {done} to continue it")


def drop_mismatch_after(run_dir: Path, step: int) -> None:
    """The per-step logs (mismatch, completions) of steps a resume will run again (those after `step`, the
    updates the checkpoint holds)."""
    for name in STEP_FOLDERS:
        for f in (run_dir / name).glob("step=*.parquet"):
            if int(f.stem.split("=")[1]) > step:
                f.unlink()
