"""The journal of a `sparrow rollout` in progress, `OUT.partial/` beside its output, from which a stopped
run (a crash, a preempted machine, Ctrl-C, SIGTERM) continues where it stopped (`--resume`).

Decisions:
- What is journaled: the prompts whose every sample has finished, their rewards scored, as parts
  `part-NNNNN.parquet`, each a valid `rollouts` artifact written atomically (`write_artifact`: a hidden
  temporary, then a rename), so a part is there whole or not at all. At most one part per `interval`
  seconds (0: after every engine step in which a prompt finished).
- When the run stops on an exception (an interrupt, SIGTERM), whatever has finished is written before the
  exception goes on, unscored: a reward can take seconds a sample (code run in a sandbox), more than a
  scheduler waits between SIGTERM and SIGKILL, so the interrupt writes the samples alone, at once, as
  `unscored-NNNNN.parquet`, a `rollouts` artifact whose rewards are null. Only `part-*` files are the
  rollouts finished so far (what `sparrow sql` reads); `--resume` scores an unscored file first (its
  samples are not drawn again) and writes it as the part of its number, then removes it, so an unscored
  file beside the part of its number is one whose removal an interrupt stopped, and is ignored. A
  second interrupt stops the write or that scoring where it is, the journal whole: what it had not
  written is sampled again with the same seeds. A SIGKILL loses what was not yet in a file, nothing more.
- A part's metadata is the run's (as its artifact records it), `prompt_rows` (the indices of its
  prompts in the prompt set, ascending; their samples follow in sample order) and `engine_stats`: the
  engine's `EngineStats` since the previous part (counts and seconds as differences, peaks as the run's
  so far), with `reward_seconds` its scoring took. So a resumed run's summary adds up the engine time of
  the work it kept (`merged_stats`: sums add, peaks take the largest). The engine counts its steps, not
  each sample's, so a part's counters include the steps of samples in flight when it was written; those
  an interrupt threw away are counted again when the resume samples them.
- `manifest.json` records the run's identity (`Manifest`): everything that decides the samples and their
  rewards, nothing that changes only speed (the batch, the pool's size, prefill chunking, CUDA graphs).
  A resume needs an equal manifest; the CPU thread count is recorded beside it, and another one is a
  note, not a refusal: it changes the last bits of a CPU's logprobs, not what the run is.
- A resumed run keeps the prompts of the parts as they were written and samples the rest with their
  row indices as request ids, so each sample has the seed of an uninterrupted run; the artifact holds
  every row in prompt order, then sample order.
- One process writes a journal (`hold_folder`, from its start to its end). A run that completes removes
  the folder after writing its artifact; one that stops before its first file removes it too, as a
  journal without files holds nothing to resume. Only `part-*.parquet` and `unscored-*.parquet` files
  are read: the hidden temporaries a killed write left are ignored (and removed by the next write of
  that name).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import pyarrow as pa

from sparrow.schemas import SCHEMAS, ArtifactError, artifact_metadata, read_artifact, write_artifact
from sparrow.schemas.io import process_alive, write_bytes
from sparrow.schemas.locations import (
    JOURNAL_MANIFEST,
    JOURNAL_PART,
    LOCK_NAME,
    hidden_stem,
    hold_folder,
    journal_file_number,
    journal_folder,
    journal_parts,
    journal_unscored,
    release_folder,
)
from sparrow.schemas.signals import held_signals

from .core.fingerprints import sha256_json
from .engine.engine import EngineStats
from .engine.sequence import Completion
from .tasks.base import RewardError

MANIFEST = JOURNAL_MANIFEST
MANIFEST_KEY = "journal_manifest"  # the manifest in the finished artifact's metadata
WRITER = "sparrow rollout"
JOURNAL_VERSION = 1
PEAKS = ("max_running", "peak_pages", "kv_tokens_peak", "dense_kv_tokens_peak")  # merged by max, not sum


class JournalRefused(ArtifactError):
    """A journal that this run may not continue or replace as asked; one sentence."""


class AlreadyComplete(Exception):
    """`--resume` of a run whose artifact is written: nothing to do; the message says so."""


class RolloutInterrupted(KeyboardInterrupt):
    """An interrupt that left the run resumable; the message says what the journal keeps."""


def shown(folder: Path) -> str:
    """A journal folder as messages name it, with its slash: `OUT.partial/`."""
    return f"{folder}/"


# ---------------------------------------------------------------- the run's identity

@dataclass(frozen=True)
class Manifest:
    """What decides a run's samples and rewards; two runs with equal manifests (`threads` aside) sample the
    same rows. Field order is the order in which a difference is named."""

    model: str
    prompts: int
    prompts_sha256: str  # prompt_id, token ids, task, answer and metadata of every row, in order
    samples: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    ignore_eos: bool
    kv_policy: str  # the policy's spec (a schedule's by its content, `schedule_sha256`)
    schedule_sha256: str
    dense_layers: tuple[int, ...]
    page_size: int
    speculate: int
    dtype: str
    device: str
    adapter_sha256: str
    reward: str | None
    reward_fn: str | None
    reward_fn_sha256: str
    raw_prompts: bool
    model_files_sha256: str = ""  # a checkpoint's files (names, sizes, times): one rewritten since differs
    reward_kwargs: str | None = None  # --reward-kwargs as recorded (`reward_kwargs_text`)
    # what changes how rows share a step, not what a run is: a note when it differs, as the last bits of a
    # logprob may follow it (torch's CPU threads, the batch, the pool, the prefill's chunk)
    threads: int = field(default=0, compare=False)
    max_batch: int = field(default=0, compare=False)
    kv_pages: int | None = field(default=None, compare=False)
    max_prefill_tokens: int = field(default=0, compare=False)

    def to_json(self) -> bytes:
        return json.dumps(self.record(), indent=1).encode() + b"\n"

    def record(self) -> dict:
        """The manifest as JSON values, as the journal and the finished artifact's metadata keep it."""
        return {"journal": JOURNAL_VERSION, **asdict(self)}

    @classmethod
    def of(cls, raw: object) -> Manifest:
        """A manifest from its `record`; ValueError, TypeError or KeyError when it is not one."""
        if not isinstance(raw, dict) or raw.get("journal") != JOURNAL_VERSION:
            raise ValueError("not a rollout journal's manifest")
        raw = {k: v for k, v in raw.items() if k != "journal"}
        raw["dense_layers"] = tuple(raw["dense_layers"])
        return cls(**raw)

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        """The manifest in `folder`; JournalRefused naming it when it is missing or not one of ours."""
        path = folder / MANIFEST
        try:
            return cls.of(json.loads(path.read_bytes()))
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise JournalRefused(f"{path} cannot be read as a rollout journal's manifest ({e}); pass --force "
                                 "to start the run over") from None

    def difference(self, now: Manifest, ignoring: Sequence[str] = ()) -> str | None:
        """The first field (in field order) in which `now` differs from this manifest, but for `ignoring`;
        None when equal."""
        for f in fields(self):
            if f.compare and f.name not in ignoring and getattr(self, f.name) != getattr(now, f.name):
                return f.name
        return None

    @property
    def scorer(self) -> dict[str, str | None]:
        """What scores the rewards, under the keys each part's metadata records it by."""
        return {name: getattr(self, name) for name in REWARD_FIELDS}

    def scored_by(self) -> str:
        """The reward as its flags name it, for a note."""
        if self.reward_fn:
            kwargs = f" with --reward-kwargs '{self.reward_kwargs}'" if self.reward_kwargs else ""
            return f"--reward-fn {self.reward_fn} (sha256 {self.reward_fn_sha256[:12]}){kwargs}"
        return f"--reward {self.reward}" if self.reward else "each prompt's task scorer"

    def speed_notes(self, now: Manifest, folder: Path) -> list[str]:
        """What a resume says where `now` runs the rows otherwise than this manifest's run did."""
        flags = {"max_batch": "--max-num-seqs", "kv_pages": "--kv-pages",
                 "max_prefill_tokens": "--max-num-batched-tokens"}
        if now.device == "cpu":
            flags = {"threads": "--threads", **flags}
        changed = [(flag, getattr(self, name), getattr(now, name)) for name, flag in flags.items()
                   if getattr(self, name) != getattr(now, name)]
        if not changed:
            return []
        was = ", ".join(f"{flag} {old}" for flag, old, _ in changed)
        has = ", ".join(f"{flag} {new}" for flag, _, new in changed)
        return [f"--resume: {shown(folder)} was written with {was} and this run has {has}; rows that share a "
                "step otherwise may round logprobs otherwise in their last bits, so the resumed rows are "
                "samples of the same seeds but not bit for bit those of an uninterrupted run (the same flags "
                "keep them)"]

    def describe(self, name: str) -> str:
        """The value of field `name` as a message shows it."""
        value = getattr(self, name)
        if name in ("prompts", "prompts_sha256"):
            return f"{self.prompts} prompts (sha256 {self.prompts_sha256[:12]})"
        if name.endswith("_sha256"):
            return f"sha256 {value[:12]}" if value else "none"
        if isinstance(value, bool):
            return "on" if value else "off"
        if name == "dense_layers":
            return ",".join(map(str, value)) or "none"
        return "none" if value is None else str(value)


