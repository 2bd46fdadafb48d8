"""A training run's directory: what may be written over, what a resume must agree on, who writes it, and
interrupts.

The rules (fingerprints of what a run reads, what --force removes, how interrupts are deferred):
docs/training.md (design notes). One process writes a run at a time: the writer (torchrun's rank 0, or
the single process) holds the folder's lock (schemas.locations.hold_folder) from the check of the run
directory to the end of the run, so a second `sparrow train -o RUN` is refused at once instead of mixing
its steps into the first's files. The lock is taken after the checks that read the folder alone (a
folder of someone else's files is refused without a lock file made in it) and before anything in it
changes (a resume's recovery of a killed write included); a refusal lets go of it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import fields, replace
from pathlib import Path
from types import FrameType

import pyarrow.parquet as pq

from sparrow.schemas import ArtifactError, read_artifact
from sparrow.schemas.io import leftovers, recover_replaced, remove_leftovers
from sparrow.schemas.locations import describe, hold_folder, release_folder

from ..core.fingerprints import checkpoint_path, model_files_sha256, schedule_sha256, sha256_json
from ..core.schedule import Schedule
from ..kv_policies import BlockTopK, KVPolicy
from ..model.export import MARKER as MODEL_MARKER
from ..tasks.reward_function import reward_fn_sha256
from .config import TrainConfig
from .data import PromptRow

FLAGS = {"lora_rank": "--lora-rank (0 = --full)",
         "loss": "the loss options (--loss-agg, --rollout-is*, --epsilon, --epsilon-high, ...)",
         "sparsity": "--budget/--schedule/--dense", "max_grad_norm": "--max-grad-norm"}
RUN_FILES = {"metrics.parquet": "metrics", "schedule.parquet": "schedule"}
# a folder is the run's when it holds one of its files: a checkpoint that lost its state.pt is still the
# run's (damaged), so --resume names the missing file and --force replaces it
REPLACED_DIRS = {"checkpoint": ("state.pt", "config.json", "progress.json"),
                 "adapter": ("adapter_config.json",), "sparse_adapter": ("adapter_config.json",)}
MODEL_DIR = "model"  # a --full run's export; a folder of that name without MODEL_MARKER is someone else's
METRICS_LOG = "metrics.jsonl"  # --report-to jsonl's
MISMATCH_DIR, COMPLETIONS_DIR = "mismatch", "completions"
STEP_FOLDERS = (MISMATCH_DIR, COMPLETIONS_DIR)  # filled with a file per step, step=NNNNN.parquet
RUN_NAMES = (*RUN_FILES, *REPLACED_DIRS, *STEP_FOLDERS, METRICS_LOG, "tensorboard", "wandb")
# written by replacing them whole: a killed write leaves hidden siblings (schemas.io.leftovers)
REPLACED_NAMES = (*RUN_FILES, *REPLACED_DIRS, MODEL_DIR, METRICS_LOG)
STALE_MISMATCH = re.compile(r"\.step=\d+\.parquet\.[0-9a-f]{8,32}(?:-\d+)?\.tmp")
WRITER = "sparrow train"  # what holds a run directory's lock, as a refusal names it
# not compared where a checkpoint names none (it was written before they were recorded)
UNRECORDED = ("reward", "reward_fn", "reward_fn_sha256", "reward_kwargs", "model_files_sha256",
              "max_prompt_length", "truncation", "filter_overlong_prompts")
# what a resume may change besides --steps: when to checkpoint and evaluate do not change the weights or the
# training metrics (the new value applies from the resume on, and the next checkpoint records it); the
# thread count is the machine's, said in a note since the last digits of a CPU's logprobs depend on it
MAY_CHANGE = {"checkpoint_every": "--checkpoint-every", "eval_every": "--eval-every", "threads": "--threads"}


class TrainingInterrupted(KeyboardInterrupt):
    """An interrupt that left the run resumable; the message says where it stopped and how to go on."""


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
    return schedule_sha256(planned_schedule(policy))


def with_fingerprints(cfg: TrainConfig, prompts: Sequence[PromptRow] | None,
                      eval_prompts: Sequence[PromptRow] | None, policy: KVPolicy) -> TrainConfig:
    """`cfg` with the content hashes of what the run reads."""
    return replace(cfg, prompts_sha256=prompts_fingerprint(prompts),
                   eval_prompts_sha256=prompts_fingerprint(eval_prompts),
                   schedule_sha256=sparsity_fingerprint(policy),
                   reward_fn_sha256=reward_fn_sha256(cfg.reward_fn),
                   model_files_sha256=model_files_sha256(checkpoint_path(cfg.model)))


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
    elif _resumable(run_dir):
        words.append("a checkpoint that a killed write moved aside, which --resume puts back")
    else:
        words.append("no checkpoint")
    return ", ".join(words)


def _resumable(run_dir: Path) -> bool:
    """Whether --resume has a checkpoint to continue from: RUN/checkpoint, or the version a killed
    replacement moved aside (`recover_run` puts it back)."""
    checkpoint = run_dir / "checkpoint"
    return checkpoint.exists() or bool(leftovers(checkpoint)[1])


def _ours(folder: Path, markers: Sequence[str]) -> bool:
    return folder.is_dir() and any((folder / m).exists() for m in markers)


def _is_metrics_log(path: Path) -> bool:
    """Whether `path` is a run's metrics.jsonl: empty, or its first line a JSON object with a whole step
    (what tracking.JsonlTracker writes)."""
    try:
        with path.open("rb") as f:
            line = f.readline(1 << 20)
        if not line.strip():
            return path.is_file()
        row = json.loads(line)
    except (OSError, ValueError):
        return False
    return isinstance(row, dict) and isinstance(row.get("step"), int)


def _check_kinds(run_dir: Path, force: bool, full: bool) -> None:
    """Files of a run's names that are not of its kind: refused (folders even with force); the model
    folder only for a --full run, which writes it (a LoRA run leaves a folder of that name alone)."""
    folders = {**REPLACED_DIRS, **({MODEL_DIR: (MODEL_MARKER,)} if full else {})}
    for name, markers in folders.items():
        folder = run_dir / name
        if folder.exists() and not _ours(folder, markers) and (folder.is_file() or any(folder.iterdir())):
            raise ValueError(f"{folder} exists and is not a training run's {name}, and the run would replace "
                             "it; choose another run directory (-o)")
    for name in STEP_FOLDERS:
        folder = run_dir / name
        if folder.is_file() or folder.is_dir() and any(
                not (f.name.startswith("step=") and f.suffix == ".parquet") for f in folder.iterdir()
                if not f.name.startswith(".")):
            raise ValueError(f"{folder} holds files that are not a training run's per-step {name}; choose "
                             "another run directory (-o)")
    if force:
        return
    log = run_dir / METRICS_LOG
    if log.exists() and not _is_metrics_log(log):
        raise ValueError(f"{log} exists and is not a training run's metrics log (a JSON line per step), and "
                         "the run would replace it; pass --force to replace it, or choose another run "
                         "directory (-o)")
    for name, kind in RUN_FILES.items():
        path = run_dir / name
        if path.exists():
            found, words = describe(path)
            if found != kind:
                raise ValueError(f"{path} exists and is {words}, not the run's '{kind}' artifact; pass "
                                 "--force to replace it, or choose another run directory (-o)")


def check_run_dir(run_dir: str | Path, cfg: TrainConfig, resume: bool, force: bool = False) -> None:
    """Refuse, in one sentence, a run directory this run must not write (see the module's docstring).
    `cfg` carries the fingerprints of what the run reads. An existing directory is locked for this
    process when it writes the run (`lock_run`); a refusal lets go of it."""
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
    _check_kinds(run_dir, force, full=not cfg.lora_rank)
    others = sorted(f.name for f in run_dir.iterdir() if not f.name.startswith("."))
    if others and not resume and not force and not any((run_dir / n).exists() for n in RUN_NAMES):
        raise ValueError(f"{run_dir} holds files that are not a training run's (such as {others[0]}); pass "
                         "--force to start a run among them (they are kept), or choose another --output-dir")
    if writes_run():
        lock_run(run_dir)
    with unlocked_on_refusal(run_dir):
        _check_held_run(run_dir, cfg, resume, force)


def _check_held_run(run_dir: Path, cfg: TrainConfig, resume: bool, force: bool) -> None:
    """The checks of a run directory that this process holds: a resume's recovery of a killed write, then
    what the directory holds against --resume/--force."""
    if resume:
        recover_run(run_dir)
    has_run = (run_dir / "metrics.parquet").exists() or _resumable(run_dir)
    if not (has_run or resume or force):
        _check_foreign_schedule(run_dir / "schedule.parquet")
    if resume:
        if not (run_dir / "checkpoint").exists():
            if has_run:
                raise ValueError(f"--resume: {run_dir} holds {_holds(run_dir)}, so there is nothing to "
                                 "resume from; pass --force instead of --resume to start it over")
            raise ValueError(f"--resume: {run_dir} holds no run to resume (none was checkpointed); drop "
                             "--resume to start the run there")
        _check_metrics_readable(run_dir / "metrics.parquet")
        check_same_run(run_dir, cfg)
    elif has_run and not force:
        go_on = ("; pass --resume to continue it," if _resumable(run_dir)
                 else ", which cannot be resumed; pass")
        raise ValueError(f"{run_dir} already holds a run ({_holds(run_dir)}){go_on} --force to start it "
                         "over, or choose another run directory (-o)")


def _check_metrics_readable(path: Path) -> None:
    """A resume rewrites RUN/metrics.parquet whole from the checkpoint's history, so it must read the file
    as every reader does: one of another schema version (a newer Sparrow's columns) is refused, not
    rewritten without what this Sparrow does not know."""
    if not path.exists():
        return
    try:
        read_artifact(path, "metrics")
    except ArtifactError as e:
        raise ValueError(f"--resume: {e} (a resume rewrites it whole, so it must read it first)") from None


# ---------------------------------------------------------------- who writes the directory

def writes_run() -> bool:
    """Whether this process writes the run: torchrun's rank 0 (its RANK), or a process outside torchrun."""
    return os.environ.get("RANK", "0").strip() in ("", "0")


def lock_run(run_dir: Path) -> None:
    """Hold the run directory (made when missing, and then removed if it is let go of empty: a run stopped
    while its model loaded) for this process until `release_run`; ValueError in one sentence when another
    process writes it."""
    made = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{run_dir} cannot be created ({e.strerror or e}); choose another run "
                         "directory (-o)") from None
    hold_folder(run_dir, WRITER, "another run directory (-o)", made=made)


def release_run(run_dir: Path) -> None:
    """Let go of the run directory's lock (nothing when this process holds none)."""
    release_folder(run_dir)


@contextmanager
def unlocked_on_refusal(run_dir: Path) -> Iterator[None]:
    """A refusal (ValueError) inside lets go of the run directory: the run will not write it."""
    try:
        yield
    except ValueError:
        release_run(run_dir)
        raise


def _check_foreign_schedule(path: Path) -> None:
    """A schedule that no training run wrote (a planned one) in a directory that holds no run: the run would
    replace it with the one it rolls out with, so it is kept unless --force."""
    from sparrow.schemas import artifact_metadata

    if path.exists() and "source" not in artifact_metadata(path):
        raise ValueError(f"{path} is a schedule that no training run wrote, and a run in {path.parent} "
                         "writes its own schedule.parquet there; pass --force to replace it, or choose "
                         "another run directory (-o)")


def saved_config(run_dir: Path) -> tuple[TrainConfig, set[str]]:
    """The configuration RUN/checkpoint/config.json records, and the fields it names (a field it does not
    name takes TrainConfig's default); ValueError in one sentence when it cannot be read."""
    try:
        raw = json.loads((run_dir / "checkpoint" / "config.json").read_text())
        return TrainConfig(**raw), set(raw)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"--resume: {run_dir}/checkpoint/config.json cannot be read as this Sparrow's "
                         f"training configuration ({e}); pass --force instead of --resume to start the run "
                         "over") from None


