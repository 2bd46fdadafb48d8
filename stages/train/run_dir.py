"""A training run's directory: what may be written over, what a resume must agree on, and interrupts.

The rules (fingerprints of what a run reads, what --force removes, how interrupts are deferred):
docs/training.md (design notes).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import fields, replace
from pathlib import Path

import pyarrow.parquet as pq

from sparrow.schemas.locations import describe

from ..core.schedule import Schedule
from ..kv_policies import BlockTopK, KVPolicy
from .config import TrainConfig
from .data import PromptRow

FLAGS = {"lora_rank": "--lora-rank (0 = --full)", "loss": "the loss options (--loss-agg, --rollout-is*, ...)",
         "sparsity": "--budget/--schedule/--dense", "max_grad_norm": "max_grad_norm"}
RUN_FILES = {"metrics.parquet": "metrics", "schedule.parquet": "schedule"}
# a folder is the run's when it holds one of its files: a checkpoint that lost its state.pt is still the
# run's (damaged), so --resume names the missing file and --force replaces it
REPLACED_DIRS = {"checkpoint": ("state.pt", "config.json", "progress.json"),
                 "adapter": ("adapter_config.json",), "sparse_adapter": ("adapter_config.json",)}
RUN_NAMES = (*RUN_FILES, *REPLACED_DIRS, "mismatch", "metrics.jsonl", "tensorboard", "wandb")


class TrainingInterrupted(KeyboardInterrupt):
    """An interrupt that left the run resumable; the message says where it stopped and how to go on."""


def sha256_json(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def prompts_fingerprint(rows: Sequence[PromptRow] | None) -> str:
    """The sha256 of the prompts as training reads them; "" for none."""
    if not rows:
        return ""
    return sha256_json([[r.prompt_id, r.task, list(r.token_ids), r.answer, r.metadata] for r in rows])


def planned_schedule(policy: KVPolicy) -> Schedule | None:
    """The schedule file a block top-k policy was made of; None for the rest."""
    return policy.schedule if isinstance(policy, BlockTopK) else None


def sparsity_fingerprint(policy: KVPolicy) -> str:
    """The sha256 of a schedule's content; "" for dense or a fixed budget (its spec says it all)."""
    schedule = planned_schedule(policy)
    if schedule is None:
        return ""
    return sha256_json([schedule.page_size, list(schedule.bin_starts), list(schedule.budgets)])


def with_fingerprints(cfg: TrainConfig, prompts: Sequence[PromptRow] | None,
                      eval_prompts: Sequence[PromptRow] | None, policy: KVPolicy) -> TrainConfig:
    """`cfg` with the content hashes of what the run reads."""
    return replace(cfg, prompts_sha256=prompts_fingerprint(prompts),
                   eval_prompts_sha256=prompts_fingerprint(eval_prompts),
                   schedule_sha256=sparsity_fingerprint(policy))


# ---------------------------------------------------------------- what the directory holds

def logged_steps(run_dir: Path) -> int | None:
    path = run_dir / "metrics.parquet"
    try:
        return pq.read_metadata(path).num_rows if path.exists() else None
    except Exception:  # noqa: BLE001 - a file the kind check will name
        return None