def check_not_complete(output: Path, manifest: Manifest) -> None:
    """`--resume` with no journal: AlreadyComplete when `output` is the finished artifact of a run with this
    manifest (a retry after the run ended), so that it is not sampled again; JournalRefused naming the flag
    where it is the finished artifact of a run with other flags, which --resume would replace unasked."""
    try:
        recorded = Manifest.of(artifact_metadata(output).get(MANIFEST_KEY)) if output.is_file() else None
    except (ArtifactError, OSError, ValueError, TypeError, KeyError):
        recorded = None
    if recorded is None:
        return
    name = recorded.difference(manifest)
    if name is None:
        raise AlreadyComplete(f"{output} is the finished artifact of a run with these flags, so there is "
                              "nothing to resume; drop --resume to sample it again")
    raise JournalRefused(f"--resume: {output} is the finished artifact of a run with {FLAGS[name]} "
                         f"{recorded.describe(name)}, and this run has {manifest.describe(name)}, so there "
                         "is no interrupted run to resume; drop --resume to sample it again with these "
                         "flags, or give another -o")


# what scores the rewards: a resume may change it, scoring the journal's prompts again (`Journal.open`)
REWARD_FIELDS = ("reward", "reward_fn", "reward_fn_sha256", "reward_kwargs")

# what each field is on the command line, for the sentence that names a difference
FLAGS = {"model": "--model", "prompts": "--prompts, --max-prompts or --filter-overlong-prompts",
         "prompts_sha256": "--prompts, --max-prompt-length or --truncation",
         "samples": "--samples",
         "max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
         "top_k": "--top-k", "seed": "--seed", "ignore_eos": "--ignore-eos",
         "kv_policy": "the sparsity (--budget/--schedule/--kv-compression)",
         "schedule_sha256": "the --schedule's budgets at", "dense_layers": "dense layers",
         "page_size": "pages of", "speculate": "--speculate", "dtype": "--dtype", "device": "--device",
         "adapter_sha256": "--adapter", "reward": "--reward", "reward_fn": "--reward-fn",
         "reward_fn_sha256": "a --reward-fn file of other code", "raw_prompts": "--raw-prompts",
         "model_files_sha256": "the --model checkpoint's files at", "reward_kwargs": "--reward-kwargs"}