def check_same_run(run_dir: Path, cfg: TrainConfig) -> None:
    """A resume agrees with the checkpoint on everything but `steps` and `MAY_CHANGE`; else one sentence
    naming it."""
    saved, recorded = saved_config(run_dir)
    if not saved.prompts_sha256:
        raise ValueError(f"--resume: {run_dir} was written by a Sparrow that did not record its prompts, so "
                         "resuming cannot check that they are the same; pass --force instead of --resume to "
                         "start it over")
    for name in differences(saved, cfg, recorded):
        raise ValueError(f"--resume: {run_dir} was trained {_what_differs(name, saved, cfg)}; only --steps, "
                         "--checkpoint-every and --eval-every may change on resume")


def resume_notes(run_dir: Path, cfg: TrainConfig) -> list[str]:
    """What a resume changes of `MAY_CHANGE`, one sentence each: a new --checkpoint-every or --eval-every
    applies from the resume on, and a CPU run resumed with another thread count than it ran with is no
    longer bit for bit an uninterrupted run (a checkpoint that did not record its threads says nothing)."""
    saved, _ = saved_config(run_dir)
    notes = [f"--resume: {MAY_CHANGE[name]} changes from {getattr(saved, name)} to {getattr(cfg, name)} from "
             "the resumed step on (the next checkpoint records it)"
             for name in ("checkpoint_every", "eval_every") if getattr(saved, name) != getattr(cfg, name)]
    if reward_file_edited(saved, cfg):
        notes.append(f"--resume: {cfg.reward_fn.rpartition(':')[0]} holds other code than when {run_dir} "
                     f"was checkpointed; the steps after step {checkpoint_step(run_dir)} score with its code "
                     "as it is now")
    if saved.threads and cfg.threads and saved.threads != cfg.threads and cfg.device == "cpu":
        notes.append(f"--resume: {run_dir} ran with {saved.threads} CPU threads and resumes with "
                     f"{cfg.threads}; a CPU's logprobs differ in their last digits with the thread count, "
                     "so the resumed steps are not bit for bit those of an uninterrupted run (--threads "
                     f"{saved.threads} keeps them)")
    return notes


