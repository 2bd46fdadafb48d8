"""Live tracking of each training step's metrics (`--report-to`: jsonl, tensorboard, wandb offline or
none) beside RUN/metrics.parquet, which stays the source of truth (docs/training.md, tracking).

A resumed run hands each tracker the rows of the steps its checkpoint holds (`history`): a tracker that
lacks some of them (a step whose line an interrupt cut off, or a run started with another --report-to)
gets them before the new steps, so every tracker ends with every step of metrics.parquet. A final eval
that runs after the last step was logged (`Trainer._missing_eval`) logs that step's row again, with the
eval: the jsonl replaces the step's line, tensorboard and wandb add its scalars at that step.

Step 0 is the initial eval (`initial_eval_row`), logged as TRL's `eval_on_start` logs its eval: under the
periodic evals' names, so their curves start before any update; the jsonl's step-0 line holds only those
fields. A resume hands it to the trackers with the checkpoint's steps (`tracked_history`). The per-bin
tails (`alpha_lb_p5_by_bin`, `alpha_p5_by_bin`, lists) reach tensorboard and wandb as one scalar per
position bin, `<name>/bin_<k>` with k zero-padded so the tags sort in bin order.

A tracker whose files cannot be written (a full disk, a quota) is a convenience lost, not the run: it is
said once (`warn`) and the tracker logs no further steps of the run, which goes on to its checkpoints;
metrics.parquet holds every step. A jsonl line cut off by a full disk is taken back, so the file holds
whole lines; a resume gives each tracker the steps it lacks.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from sparrow.schemas import ArtifactError
from sparrow.schemas.artifacts import first_line
from sparrow.schemas.io import write_bytes

from .detectors import InitialEval

TRACKERS = ("jsonl", "tensorboard", "wandb", "none")
NEEDS = {"tensorboard": "tensorboard", "wandb": "wandb"}
WRITES = {"jsonl": "metrics.jsonl", "tensorboard": "tensorboard", "wandb": "wandb"}  # in the run directory
BY_BIN = ("alpha_lb_p5_by_bin", "alpha_p5_by_bin")  # one p5 per position bin (None: a bin without tokens)


def parse_report_to(text: str) -> tuple[str, ...]:
    """"jsonl,tensorboard" -> ("jsonl", "tensorboard"); ValueError in one sentence for an unknown name or
    a tracker whose package is missing, before any work."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    bad = [n for n in names if n not in TRACKERS]
    if bad or not names:
        raise ValueError(f"--report-to must be a comma list of {', '.join(TRACKERS)}, got {text!r}")
    if "none" in names and len(names) > 1:
        raise ValueError(f"--report-to none cannot be combined with other trackers, got {text!r}")
    for name in names:
        module = NEEDS.get(name)
        if module and importlib.util.find_spec(module) is None:
            raise ValueError(f"--report-to {name} needs the {module} package, which is not installed "
                             f"(pip install {module}, or the extra sparrow-rl[tracking]); --report-to "
                             "jsonl or none need nothing")
    return () if names == ("none",) else names


def initial_eval_row(initial: InitialEval) -> dict:
    """Step 0's row: the initial eval under a periodic eval's names (`sampler_gap`: dense minus sparse
    greedy accuracy), its sampled rewards as `eval_reward(_sparse)` and their difference under its
    metadata name, `initial_sampler_gap`; a field the run has not (a dense run's sparse ones) left out."""
    sparse = initial.accuracy_sparse
    row = {"step": 0, "eval_accuracy": initial.accuracy, "eval_accuracy_sparse": sparse,
           "sampler_gap": None if sparse is None else initial.accuracy - sparse,
           "eval_reward": initial.reward, "eval_reward_sparse": initial.reward_sparse,
           "initial_sampler_gap": initial.sampler_gap}
    return {k: v for k, v in row.items() if v is not None}


def tracked_history(history: Sequence[dict], initial: InitialEval | None) -> list[dict]:
    """The rows a resume hands the trackers: step 0's (a run with an initial eval), then its steps'."""
    return ([initial_eval_row(initial)] if initial is not None else []) + list(history)