def prompts_sha256(rows: Sequence[dict], task: bool = True) -> str:
    """The digest of the prompt rows as the run samples and rewards them; without their `task` where a
    --reward or --reward-fn scores them (its name stands in the rows' task, and the manifest's reward
    fields record it, which a resume may change)."""
    return sha256_json([[r["prompt_id"], [int(t) for t in r["prompt_token_ids"]],
                         r.get("task") if task else None, r.get("answer"), r.get("metadata")]
                        + ([r["row"]] if r.get("row", i) != i else [])  # its place in its file where it seeds
                        for i, r in enumerate(rows)])


def adapter_sha256(lora) -> str:
    """The digest of a `LoraWeights`' weights (scale, rank, the modules' own scales where they have them,
    every module's A and B); "" for none."""
    if lora is None:
        return ""
    own = [sorted(lora.scales.items())] if lora.scales else []  # kept out when empty: older digests hold
    h = hashlib.sha256(json.dumps([lora.alpha, lora.r, sorted(lora.modules), *own]).encode())
    for name in sorted(lora.modules):
        for t in lora.modules[name]:
            h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------- engine stats per part

def stats_since(now: EngineStats, before: dict[str, float]) -> dict[str, float]:
    """The engine's counts and seconds since `before` (an earlier `stats_since(...)` total, {} at the
    start), and its peaks so far; lists (per-step times) are left out."""
    out: dict[str, float] = {}
    for f in fields(now):
        value = getattr(now, f.name)
        if isinstance(value, bool):
            out[f.name] = value
        elif isinstance(value, int | float):
            out[f.name] = value if f.name in PEAKS else value - before.get(f.name, 0)
    return out