def _what_differs(name: str, saved: TrainConfig, now: TrainConfig) -> str:
    was, new = getattr(saved, name), getattr(now, name)
    if name in ("reward", "reward_fn"):
        return f"with {_scoring(saved)}, not {_scoring(now)}"
    return {"prompts_sha256": "on other prompts than --prompts holds (their content differs)",
            "eval_prompts_sha256": ("without --eval-prompts, but this command gives them" if not was
                                    else "with --eval-prompts, but this command gives none" if not new
                                    else "on other held-out prompts than --eval-prompts holds (their "
                                    "content differs)"),
            "schedule_sha256": "with another schedule than --schedule holds (its budgets differ)",
            "model_files_sha256": (f"from {now.model} as its files were then; they have been written since "
                                   "(their names, sizes or modification times differ), so the checkpoint's "
                                   "steps were not taken from these weights"),
            "reward_fn_sha256": f"with --reward-fn {saved.reward_fn}, whose file held other code than "
                                f"{(now.reward_fn or '').rpartition(':')[0]} holds now (their content "
                                "differs)",
            }.get(name, f"with {FLAGS.get(name, '--' + name.replace('_', '-'))} {was!r}, not {new!r}")


def _scoring(cfg: TrainConfig) -> str:
    """How a run scored its prompts, as the flag that said so."""
    if cfg.reward_fn:
        return f"--reward-fn {cfg.reward_fn}"
    if cfg.reward:
        return f"--reward {cfg.reward}"
    return "each prompt's own task's scorer (neither --reward nor --reward-fn)"