def checkpoint_step(run_dir: Path) -> int | None:
    try:
        return int(json.loads((run_dir / "checkpoint" / "progress.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _holds(run_dir: Path) -> str:
    steps, at = logged_steps(run_dir), checkpoint_step(run_dir)
    words = [f"{steps} logged step{'s' * (steps != 1)}" if steps is not None else "no metrics"]
    if (run_dir / "checkpoint").exists():
        words.append(f"a checkpoint at step {at}" if at is not None else "a checkpoint")
    else:
        words.append("no checkpoint")
    return ", ".join(words)


def _check_kinds(run_dir: Path, force: bool) -> None:
    """Files of a run's names that are not of its kind: refused (folders even with force)."""
    for name, markers in REPLACED_DIRS.items():
        folder = run_dir / name
        if folder.exists() and not any((folder / m).exists() for m in markers) and (
                folder.is_file() or any(folder.iterdir())):
            raise ValueError(f"{folder} exists and is not a training run's {name}, and the run would replace "
                             "it; choose another run directory (-o)")
    mismatch = run_dir / "mismatch"
    if mismatch.is_file() or mismatch.is_dir() and any(
            not (f.name.startswith("step=") and f.suffix == ".parquet") for f in mismatch.iterdir()
            if not f.name.startswith(".")):
        raise ValueError(f"{mismatch} holds files that are not a training run's per-step mismatch; choose "
                         "another run directory (-o)")
    if force:
        return
    for name, kind in RUN_FILES.items():
        path = run_dir / name
        if path.exists():
            found, words = describe(path)
            if found != kind:
                raise ValueError(f"{path} exists and is {words}, not the run's '{kind}' artifact; pass "
                                 "--force to replace it, or choose another run directory (-o)")


def check_run_dir(run_dir: str | Path, cfg: TrainConfig, resume: bool, force: bool = False) -> None:
    """Refuse, in one sentence, a run directory this run must not write (see the module's docstring).
    `cfg` carries the fingerprints of what the run reads."""
    run_dir = Path(run_dir)
    if resume and force:
        raise ValueError("pass --resume (continue the run) or --force (start it over), not both")
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"{run_dir} is a file, but a training run is a directory; choose another "
                         "run directory (-o)")
    if not run_dir.exists():
        if resume:
            raise ValueError(f"--resume: {run_dir} does not exist, so there is no run to resume")
        return
    _check_kinds(run_dir, force)
    others = sorted(f.name for f in run_dir.iterdir() if not f.name.startswith("."))
    if others and not resume and not force and not any((run_dir / n).exists() for n in RUN_NAMES):
        raise ValueError(f"{run_dir} holds files that are not a training run's (such as {others[0]}); pass "
                         "--force to start a run among them (they are kept), or choose another --output-dir")
    has_run = (run_dir / "metrics.parquet").exists() or (run_dir / "checkpoint").exists()
    if not (has_run or resume or force):
        _check_foreign_schedule(run_dir / "schedule.parquet")
    if resume:
        if not (run_dir / "checkpoint").exists():
            if has_run:
                raise ValueError(f"--resume: {run_dir} holds {_holds(run_dir)}, so there is nothing to "
                                 "resume from; pass --force instead of --resume to start it over")
            raise ValueError(f"--resume: {run_dir} holds no run to resume")
        check_same_run(run_dir, cfg)
    elif has_run and not force:
        raise ValueError(f"{run_dir} already holds a run ({_holds(run_dir)}); pass --resume to continue it, "
                         "--force to start it over, or choose another run directory (-o)")


def _check_foreign_schedule(path: Path) -> None:
    """A schedule that no training run wrote (a planned one) in a directory that holds no run: the run would
    replace it with the one it rolls out with, so it is kept unless --force."""
    from sparrow.schemas import artifact_metadata

    if path.exists() and "source" not in artifact_metadata(path):
        raise ValueError(f"{path} is a schedule that no training run wrote, and a run in {path.parent} "
                         "writes its own schedule.parquet there; pass --force to replace it, or choose "
                         "another run directory (-o)")


def check_same_run(run_dir: Path, cfg: TrainConfig) -> None:
    """A resume agrees with the checkpoint on everything but `steps`; else one sentence naming it."""
    try:
        raw = json.loads((run_dir / "checkpoint" / "config.json").read_text())
        saved = TrainConfig(**raw)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"--resume: {run_dir}/checkpoint/config.json cannot be read as this Sparrow's "
                         f"training configuration ({e})") from None
    if not saved.prompts_sha256:
        raise ValueError(f"--resume: {run_dir} was written by a Sparrow that did not record its prompts, so "
                         "resuming cannot check that they are the same; pass --force instead of --resume to "
                         "start it over")
    for name in differences(saved, cfg):
        was, now = getattr(saved, name), getattr(cfg, name)
        what = {"prompts_sha256": "on other prompts than --prompts holds (their content differs)",
                "eval_prompts_sha256": ("without --eval-prompts" if not was else "with no --eval-prompts"
                                        if not now else "on other held-out prompts than --eval-prompts "
                                        "holds (their content differs)"),
                "schedule_sha256": "with another schedule than --schedule holds (its budgets differ)",
                }.get(name, f"with {FLAGS.get(name, '--' + name.replace('_', '-'))} {was!r}, not {now!r}")
        raise ValueError(f"--resume: {run_dir} was trained {what}; only --steps may change on resume")


def differences(saved: TrainConfig, now: TrainConfig) -> list[str]:
    """The fields that differ but `steps`; two schedules are compared by content, not by path."""
    both_schedules = saved.sparsity.startswith("schedule:") and now.sparsity.startswith("schedule:")
    skip = {"steps"} | ({"sparsity"} if both_schedules else set())
    return [f.name for f in fields(saved)
            if f.name not in skip and getattr(saved, f.name) != getattr(now, f.name)]


def clear_run(run_dir: Path) -> None:
    """`--force`: remove what a run wrote (checked as the run's own by `check_run_dir`), nothing else."""
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    for name in REPLACED_DIRS:
        shutil.rmtree(run_dir / name, ignore_errors=True)
    for f in (run_dir / "mismatch").glob("step=*.parquet"):
        f.unlink()


# ---------------------------------------------------------------- interrupts

@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """SIGINT waits until the block ends, then interrupts; a second SIGINT interrupts at once. Outside the
    main thread, or when someone else handles SIGINT, the block runs as it is."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    pending: list[int] = []

    def handler(signum, frame) -> None:
        if pending:
            raise KeyboardInterrupt
        pending.append(signum)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        raise KeyboardInterrupt