def stats_total(now: EngineStats) -> dict[str, float]:
    return stats_since(now, {})


def merged_stats(parts: Sequence[dict], this_run: EngineStats) -> EngineStats:
    """`this_run`'s stats with the parts' (kept from earlier runs) added: sums add, peaks the largest."""
    merged = EngineStats(speculative=this_run.speculative)
    for f in fields(merged):
        values = [getattr(this_run, f.name)] + [p[f.name] for p in parts if f.name in p]
        if isinstance(values[0], bool):
            setattr(merged, f.name, any(values))
        elif isinstance(values[0], int | float):
            setattr(merged, f.name, max(values) if f.name in PEAKS else sum(values))
        else:  # per-step lists: this run's steps only (parts keep counts, not steps)
            setattr(merged, f.name, values[0])
    return merged


# ---------------------------------------------------------------- what a journal holds

@dataclass(frozen=True)
class Resumed:
    """What `--resume` found: the journal, the prompts it keeps of the run's, and what to note."""

    folder: Path
    kept: int
    total: int
    notes: list[str]
    unscored: int = 0  # of the kept prompts, those whose rewards the resume scores first


@dataclass
class Chunk:
    """Rows of whole prompts: `table` holds the samples of `indices[0]`, then of `indices[1]`, ...; its
    file in the journal is the part of its `number`, or the unscored file when not `scored`."""

    indices: list[int]
    table: pa.Table
    stats: dict[str, float] = field(default_factory=dict)
    reward_seconds: float | None = None
    scored: bool = True
    number: int = 0
    rescored: bool = False  # a part scored by another reward than this run's: scored again, as if unscored

    @property
    def name(self) -> str:
        return file_name(self.number, self.scored)


def file_name(number: int, scored: bool) -> str:
    """The journal's file of this number: a part, or an unscored file."""
    return f"{'part' if scored else 'unscored'}-{number:05d}.parquet"


@dataclass(frozen=True)
class Found:
    """A journal folder as found on disk: its manifest (None: unreadable), its parts and unscored files (in
    the order they were written) and the prompts they hold."""

    folder: Path
    manifest: Manifest | None
    files: list[Path]
    prompts_done: int

    @property
    def total(self) -> str:
        return "" if self.manifest is None else f" of {self.manifest.prompts}"


def part_files(folder: Path) -> list[Path]:
    """The parts of a journal, in the order they were written."""
    return journal_parts(folder) or []


def journal_files(folder: Path) -> list[Path]:
    """What a resume reads of a journal: its parts and its unscored files, in the order they were written."""
    return sorted([*part_files(folder), *journal_unscored(folder)], key=journal_file_number)




def find(folder: Path) -> Found | None:
    """The journal at `folder` (None: there is none). A folder that is not a journal's (a file, or a
    folder with files but no manifest) is refused: nothing of someone else's is read back or removed."""
    if not folder.exists() and not folder.is_symlink():
        return None
    if not folder.is_dir():
        raise JournalRefused(f"{folder} is in the way of this run's journal {shown(folder)} and is not one; "
                             "move it away, or choose another -o")
    names = [p.name for p in folder.iterdir() if not p.name.startswith(".")]  # not the lock, temporaries
    if names and MANIFEST not in names:
        raise JournalRefused(f"{shown(folder)} holds no {MANIFEST}, so it is not the journal of a rollout; "
                             "move it away, or choose another -o")
    try:
        manifest = Manifest.read(folder) if names else None
    except JournalRefused:  # a resume names it; --force replaces it
        manifest = None
    files = journal_files(folder)
    return Found(folder, manifest, files, sum(_prompts_in(p) for p in files))