def differences(saved: TrainConfig, now: TrainConfig, recorded: set[str] | None = None) -> list[str]:
    """The fields that differ but `steps` and `MAY_CHANGE`; two schedules are compared by content, not by
    path, and so are two reward functions of the same name; two paths of one model folder are one model.
    Reward fields a checkpoint did not record (`recorded`: the fields it names) are not compared: its
    prompts' fingerprint holds the task they are scored by."""
    both_schedules = saved.sparsity.startswith("schedule:") and now.sparsity.startswith("schedule:")
    same_function = bool(saved.reward_fn and now.reward_fn) and (
        saved.reward_fn.rpartition(":")[2] == now.reward_fn.rpartition(":")[2])
    same_model = _same_folder(saved.model, now.model)
    skip = ({"steps", *MAY_CHANGE} | ({"sparsity"} if both_schedules else set())
            | ({"reward_fn"} if same_function else set()) | ({"model"} if same_model else set())
            | ({"reward_fn_sha256"} if reward_file_edited(saved, now) else set())
            | {f for f in UNRECORDED if recorded is not None and f not in recorded})
    return [f.name for f in fields(saved)
            if f.name not in skip and getattr(saved, f.name) != getattr(now, f.name)]


def reward_file_edited(saved: TrainConfig, now: TrainConfig) -> bool:
    """Whether the run's --reward-fn is the same function of the same file, whose code has changed since
    the checkpoint (a reward fixed after it raised): a resume goes on, with a note (`resume_notes`)."""
    if not (saved.reward_fn and now.reward_fn):
        return False
    if saved.reward_fn_sha256 == (now.reward_fn_sha256 or reward_fn_sha256(now.reward_fn)):
        return False
    (a, _, fa), (b, _, fb) = saved.reward_fn.rpartition(":"), now.reward_fn.rpartition(":")
    return fa == fb and (a == b or _same_folder(a, b))