def _scalars(row: dict) -> dict[str, float]:
    """The row's finite numbers by name, with a user reward's step means as `reward_extra/<name>` and the
    per-bin tails as `<name>/bin_<k>`."""
    flat = {**row, **{f"reward_extra/{k}": v for k, v in _reward_extra(row).items()}, **_by_bin(row)}
    return {k: float(v) for k, v in flat.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step" and math.isfinite(v)}


def _by_bin(row: dict) -> dict:
    """`alpha_lb_p5_by_bin: [a, None, c]` -> {"alpha_lb_p5_by_bin/bin_000": a, ".../bin_002": c}."""
    return {f"{name}/bin_{k:03d}": v for name in BY_BIN for k, v in enumerate(row.get(name) or ())
            if v is not None}


def _reward_extra(row: dict) -> dict:
    """The row's `reward_extra` (a JSON object in metrics.parquet) as a dict."""
    text = row.get("reward_extra")
    return json.loads(text) if isinstance(text, str) else {}


def _jsonl_line(row: dict) -> str:
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
    if isinstance(clean.get("reward_extra"), str):
        clean["reward_extra"] = _reward_extra(row)  # an object in the line, not its JSON text
    return json.dumps(clean, default=str)


def _line_step(line: str) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


class JsonlTracker:
    def __init__(self, run_dir: Path, start_step: int, history: Sequence[dict] = ()):
        """A resume keeps the lines of the steps up to `start_step`, adds those of `history` it lacks (in
        step order) and drops the rest; a fresh run starts with none."""
        self.path = run_dir / "metrics.jsonl"
        lines: dict[int, str] = {}
        if start_step and self.path.exists():
            for line in self.path.read_text().splitlines():
                step = _line_step(line)
                if step is not None and step <= start_step:
                    lines.setdefault(step, line)
        for row in history if start_step else ():
            if row["step"] <= start_step:
                lines.setdefault(row["step"], _jsonl_line(row))
        if lines:
            write_bytes(self.path, "".join(lines[s] + "\n" for s in sorted(lines)).encode())
        else:  # made by the first step's line: a run stopped before it leaves none
            self.path.unlink(missing_ok=True)
        self.steps = set(lines)

    def log(self, row: dict) -> None:
        """A step's line appended; a step logged again (its final eval added) replaces its line."""
        line = _jsonl_line(row)
        if row["step"] in self.steps:
            old = self.path.read_text().splitlines()
            write_bytes(self.path, "".join((line if _line_step(o) == row["step"] else o) + "\n"
                                           for o in old).encode())
            return
        self._append(line + "\n")
        self.steps.add(row["step"])

    def _append(self, line: str) -> None:
        """`line` at the file's end, or (a failed write) the file as it was: no half line."""
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            start, data = os.fstat(fd).st_size, line.encode()
            try:
                while data:
                    data = data[os.write(fd, data):]
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, start)
                raise
        finally:
            os.close(fd)

    def close(self) -> None:
        pass


class TensorboardTracker:
    def __init__(self, run_dir: Path, start_step: int, config: dict, history: Sequence[dict] = ()):
        """A resume purges every earlier event (from step 0, the initial eval's) and writes the config and
        `history` again, since which steps the event files hold is not known without reading them all.
        Every writer opens with a session start at step 0 (`purge_step=0`): TensorBoard takes a run's first
        one for its start and purges at a later one only, so a fresh run's must be there too."""
        from torch.utils.tensorboard import SummaryWriter

        folder = run_dir / "tensorboard"
        if start_step == 0:  # a run started (over): no events of an earlier one
            for f in folder.glob("events.out.tfevents.*"):
                f.unlink()
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=0)
        self.writer.add_text("config", json.dumps(config, indent=2, default=str))
        for row in history if start_step else ():
            self.log(row)

    def log(self, row: dict) -> None:
        for key, value in _scalars(row).items():
            self.writer.add_scalar(key, value, global_step=row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path, start_step: int, config: dict, history: Sequence[dict] = ()):
        """A resume logs `history` first, so the offline run it makes holds every step of the run
        (wandb ignores steps that a run it continued already holds)."""
        import wandb

        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(mode="offline", dir=str(run_dir), project="sparrow", name=run_dir.name,
                              config=config, resume="allow" if start_step else None)
        for row in history if start_step else ():
            self.log(row)

    def log(self, row: dict) -> None:
        self.run.log(_scalars(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()


Tracker = JsonlTracker | TensorboardTracker | WandbTracker


def _python_warning(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


class Trackers:
    """The run's trackers: `log` each step's row, `close` at the end (rank 0 only). One whose files cannot
    be written is dropped with a warning (the module's docstring)."""

    def __init__(self, names: tuple[str, ...], run_dir: str | Path, start_step: int = 0,
                 config: dict | None = None, history: Sequence[dict] = (),
                 warn: Callable[[str], None] | None = None):
        """`history`: the rows of the steps up to `start_step` (a resume's), which trackers that lack
        them write first. `warn`: how a dropped tracker is said (default: a Python warning)."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.warn = warn or _python_warning
        makers = {"jsonl": lambda: JsonlTracker(self.run_dir, start_step, history),
                  "tensorboard": lambda: TensorboardTracker(self.run_dir, start_step, config or {}, history),
                  "wandb": lambda: WandbTracker(self.run_dir, start_step, config or {}, history)}
        self.trackers: dict[str, Tracker] = {}
        for name in (n for n in names if n != "none"):
            try:
                self.trackers[name] = makers[name]()
            except (OSError, ArtifactError) as e:
                self._said(name, e, "logs no step of this run")

    def log(self, row: dict) -> None:
        for name, t in list(self.trackers.items()):
            try:
                t.log(row)
            except (OSError, ArtifactError) as e:
                self._drop(name)
                self._said(name, e, f"logs no further step of this run (from step {row['step']} on)")

    def close(self) -> None:
        for name, t in self.trackers.items():
            try:
                t.close()
            except (OSError, ArtifactError) as e:
                self._said(name, e, "may lack the last steps it was given")
        self.trackers = {}

    def _drop(self, name: str) -> None:
        """A tracker that failed, closed as far as it can be (its files are as full as the disk)."""
        with contextlib.suppress(OSError, ArtifactError):
            self.trackers.pop(name).close()

    def _said(self, name: str, e: OSError | ArtifactError, what: str) -> None:
        cannot = str(e) if isinstance(e, ArtifactError) else (
            f"cannot write {self.run_dir / WRITES[name]} ({e.strerror or first_line(e)})")
        self.warn(f"{cannot}, so --report-to {name} {what}; metrics.parquet holds every step")