def _prompts_in(part: Path) -> int:
    """The prompts a part's footer names (0 for one that cannot be read: a resume names it)."""
    try:
        return len(artifact_metadata(part).get("prompt_rows") or ())
    except (ArtifactError, OSError):
        return 0


def check_folder(output: str | Path, resume: bool, force: bool) -> Found | None:
    """Before any work: the journal beside `output` (returned; None: there is none) is not being written
    by another process, and one that holds finished prompts is continued (`resume`) or started over
    (`force`), never replaced unasked. Changes nothing on disk."""
    folder = journal_folder(output)
    found = find(folder)
    if found is None:
        return None
    hold_folder(folder, WRITER, "another -o")  # refuses when another run writes it
    release_folder(folder)
    if found.files and not resume and not force:
        raise JournalRefused(f"an interrupted run left {found.prompts_done}{found.total} prompts in "
                             f"{shown(folder)}; pass --resume to continue it, or --force to start over")
    return found


# (prompt rows, the completions of each) -> their rollouts columns, rewards null
Columns = Callable[[list[dict], list[list[Completion]]], dict]
Scored = Callable[[int, int], None]  # (samples scored, of how many)
# (the prompt row of each row, a rollouts table, on_scored) -> the table with its rewards, the seconds it took
Score = Callable[[list[dict], pa.Table, "Callable[[int, int], None] | None"], tuple[pa.Table, "float | None"]]