def _same_folder(a: str, b: str) -> bool:
    """Two --model paths that name one checkpoint folder or file (m/ckpt and /home/me/m/ckpt), as
    resolved from the working directory; presets compare as their names."""
    pa, pb = Path(a), Path(b)
    return a != b and pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def clear_run(run_dir: Path) -> None:
    """`--force`: remove what a run wrote (checked as the run's own by `check_run_dir`), nothing else: the
    hidden leftovers of a killed write among it, and a model folder only when a run exported it."""
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    for name in REPLACED_DIRS:
        shutil.rmtree(run_dir / name, ignore_errors=True)
    if _ours(run_dir / MODEL_DIR, (MODEL_MARKER,)):
        shutil.rmtree(run_dir / MODEL_DIR, ignore_errors=True)
    for name in STEP_FOLDERS:
        for f in (run_dir / name).glob("step=*.parquet"):
            f.unlink()
    for name in REPLACED_NAMES:
        remove_leftovers(run_dir / name)
    _remove_stale_mismatch(run_dir)


def recover_run(run_dir: Path) -> None:
    """`--resume`: undo what a run killed while it wrote left (hidden temporaries are removed; a checkpoint
    or export moved aside and not replaced is put back), so the run resumes from what it had written."""
    for name in REPLACED_NAMES:
        recover_replaced(run_dir / name)
    _remove_stale_mismatch(run_dir)


def _remove_stale_mismatch(run_dir: Path) -> None:
    """The temporaries a killed write of a per-step file left."""
    for folder in (run_dir / name for name in STEP_FOLDERS):
        for f in folder.iterdir() if folder.is_dir() else ():
            if STALE_MISMATCH.fullmatch(f.name):
                f.unlink(missing_ok=True)


# ---------------------------------------------------------------- a finished run

def run_outputs(cfg: TrainConfig) -> dict[str, str]:
    """What a finished run leaves beside its logs: folder -> the file that shows it written."""
    out = {"adapter": "adapter_config.json"} if cfg.lora_rank else {MODEL_DIR: MODEL_MARKER}
    if cfg.distill_sparse:
        out["sparse_adapter"] = "adapter_config.json"
    return out


def recorded_summary(run_dir: Path) -> dict | None:
    """The summary a finished run recorded in its metrics metadata (None: none, or unreadable)."""
    from sparrow.schemas import ArtifactError, artifact_metadata

    try:
        text = artifact_metadata(run_dir / "metrics.parquet").get("summary")
        summary = json.loads(text) if isinstance(text, str) else None
    except (ArtifactError, OSError, ValueError):  # a missing or damaged file records none
        return None
    return summary if isinstance(summary, dict) else None