class Journal:
    """The journal of this run: the chunks kept from an earlier run, the files this run writes, and the
    prompts finished since the last one."""

    def __init__(self, folder: Path, manifest: Manifest, rows: Sequence[dict], kept: list[Chunk],
                 fresh: bool, interval: float, metadata: dict):
        self.folder, self.manifest, self.rows = folder, manifest, rows
        self.kept, self.written = kept, []  # chunks from earlier runs' files, and from this run's
        self.fresh = fresh  # no journal of this run's identity was there: (re)made at `start`
        self.interval, self.metadata = interval, metadata
        self.pending: dict[int, list[Completion]] = {}
        self.next_part = 0 if fresh else 1 + max(journal_file_number(p) for p in journal_files(folder))
        self.columns: Columns | None = None
        self.score: Score | None = None
        self.engine_stats: Callable[[], EngineStats] | None = None
        self.last_stats: dict[str, float] = {}
        self.last_write = time.monotonic()
        self.held = False
        self.new_manifest = False  # a resume with another reward: `start` records this run's

    # ------------------------------------------------------------ opening

    @classmethod
    def open(cls, output: str | Path, manifest: Manifest, rows: Sequence[dict], resume: bool, force: bool,
             interval: float, metadata: dict) -> tuple[Journal, list[str]]:
        """The journal of a run writing `output`, and the notes a resume gives (another thread count).
        With `resume`, an earlier journal is checked (its manifest equal to `manifest`, every file a
        rollouts artifact of whole prompts of `rows`) and its prompts kept; without, or where there is
        none, the run starts from the first prompt (`check_folder`'s rule). Nothing on disk changes here
        (`start` does)."""
        found = check_folder(output, resume, force)
        folder = journal_folder(output)
        if not resume or found is None or not found.files:
            if resume:
                check_not_complete(Path(output), manifest)
            return cls(folder, manifest, rows, [], True, interval, metadata), []
        saved = found.manifest or Manifest.read(folder)
        name = saved.difference(manifest, ignoring=REWARD_FIELDS)
        if name is not None:
            again = "drop --resume (keeping --force)" if force else "pass --force"
            raise JournalRefused(f"{shown(folder)} was written with {FLAGS[name]} {saved.describe(name)}, "
                                 f"this run has {manifest.describe(name)}; rerun with the same flags, or "
                                 f"{again} to start over")
        kept = _read_parts(found.files, rows, manifest.samples, manifest.scorer)
        notes = saved.speed_notes(manifest, folder)
        again = sum(len(c.indices) for c in kept if c.rescored)
        if again:
            notes.append(f"--resume: {again} of the journal's prompts were scored with {saved.scored_by()}; "
                         f"this run scores them again, first, with {manifest.scored_by()}")
        journal = cls(folder, manifest, rows, kept, False, interval, metadata)
        journal.new_manifest = saved != manifest
        return journal, notes

    @property
    def kept_prompts(self) -> int:
        return sum(len(c.indices) for c in self.kept)

    @property
    def unscored_prompts(self) -> int:
        """The journal's prompts whose rewards are still to score."""
        return sum(len(c.indices) for c in [*self.kept, *self.written] if not c.scored)

    @property
    def todo(self) -> list[int]:
        """The row indices still to sample, in order."""
        done = {i for c in self.kept for i in c.indices}
        return [i for i in range(len(self.rows)) if i not in done]

    def start(self) -> None:
        """Hold the folder for this run; a fresh journal replaces whatever journal was there (--force:
        every check has passed) and records the manifest."""
        self.folder.mkdir(parents=True, exist_ok=True)
        hold_folder(self.folder, WRITER, "another -o")
        self.held = True
        _remove_abandoned(self.folder)
        if self.fresh:  # the old manifest goes last (replaced whole), so no part is ever left without one
            for p in self.folder.iterdir():
                if p.name not in (LOCK_NAME, MANIFEST):
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            write_bytes(self.folder / MANIFEST, self.manifest.to_json())
        elif self.new_manifest:  # each part records its own reward, so this may come first
            write_bytes(self.folder / MANIFEST, self.manifest.to_json())
        for p in journal_unscored(self.folder, stale=True):
            p.unlink()

    def close(self, completed: bool) -> None:
        """Let go of the folder, removing it when the run completed (its artifact is written) or when it
        holds no part (nothing to resume)."""
        if not self.held:
            return
        discard = completed or not journal_files(self.folder)
        release_folder(self.folder)
        self.held = False
        if discard:
            _remove(self.folder)

    # ------------------------------------------------------------ recording

    def score_kept(self, score: Score, on_scored: Callable[[int, int], None] | None = None) -> None:
        """Score the kept prompts that an interrupt journaled unscored (`on_scored` following); each file is
        then written as the part of its number and removed. An interrupt meanwhile leaves it as it was."""
        for k, chunk in enumerate(self.kept):
            if chunk.scored:
                continue
            table, seconds = score(self._prompt_rows(chunk.indices), chunk.table, on_scored)
            self.kept[k] = self._write(replace(chunk, table=table, reward_seconds=seconds, scored=True))
            (self.folder / chunk.name).unlink(missing_ok=True)

    @contextmanager
    def recording(self, engine_stats: Callable[[], EngineStats], columns: Columns, score: Score,
                  on_step: Callable[[int, int], None] | None,
                  on_scored: Callable[[int, int], None] | None = None) -> Iterator[Callable]:
        """The block in which the engine samples: it yields the `on_step` to give the engine (a part is
        written after a step once `interval` seconds have passed since the last one, then `on_step` runs).
        At its end the prompts finished since the last part are the last part (`on_scored` following
        their rewards), so that every finished prompt is in a part before the artifact is written. On an
        exception the prompts finished so far are written first, unscored (at once, however slow the
        reward); an interrupt goes on as `RolloutInterrupted`, and a reward's own error as itself, each
        saying what the journal keeps (a resume with the reward fixed scores them, and the parts the
        broken reward had scored, again)."""
        self.engine_stats, self.columns, self.score = engine_stats, columns, score
        self.last_write = time.monotonic()
        counted = self._over_the_run(on_scored)

        def step(new: int, finished: int) -> None:
            if self.pending and time.monotonic() - self.last_write >= self.interval:
                self.flush(counted)  # a slow reward scores while the engine waits: its progress shows
            if on_step is not None:
                on_step(new, finished)

        try:
            yield step
            self.flush(counted)
        except BaseException as e:
            try:
                self.flush(scored=False)
            except Exception:  # the run's own error (or its interrupt) is the one to report
                pass
            if isinstance(e, KeyboardInterrupt):
                raise self.interrupted() from None
            if isinstance(e, RewardError) and self.journaled_prompts:
                raise RewardError(f"{e}; {self.keeps()}, so once the reward is fixed, run the same command "
                                  "with --resume: it scores them with the fixed reward and samples the rest"
                                  ) from None
            raise

    def _over_the_run(self, on_scored: Scored | None) -> Scored | None:
        """`on_scored` counting over the run's samples to score: a part's (done, total) after the samples of
        the parts this run scored before it."""
        if on_scored is None:
            return None
        total = self.manifest.samples * (len(self.rows) - self.kept_prompts)
        before = [0]  # the samples of the parts scored so far

        def count(done: int, part: int) -> None:
            on_scored(before[0] + done, total)
            if done == part:
                before[0] += part
        return count

    def finished(self, index: int, completions: list[Completion]) -> None:
        """The engine's `on_prompt`: every sample of row `index` has finished."""
        self.pending[index] = completions

    def flush(self, on_scored: Callable[[int, int], None] | None = None, scored: bool = True) -> None:
        """The prompts finished since the last part, scored and written as the next part (not `scored`: as
        the next unscored file). They leave `pending` before the write, and come back only if it was not
        written, so that an interrupt at any point never writes a prompt into two files; so does the
        file's number, so that no file an interrupt left is given the number of another."""
        if not self.pending:
            return
        pending, self.pending = self.pending, {}
        indices = sorted(pending)
        number, self.next_part = self.next_part, self.next_part + 1
        path = self.folder / file_name(number, scored)
        chunk = None
        try:
            table = _conformed(pa.table(self.columns([self.rows[i] for i in indices],
                                                     [pending[i] for i in indices])))
            reward_seconds = None
            if scored:
                table, reward_seconds = self.score(self._prompt_rows(indices), table, on_scored)
            now = self.engine_stats()
            stats, since = stats_total(now), stats_since(now, self.last_stats)
            chunk = Chunk(indices, table, since, reward_seconds, scored, number)
            self._write(chunk)
        except BaseException:
            if chunk is not None and path.exists():  # put in place before the interrupt came: it is kept
                self.written.append(chunk)
            else:
                self.pending, self.next_part = {**pending, **self.pending}, number
            raise
        self.written.append(chunk)
        self.last_stats, self.last_write = stats, time.monotonic()

    def _write(self, chunk: Chunk) -> Chunk:
        """`chunk` written as its file: a rollouts artifact with the run's metadata and the chunk's."""
        meta = {**self.metadata, "part": chunk.number, "prompt_rows": chunk.indices,
                "engine_stats": chunk.stats, "reward_seconds": chunk.reward_seconds}
        write_artifact(chunk.table, self.folder / chunk.name, "rollouts", meta)
        return chunk

    def _prompt_rows(self, indices: list[int]) -> list[dict]:
        """The prompt row of each row of a chunk of these prompts."""
        return [self.rows[i] for i in indices for _ in range(self.manifest.samples)]

    @property
    def journaled_prompts(self) -> int:
        """The prompts in the journal's files: kept from an earlier run and written by this one."""
        return self.kept_prompts + sum(len(c.indices) for c in self.written)

    def keeps(self) -> str:
        """What the journal keeps, as a clause."""
        return (f"{shown(self.folder)} keeps the {self.journaled_prompts} of {len(self.rows)} prompts that "
                "had finished")

    def interrupted(self) -> RolloutInterrupted:
        if not self.journaled_prompts:
            return RolloutInterrupted("no prompt had been journaled yet, so nothing was kept")
        unscored = self.unscored_prompts
        first = f", which scores the rewards of {unscored} of them first" if unscored else ""
        return RolloutInterrupted(f"{self.keeps()}; run the same command with --resume to continue{first}")

    # ------------------------------------------------------------ the whole run

    def result(self) -> tuple[pa.Table, float | None]:
        """Every row in prompt order, then sample order, from the kept parts and this run's (`recording`
        leaves no finished prompt outside a part); and the seconds their scoring took (None: nothing was
        scored)."""
        chunks = [*self.kept, *self.written]
        seconds = [c.reward_seconds for c in chunks if c.reward_seconds is not None]
        n = self.manifest.samples
        by_prompt: dict[int, pa.Table] = {}
        for c in chunks:
            for j, i in enumerate(c.indices):
                by_prompt[i] = c.table.slice(j * n, n)
        table = pa.concat_tables([by_prompt[i] for i in range(len(self.rows))])
        return table, (math.fsum(seconds) if seconds else None)

    def stats(self, this_run: EngineStats) -> EngineStats:
        """The run's engine stats: this run's, with those of the parts kept from earlier runs."""
        return merged_stats([c.stats for c in self.kept], this_run)