def record_summary(run_dir: Path, summary: dict) -> None:
    """The run's summary into its metrics metadata (key `summary`, JSON text), the rows and the rest of
    the metadata as they are; written last, it marks the run finished."""
    from sparrow.schemas import artifact_metadata, read_artifact, write_artifact

    path = run_dir / "metrics.parquet"
    table = read_artifact(path, "metrics")
    write_artifact(table, path, "metrics", {**artifact_metadata(table), "summary": json.dumps(summary)})


def finished(run_dir: Path, cfg: TrainConfig, steps: int) -> bool:
    """Whether the run of `steps` steps wrote all it leaves: its outputs and, last, its summary."""
    summary = recorded_summary(run_dir)
    return (summary is not None and summary.get("steps") == steps
            and all((run_dir / folder / marker).is_file() for folder, marker in run_outputs(cfg).items()))


def unwritten(cfg: TrainConfig) -> str:
    """What an unfinished run of all its steps has yet to write, in words."""
    names = {"adapter": "adapter", MODEL_DIR: "model (RUN/model)", "sparse_adapter": "sparse adapter"}
    return f"its {', '.join(names[f] for f in run_outputs(cfg))} and summary"


# ---------------------------------------------------------------- interrupts

INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


class Deferral:
    """The interrupts a block defers: each one that came (signal, frame) waits for the block's end, where
    the handler it was meant for runs (SIGINT's raises KeyboardInterrupt; the CLI's SIGTERM handler records
    it first, sparrow_cli.errors.sigterm_as_interrupt); a second one interrupts at once. `allowed()` opens
    a part of the block that interrupts stop at once."""

    def __init__(self) -> None:
        self.previous: dict[int, Callable] = {}  # the handlers it replaced, by signal
        self.pending: list[tuple[int, FrameType | None] | None] = []  # None: one raised in `allowed()`

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self.pending:
            self.previous[signum](signum, frame)
            raise KeyboardInterrupt
        self.pending.append((signum, frame))

    def install(self) -> None:
        for signum in self.previous:
            signal.signal(signum, self.handler)

    def restore(self) -> None:
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)

    @contextmanager
    def allowed(self) -> Iterator[None]:
        """Inside the block, a part an interrupt stops at once (its KeyboardInterrupt propagates, and the
        block's end interrupts again); one that came before it stops it before it starts."""
        if self.pending:
            raise KeyboardInterrupt
        self.restore()
        try:
            yield
        except KeyboardInterrupt:
            self.pending.append(None)
            raise
        finally:
            self.install()

    def end(self) -> None:
        """At the block's end: the first interrupt that came, handled as it was meant to be."""
        if not self.pending:
            return
        first = self.pending[0]
        if first is not None:
            signum, frame = first
            self.previous[signum](signum, frame)
        raise KeyboardInterrupt


def _deferrable(signum: int) -> bool:
    """SIGINT when Python's own handler has it (another handler is someone else's; SIG_IGN: ignored, as
    in a shell's background job); SIGTERM when a Python handler has it (the CLI's turns it into an
    interrupt; SIG_DFL ends the process, as the caller chose)."""
    handler = signal.getsignal(signum)
    if signum == signal.SIGINT:
        return handler is signal.default_int_handler
    return callable(handler)


@contextmanager
def interrupts_deferred() -> Iterator[Deferral]:
    """SIGINT and SIGTERM (`Deferral`) wait until the block ends, then interrupt; a second one interrupts at
    once. SIGTERM is deferred whatever SIGINT's handler is, so a job the shell started in the background
    (SIGINT ignored) stops where a foreground one does. Outside the main thread, where Python runs no
    signal handler, the block runs as it is."""
    deferral = Deferral()
    if threading.current_thread() is threading.main_thread():
        deferral.previous = {s: signal.getsignal(s) for s in INTERRUPTS if _deferrable(s)}
    deferral.install()
    try:
        yield deferral
    finally:
        deferral.restore()
    deferral.end()