def _remove(folder: Path) -> None:
    """Remove a journal folder whole: moved to a hidden sibling first, so that an interrupt while its files
    are deleted never leaves parts without their manifest under the journal's name; an interrupt is held
    back until they are (a killed process's sibling is removed by the next run, `_remove_abandoned`)."""
    gone = folder.with_name(f"{_removed_prefix(folder)}{os.getpid()}")
    with held_signals():
        try:
            folder.rename(gone)
        except OSError:
            gone = folder
        shutil.rmtree(gone, ignore_errors=True)


def _removed_prefix(folder: Path) -> str:
    return f".{hidden_stem(folder)}.removed-"


def _remove_abandoned(folder: Path) -> None:
    """The hidden siblings that a process killed while it removed this journal left (`_remove`)."""
    prefix = _removed_prefix(folder)
    for p in folder.parent.glob(f"{prefix}*") if folder.parent.is_dir() else ():
        pid = p.name[len(prefix):]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def _conformed(table: pa.Table) -> pa.Table:
    """A table of the rollouts schema, without metadata, so chunks of any origin concatenate."""
    return SCHEMAS["rollouts"].conform(table, "the rollouts", fill_missing=True).replace_schema_metadata(None)


def _read_parts(parts: list[Path], rows: Sequence[dict], samples: int, scorer: dict) -> list[Chunk]:
    """The parts and unscored files of an earlier run, each checked: a rollouts artifact whose rows are the
    samples of the prompts its metadata names, each prompt in one file only. A part that its metadata says
    another reward than `scorer` scored is read as unscored (`rescored`): the resume scores it again."""
    chunks, seen = [], {}  # prompt row -> the file that holds it
    for part in parts:
        try:
            table = read_artifact(part, "rollouts")
        except ArtifactError as e:
            raise JournalRefused(f"{e}; it is a part of the interrupted run's journal: remove it to resume "
                                 "without its prompts, or pass --force to start over") from None
        meta = artifact_metadata(table)
        indices = meta.get("prompt_rows")
        if not isinstance(indices, list) or not all(isinstance(i, int) for i in indices):
            raise JournalRefused(f"{part} has no prompt_rows in its metadata, so it is not a part of a "
                                 "rollout journal; remove it, or pass --force to start over")
        if (again := next((i for i in indices if i in seen), None)) is not None:
            raise JournalRefused(f"{part} holds prompt row {again} of --prompts, which {seen[again].name} "
                                 "holds already (a copied part?); remove one of them to resume, or pass "
                                 "--force to start over")
        ids = table.column("prompt_id").to_pylist()
        expected = [rows[i]["prompt_id"] for i in indices if 0 <= i < len(rows) for _ in range(samples)]
        sample = table.column("sample").to_pylist()
        whole = sample == list(range(samples)) * len(indices)
        if len(indices) != len(set(indices)) or ids != expected or not whole:
            raise JournalRefused(f"{part} does not hold the {samples} samples of each of the prompts it "
                                 "names (rows of --prompts), each once; remove it to resume without it, or "
                                 "pass --force to start over")
        seen.update(dict.fromkeys(indices, part))
        stats = meta.get("engine_stats")
        scored = JOURNAL_PART.fullmatch(part.name) is not None
        other = scored and any(k in meta and meta[k] != v for k, v in scorer.items())
        chunks.append(Chunk(indices, _conformed(table), stats if isinstance(stats, dict) else {},
                            meta.get("reward_seconds"), scored and not other, journal_file_number(part),
                            rescored=other))
    return chunks
