"""The tail criterion put to a test: does training stability track the tail of alpha, its mean, or the budget?

One position bin makes tail, mean and budget one variable. Here the prompts come in two lengths (passkey
at --contexts tokens, half each), so their answers fall in two position bins of --bin-width, and a
schedule gives each bin its own budget (non-decreasing: the short prompts' bin at most the long
ones'). From one profile the bench picks schedules whose tails differ at a similar mean alpha and whose
means differ at a similar tail (`designs`), trains each without a correction and with TIS, three seeds,
plus dense, for --steps, and labels every run by what training did to it (stages/calibrate.py: the dense
held-out accuracy against its own start and against the dense run of its seed, its own curves, and its
reward once the sampler's own step-0 gap is added back; never its mismatch). Then:

- `--distill` (on by default, after the main runs): the most aggressive design with DistillSparse's online
  adapter on the sparse actor (TIS), each seed, beside the same design without it;
- `matrix`: the base model and the final policies of dense and of two designs, each scored under the
  dense sampler and block top-k at several budgets on the held-out prompts (sampled reward and greedy
  accuracy), so a run's reward gap is split into the policy's part and the sampler's;
- `sparrow calibrate-threshold` on all runs: identified set, interval over prompts, the mean's and the
  KV read's verdicts, the labels under other margins;
- `figure`: the reward gap and the dense-eval change against tail, mean and KV read, every run, seeds
  marked (docs/tail-test.png with --figure).

Every stage is a file or a run directory under --out and is skipped when complete (a run stopped midway
resumes from its checkpoint), so the same command continues a stopped bench (Ctrl-C: one line says what
is kept). The settings that decide a stage are recorded beside it (NAME.settings.json, bench/common.py),
and a stage made with other settings is refused before any work, naming the setting: a run may change
only --steps, --eval-every and --checkpoint-every, as `sparrow train --resume` allows. `--phase` stops
after a phase; `--parallel 2` trains two runs at a time.

    .venv/bin/python bench/tail_test.py --parallel 2          # everything (several hours on 2 cores)
    .venv/bin/python bench/tail_test.py --phase designs       # prompts, profile, the chosen schedules
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from itertools import combinations_with_replacement
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from common import SPARROW, default_results, flags, profile_once, record_settings, reuse_or_refuse, sparrow

PHASES = ("designs", "train", "matrix", "calibrate", "figure")
STOP_GRACE_S = 60  # how long a stopped bench waits for a run to write its checkpoint before interrupting it


# ---------------------------------------------------------------- prompts, profile, designs


# what decides each stage's output (bench/common.py: reuse_or_refuse); each includes what its inputs' did


def prompt_settings(args) -> dict[str, object]:
    return flags(args, "model", "contexts", "train_prompts", "eval_prompts")


def profile_settings(args) -> dict[str, object]:
    """The profile's, and the designs' and their schedules' (all three follow from the profile)."""
    return prompt_settings(args) | flags(args, "budgets", "samples", "max_new_tokens", "bin_width")


def run_settings(args) -> dict[str, object]:
    """A run's, besides what its folder's name says (design, correction, seed, DistillSparse): all but
    --steps, --eval-every and --checkpoint-every, which `sparrow train --resume` lets change."""
    return prompt_settings(args) | flags(args, "prompts_per_step", "samples", "max_new_tokens", "lr",
                                         "lora_rank", "bin_width", "alpha_sequences")


def matrix_settings(args) -> dict[str, object]:
    """The matrix's: its rows are the final policies of runs of --steps (its budgets are in its rows)."""
    return run_settings(args) | flags(args, "steps")


def prompt_files(args, out: Path) -> tuple[Path, Path]:
    """Train and held-out prompts, half at each context length (seeds 0 and 1: disjoint sets)."""
    from sparrow.schemas import write_artifact
    from sparrow.stages.model.loading import spec_tokenizer
    from sparrow.stages.tasks import TaskError, make_prompts

    train, held_out = out / "prompts.parquet", out / "eval-prompts.parquet"
    settings = prompt_settings(args)
    if all([reuse_or_refuse(path, settings) for path in (train, held_out)]):  # both checked
        return train, held_out
    tok = spec_tokenizer(args.model)
    contexts = [int(c) for c in args.contexts.split(",")]
    for path, n, seed in ((train, args.train_prompts, 0), (held_out, args.eval_prompts, 1)):
        rows = []
        for i, context in enumerate(contexts):
            try:
                rows += make_prompts("passkey", n // len(contexts), seed * 100 + i, tok,
                                     context_tokens=context)
            except TaskError as e:
                raise SystemExit(str(e).replace("--context-tokens", "--contexts")) from None
        order = np.random.default_rng(seed).permutation(len(rows))  # lengths mixed in every step
        record_settings(path, settings)
        write_artifact([rows[i] for i in order], path, "prompts")
    return train, held_out


@dataclass(frozen=True)
class Design:
    """A two-bin schedule (0 = dense) and its statistics on the profile."""

    budgets: tuple[int, int]
    tail: float
    mean: float
    kv_read: float

    @property
    def name(self) -> str:
        return "s" + "-".join(str(b or "dense") for b in self.budgets)


def candidates(args, mismatch: Path) -> list[Design]:
    """Every non-decreasing pair of profiled budgets (and dense) for the two bins, with its statistics."""
    from sparrow.schemas import read_artifact
    from sparrow.stages.calibrate import ProfileTokens, tail_of
    from sparrow.stages.core.definitions import TAIL_QUANTILE
    from sparrow.stages.core.schedule import Schedule

    tokens = ProfileTokens.from_table(read_artifact(mismatch, "mismatch"))
    levels = [*(int(b) for b in args.budgets.split(",")), 0]
    out = []
    for b0, b1 in combinations_with_replacement(levels, 2):
        if b1 == 0 and b0 == 0:
            continue
        alpha, kv, _ = tokens.at(Schedule((0, args.bin_width), (b0, b1)))
        out.append(Design((b0, b1), tail_of(alpha, tokens.bins, TAIL_QUANTILE), float(alpha.mean()),
                          float(kv.mean())))
    return out


def choose(designs: list[Design], most_aggressive: int) -> list[Design]:
    """Schedules that pull tail and mean apart: the pair with the most different tails at mean alpha
    within 0.02, the pair with the most different means at tails within 0.03, and the uniform schedule at
    the smallest budget (the most aggressive, to see an instability if there is one)."""
    chosen: list[Design] = []
    pairs = [(a, b) for i, a in enumerate(designs) for b in designs[i + 1:]]
    for key, other, tol, what in (("tail", "mean", 0.02, "mean alpha"), ("mean", "tail", 0.03, "tails")):
        close = [p for p in pairs if abs(getattr(p[0], other) - getattr(p[1], other)) <= tol]
        if not close:
            raise SystemExit(f"no two schedules of the profiled budgets have {what} within {tol}, so none "
                             f"pulls the {key} apart at a similar {other}; profile more budgets (--budgets)")
        a, b = max(close, key=lambda p: abs(getattr(p[0], key) - getattr(p[1], key)))
        chosen += [d for d in (a, b) if d not in chosen]
    uniform = next(d for d in designs if d.budgets == (most_aggressive, most_aggressive))
    return chosen + ([uniform] if uniform not in chosen else [])


def designs(args, out: Path, mismatch: Path) -> list[tuple[Design, Path]]:
    """The chosen schedules (out/designs.json, written once so a resumed bench trains the same ones)."""
    from sparrow.schemas.io import write_bytes
    from sparrow.stages.core.schedule import Schedule
    from sparrow.stages.train.metrics import write_schedule

    path = out / "designs.json"
    settings = profile_settings(args)
    if not reuse_or_refuse(path, settings):
        picked = choose(candidates(args, mismatch), int(args.budgets.split(",")[0]))
        record_settings(path, settings)
        write_bytes(path, json.dumps([d.__dict__ for d in picked], indent=1).encode())
    picked = [Design(tuple(d["budgets"]), d["tail"], d["mean"], d["kv_read"])
              for d in json.loads(path.read_text())]
    made = []
    for d in picked:
        folder = out / "schedules" / d.name
        if not reuse_or_refuse(folder / "schedule.parquet", settings, quiet=True):
            record_settings(folder / "schedule.parquet", settings)
            write_schedule(folder, Schedule((0, args.bin_width), d.budgets), f"tail test design {d.name}")
        made.append((d, folder / "schedule.parquet"))
        print(f"design {d.name}: tail {d.tail:.3f}, mean alpha {d.mean:.3f}, KV read {d.kv_read:.3f}")
    return made


# ---------------------------------------------------------------- training


@dataclass(frozen=True)
class RunSpec:
    name: str
    sparsity: str
    correction: str
    seed: int
    distill: bool = False  # DistillSparse's online adapter on the sparse actor (train --distill-sparse)

    def folder(self, out: Path) -> Path:
        tag = "-distill" if self.distill else ""
        return out / "runs" / f"{self.name}{tag}-{self.correction}-seed{self.seed}"


def run_specs(args, made: list[tuple[Design, Path]]) -> list[RunSpec]:
    """Correction-major, so a bench stopped early holds every seed of the uncorrected runs (where an
    instability would show first): dense and every design per seed for the first correction; then each
    other correction design by design, the lowest tail first, every seed of one before the next (whether
    the correction holds where the uncorrected runs were likeliest to break). With --distill the most
    aggressive design (lowest mean) with DistillSparse's online adapter (TIS), per seed, follows that
    design's TIS runs (or ends the list without them)."""
    seeds = [int(s) for s in args.seeds.split(",")]
    first, *others = args.corrections.split(",")
    aggressive = min(made, key=lambda m: m[0].mean)
    distilled = [RunSpec(aggressive[0].name, f"schedule:{aggressive[1]}", "tis", seed, distill=True)
                 for seed in seeds] if args.distill else []
    specs = []
    for seed in seeds:
        specs.append(RunSpec("dense", "dense", others[-1] if others else first, seed))
        specs += [RunSpec(d.name, f"schedule:{path}", first, seed) for d, path in made]
    for correction in others:
        for d, path in sorted(made, key=lambda m: m[0].tail):
            specs += [RunSpec(d.name, f"schedule:{path}", correction, seed) for seed in seeds]
            if correction == "tis" and d is aggressive[0]:
                specs, distilled = specs + distilled, []
    specs += distilled
    if args.designs is None:
        return specs
    wanted = args.designs.split(",")
    unknown = sorted(set(wanted) - {s.name for s in specs})
    if unknown:
        raise SystemExit(f"--designs: no design {', '.join(unknown)}; the designs are dense and "
                         f"{', '.join(d.name for d, _ in made)}")
    return [s for s in specs if s.name in wanted]


def finished(args, folder: Path) -> bool:
    """Whether the run wrote all it leaves (its summary, written last) after at least --steps steps: one
    stopped after its last step, before its adapter, is resumed to write it."""
    from sparrow.stages.train.run_dir import recorded_summary

    summary = recorded_summary(folder)
    return summary is not None and summary.get("steps", 0) >= args.steps


def check_made(args, out: Path, specs: list[RunSpec]) -> None:
    """Every run begun and the matrix, against this command's settings, before any work: a SystemExit
    naming the first setting that differs (bench/common.py: reuse_or_refuse)."""
    for spec in specs:
        reuse_or_refuse(spec.folder(out), run_settings(args), quiet=True)
    reuse_or_refuse(out / "matrix.parquet", matrix_settings(args), quiet=True)


def train_command(args, spec: RunSpec, prompts: Path, held_out: Path, out: Path) -> list[str]:
    folder = spec.folder(out)
    resume = (folder / "checkpoint").exists()
    return [SPARROW, "train", "--model", args.model, "--prompts", str(prompts),
            "--eval-prompts", str(held_out), "--steps", str(args.steps),
            "--prompts-per-step", str(args.prompts_per_step), "--samples", str(args.samples),
            "--max-new-tokens", str(args.max_new_tokens), "--lr", str(args.lr),
            "--lora-rank", str(args.lora_rank), "--seed", str(spec.seed), "--correction", spec.correction,
            "--eval-every", str(args.eval_every), "--checkpoint-every", str(args.checkpoint_every),
            "--bin-width", str(args.bin_width), "--alpha-sequences", str(args.alpha_sequences),
            *(["--schedule", spec.sparsity.removeprefix("schedule:")] if spec.sparsity != "dense" else []),
            *(["--distill-sparse"] if spec.distill else []),
            "--threads", "1", "-o", str(folder), "--format", "tsv",
            *(["--resume"] if resume else ["--force"])]


def train_all(args, specs: list[RunSpec], prompts: Path, held_out: Path, out: Path) -> None:
    """Every unfinished run, --parallel at a time, each its own process at one thread (logs beside it).
    Ctrl-C: the runs in training write their checkpoint and stop, and one line says what is kept."""
    todo = [s for s in specs if not finished(args, s.folder(out))]
    print(f"{len(specs) - len(todo)} of {len(specs)} runs done (same settings); {len(todo)} to train",
          flush=True)
    running: list[tuple[RunSpec, subprocess.Popen, float]] = []  # each with its log file open
    try:
        launch_and_wait(args, todo, running, prompts, held_out, out)
    except KeyboardInterrupt:
        stop(running)
        done = sum(finished(args, s.folder(out)) for s in specs)
        stopped = "".join(f"; {spec.folder(out).name} stopped (its .log says what its checkpoint holds)"
                          for spec, _, _ in running)
        print(f"stopped: {done} of {len(specs)} runs finished, kept{stopped}; the same command continues",
              file=sys.stderr, flush=True)
        raise SystemExit(130) from None


def launch_and_wait(args, todo: list[RunSpec], running: list[tuple[RunSpec, subprocess.Popen, float]],
                    prompts: Path, held_out: Path, out: Path) -> None:
    while todo or running:
        while todo and len(running) < args.parallel:
            spec = todo.pop(0)
            folder = spec.folder(out)
            folder.parent.mkdir(parents=True, exist_ok=True)
            print(f"== {folder.name}", flush=True)
            record_settings(folder, run_settings(args))
            with open(folder.parent / f"{folder.name}.log", "a") as log:  # the child keeps its own handle
                running.append((spec, subprocess.Popen(train_command(args, spec, prompts, held_out, out),
                                                       stdout=log, stderr=subprocess.STDOUT), time.time()))
        time.sleep(5)
        for item in list(running):
            spec, proc, t0 = item
            if proc.poll() is not None:
                running.remove(item)
                status = "done" if proc.returncode == 0 else f"failed ({proc.returncode}; see its .log)"
                print(f"   {spec.folder(out).name}: {status} in {time.time() - t0:.0f} s", flush=True)
                if proc.returncode != 0:
                    raise SystemExit(proc.returncode)


def stop(running: list[tuple[RunSpec, subprocess.Popen, float]]) -> None:
    """Wait for the runs in training to stop: a Ctrl-C at the terminal reached them too (one process group)
    and each writes its checkpoint first; one that did not hear it (the bench alone was signalled) is
    interrupted after STOP_GRACE_S. A second Ctrl-C stops waiting."""
    try:
        for _, proc, _ in running:
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGINT)
                proc.wait()
    except KeyboardInterrupt:
        pass


# ---------------------------------------------------------------- the sampler-versus-learning matrix


def policy_model(args, folder: Path | None):
    """The base model, or a run's final policy (its LoRA from the last checkpoint)."""
    import torch

    from sparrow.stages.model.adapter import add_lora, load_lora_state
    from sparrow.stages.model.loading import load_model

    loaded = load_model(args.model)
    if folder is not None:
        state = torch.load(folder / "checkpoint" / "state.pt", weights_only=False)
        add_lora(loaded.model, args.lora_rank, 32.0)
        load_lora_state(loaded.model, state["weights"])
    return loaded


def matrix(args, out: Path, held_out: Path, made: list[tuple[Design, Path]], specs: list[RunSpec]) -> Path:
    """out/matrix.parquet: one row per (policy, sampler): the sampled reward (--samples per prompt) and
    the greedy accuracy on the held-out prompts."""
    import torch

    from sparrow.schemas import read_artifact
    from sparrow.schemas.io import write_table
    from sparrow.stages.engine import Engine, EngineConfig, SamplingParams
    from sparrow.stages.kv_policies import BlockTopK, Dense
    from sparrow.stages.tasks import score_batch

    path = out / "matrix.parquet"
    settings = matrix_settings(args)
    if reuse_or_refuse(path, settings, quiet=True):
        rows = pq.read_table(path).to_pylist()
    else:
        rows = []
        record_settings(path, settings)
    done = {(r["policy"], r["sampler"]) for r in rows}
    by_tail = sorted(made, key=lambda m: m[0].tail)
    keep = {"dense"} | {by_tail[0][0].name, by_tail[len(by_tail) // 2][0].name}  # aggressive and middle
    policies = [("base", None)] + [(s.folder(out).name, s.folder(out)) for s in specs
                                   if s.name in keep and not s.distill and finished(args, s.folder(out))
                                   and (s.name == "dense" or s.correction == args.corrections.split(",")[0])]
    samplers = [("dense", Dense())] + [(f"budget:{b}", BlockTopK(lambda _, b=int(b): b, f"budget:{b}"))
                                       for b in args.matrix_budgets.split(",")]
    prompts = read_artifact(held_out, "prompts").to_pylist()
    torch.set_num_threads(args.threads)
    for name, folder in policies:
        if all((name, s) in done for s, _ in samplers):
            continue
        loaded = policy_model(args, folder)
        engine = Engine(loaded.model, Dense(), EngineConfig(max_batch=args.prompts_per_step * args.samples))
        tok = loaded.tokenizer
        for sampler, policy in samplers:
            if (name, sampler) in done:
                continue
            t0 = time.time()
            result = {}
            for kind, params in (("reward", SamplingParams(max_new_tokens=args.max_new_tokens, n=args.samples,
                                                           temperature=1.0, seed=7)),
                                 ("accuracy", SamplingParams(max_new_tokens=args.max_new_tokens,
                                                             temperature=0.0))):
                outs = engine.generate([r["prompt_token_ids"] for r in prompts], params, policy=policy)
                rewards = score_batch([(r["task"], tok.decode(c.token_ids, skip_special_tokens=True),
                                        r["answer"], json.loads(r["metadata"] or "{}"))
                                       for r, group in zip(prompts, outs) for c in group])
                result[kind] = float(np.mean(rewards) if kind == "reward"
                                     else np.mean([x >= 1 - 1e-9 for x in rewards]))
            rows.append({"policy": name, "sampler": sampler, **result})
            write_table(pa.Table.from_pylist(rows), path)
            print(f"   matrix {name} x {sampler}: reward {result['reward']:.3f}, accuracy "
                  f"{result['accuracy']:.3f} ({time.time() - t0:.0f} s)", flush=True)
        engine.close()
    return path


# ---------------------------------------------------------------- calibration and figure


def calibrate(args, out: Path, mismatch: Path, specs: list[RunSpec]) -> Path | None:
    runs = [s.folder(out) for s in specs if finished(args, s.folder(out))]
    if not runs:
        print("no finished runs to calibrate")
        return None
    threshold = out / "threshold.parquet"
    sparrow("calibrate-threshold", "--profile", str(mismatch), "--runs", *map(str, runs),
            "-o", str(threshold), "--force", "--format", "tsv", "--bootstrap", str(args.bootstrap))
    return threshold


def run_table(args, out: Path, made: list[tuple[Design, Path]], specs: list[RunSpec]) -> Path:
    """out/runs.md: every finished run as a Markdown row: its design's statistics, its dense held-out
    accuracy at each eval (step 0 first), its training reward over the first and last quarter of the steps,
    its step-0 sampler gap, the exact alpha_p5 its training logged (mean over steps), its label and any
    collapse reason a step's row ever carried (a flag that later cleared)."""
    stats = {d.name: d for d, _ in made}
    lines = ["| run | tail | mean alpha | KV read | dense eval (steps 0, 20, 40) | reward first -> last "
             "quarter | step-0 sampler gap | logged alpha_p5 | label | flags on the way |", "|---" * 10 + "|"]
    for spec in specs:
        folder = spec.folder(out)
        if not finished(args, folder):
            continue
        table = pq.read_table(folder / "metrics.parquet")
        meta = json.loads(table.schema.metadata[b"sparrow.meta"])
        rows = table.to_pylist()
        evals = [meta["initial_eval_accuracy"]] + [r["eval_accuracy"] for r in rows
                                                   if r["eval_accuracy"] is not None]
        quarter = max(len(rows) // 4, 1)
        reward = [float(np.mean([r["reward_mean"] for r in part]))
                  for part in (rows[:quarter], rows[-quarter:])]
        logged = [r["alpha_p5"] for r in rows if r.get("alpha_p5") is not None]
        flags = sorted({r["collapse"] for r in rows if r.get("collapse")})
        d = stats.get(spec.name)
        tail, mean, kv = (d.tail, d.mean, d.kv_read) if d else (1.0, 1.0, 1.0)
        lines.append(f"| {folder.name} | {tail:.3f} | {mean:.3f} | {kv:.3f} | "
                     f"{', '.join(f'{e:.3f}' for e in evals)} | {reward[0]:.3f} -> {reward[1]:.3f} | "
                     f"{meta.get('initial_sampler_gap') or 0:.3f} | "
                     f"{f'{np.mean(logged):.3f}' if logged else '-'} | {meta.get('label')} | "
                     f"{'; '.join(flags) or '-'} |")
    path = out / "runs.md"
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return path


def design_table(args, out: Path, mismatch: Path, made: list[tuple[Design, Path]], specs: list[RunSpec],
                 margin: float = 0.1) -> Path:
    """out/designs.md: per design and correction, the statistics with 95% intervals over bootstrap draws
    of the profile's prompts (and tokens within them; the plain sparse actor's, DistillSparse's too), the
    runs' own logged exact tail (alpha_p5 over each run's last quarter of steps, mean over seeds, their
    count in parentheses: the policy as it trained, with its adapter), and what training did to the
    dense-evaluated policy on each finished seed: its held-out accuracy at the end minus at step 0, and
    how many runs ended more than `margin` below their start (a degraded policy, whatever the sampler
    earned)."""
    from sparrow.schemas import read_artifact
    from sparrow.stages.calibrate import ProfileTokens, tail_of
    from sparrow.stages.core.definitions import TAIL_QUANTILE
    from sparrow.stages.core.schedule import Schedule

    tokens = ProfileTokens.from_table(read_artifact(mismatch, "mismatch"))
    rng = np.random.default_rng(0)
    draws = [tokens.resample(rng) for _ in range(args.bootstrap)]
    schedules = {d.name: Schedule.from_artifact(path) for d, path in made}
    lines = ["| design | correction | tail [95%] | mean alpha [95%] | KV read | logged tail, last quarter | "
             "seeds | dense eval change from step 0, per seed | degraded |", "|---" * 9 + "|"]
    groups: dict[tuple[str, str, bool], list[float]] = {}
    logged: dict[tuple[str, str, bool], list[float]] = {}
    for spec in specs:
        folder = spec.folder(out)
        if finished(args, folder):
            table = pq.read_table(folder / "metrics.parquet")
            meta = json.loads(table.schema.metadata[b"sparrow.meta"])
            last = [e for e in table.column("eval_accuracy").to_pylist() if e is not None][-1]
            key = (spec.name, spec.correction, spec.distill)
            groups.setdefault(key, []).append(last - meta["initial_eval_accuracy"])
            if "alpha_p5" in table.column_names:  # the run's own exact tail (its sampler, adapter and all)
                p5 = [a for a in table.column("alpha_p5").to_pylist() if a is not None]
                if p5:
                    logged.setdefault(key, []).append(float(np.mean(p5[-max(len(p5) // 4, 1):])))
    for (name, correction, distill), changes in groups.items():
        if name in schedules:
            alpha, kv, _ = tokens.at(schedules[name])
            tails = [tail_of(alpha[i], tokens.bins[i], TAIL_QUANTILE) for i in draws]
            means = [alpha[i].mean() for i in draws]
            tail = f"{tail_of(alpha, tokens.bins, TAIL_QUANTILE):.3f} [{np.quantile(tails, 0.025):.3f}, " \
                   f"{np.quantile(tails, 0.975):.3f}]"
            mean = f"{alpha.mean():.3f} [{np.quantile(means, 0.025):.3f}, {np.quantile(means, 0.975):.3f}]"
            read = f"{kv.mean():.3f}"
        else:
            tail, mean, read = "1", "1", "1"
        degraded = sum(c < -margin for c in changes)
        seen = logged.get((name, correction, distill))
        own = f"{np.mean(seen):.3f} ({len(seen)})" if seen else "-"
        lines.append(f"| {name}{' + DistillSparse' if distill else ''} | {correction} | {tail} | {mean} | "
                     f"{read} | {own} | {len(changes)} | {', '.join(f'{c:+.3f}' for c in changes)} | "
                     f"{degraded} of {len(changes)} |")
    lines += ["", _paired_difference(tokens, draws, sorted(made, key=lambda m: m[0].tail)[:2], schedules)]
    path = out / "designs.md"
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return path


def _paired_difference(tokens, draws: list[np.ndarray], pair: list[tuple[Design, Path]], schedules: dict
                       ) -> str:
    """The two lowest-tail designs' difference in tail and in mean alpha, with 95% intervals over the same
    bootstrap draws (paired): whether their tails differ at all."""
    from sparrow.stages.calibrate import tail_of
    from sparrow.stages.core.definitions import TAIL_QUANTILE

    (a, _), (b, _) = pair
    alphas = [tokens.at(schedules[d.name])[0] for d in (a, b)]
    diffs = {"tail": [tail_of(alphas[0][i], tokens.bins[i], TAIL_QUANTILE)
                      - tail_of(alphas[1][i], tokens.bins[i], TAIL_QUANTILE) for i in draws],
             "mean alpha": [alphas[0][i].mean() - alphas[1][i].mean() for i in draws]}
    parts = [f"{what} {np.mean(v):+.3f} [{np.quantile(v, 0.025):+.3f}, {np.quantile(v, 0.975):+.3f}]"
             for what, v in diffs.items()]
    return f"{a.name} minus {b.name} (paired bootstrap, 95%): " + "; ".join(parts)


def figure(out: Path, threshold: Path, target: Path | None, specs: list[RunSpec]) -> Path:
    """Reward gap (dense reference minus run, training reward, the step-0 sampler gap added back) and the
    dense-eval change, against tail, mean alpha and KV read; every sparse run, colour = label, marker =
    seed, filled = TIS, open = no correction, a black ring = DistillSparse's online adapter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparrow.schemas import artifact_metadata

    runs = [r for r in json.loads(artifact_metadata(threshold)["runs"]) if r["reference"]]
    distilled = {spec.folder(out).resolve() for spec in specs if spec.distill}
    markers = {0: "o", 1: "s", 2: "^"}
    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5), sharey="row")
    xs = (("tail", "tail: min over bins of p5 alpha"), ("mean", "mean alpha"),
          ("kv_read", "share of the KV read"))
    ys = (("reward_gap", "reward gap to dense\n(minus the step-0 sampler gap)"),
          ("eval_change", "dense eval accuracy,\nlast minus step 0"))
    for col, (key, what) in enumerate(xs):
        for row, (y, label) in enumerate(ys):
            ax = axes[row, col]
            for r in runs:
                if r[y] is None:
                    continue
                value = r[y] - (r["sampler_gap"] or 0.0) if y == "reward_gap" else r[y]
                colour = "tab:red" if r["collapsed"] else "tab:green"
                ax.scatter(r[key], value, marker=markers.get(r["seed"], "o"), s=40, edgecolors=colour,
                           facecolors=colour if r["correction"] != "none" else "none", linewidths=1.2)
                if Path(r["run"]).resolve() in distilled:
                    ax.scatter(r[key], value, marker=markers.get(r["seed"], "o"), s=130, facecolors="none",
                               edgecolors="black", linewidths=0.9)
            ax.axhline(0, color="grey", lw=0.8)
            ax.grid(alpha=0.3)
            if row == 1:
                ax.set_xlabel(what)
            if col == 0:
                ax.set_ylabel(label)
    fig.suptitle("Every sparse run: red collapsed, green stable; marker = seed; filled = TIS, open = none; "
                 "ringed = DistillSparse")
    fig.tight_layout()
    path = out / "tail-test.png"
    fig.savefig(path, dpi=110)
    if target is not None:
        fig.savefig(target, dpi=110)
    print(f"figure: {path}")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", default="192,400", help="prompt lengths in tokens (half the prompts each)")
    ap.add_argument("--bin-width", type=int, default=256)
    ap.add_argument("--train-prompts", type=int, default=64)
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--budgets", default="48,64,80,96,128,192", help="profiled budgets (the designs' levels)")
    ap.add_argument("--matrix-budgets", default="48,64,80,96,128")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--designs", default=None,
                    help="only these designs' runs (names as printed, dense too), e.g. more seeds of two")
    ap.add_argument("--corrections", default="none,tis",
                    help="each design trains with each; dense with the last")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--alpha-sequences", type=int, default=4)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--distill", action=argparse.BooleanOptionalAction, default=True,
                    help="after the main runs: the most aggressive design with DistillSparse's adapter")
    ap.add_argument("--threads", type=int, default=1, help="threads of the profile and the matrix")
    ap.add_argument("--parallel", type=int, default=1, help="training runs at a time")
    ap.add_argument("--train", action=argparse.BooleanOptionalAction, default=True,
                    help="--no-train: the later phases over the runs finished so far")
    ap.add_argument("--phase", choices=PHASES, default=PHASES[-1], help="stop after this phase")
    ap.add_argument("--figure", type=Path, default=None, help="also save the figure here (docs/)")
    ap.add_argument("--out", type=Path, default=default_results() / "tail-test")
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    prompts, held_out = prompt_files(args, out)
    mismatch = profile_once(out / "mismatch.parquet", profile_settings(args), args.model, prompts,
                            args.budgets, args.samples, args.max_new_tokens, args.bin_width,
                            "--threads", str(args.threads))
    made = designs(args, out, mismatch)
    specs = run_specs(args, made)
    if args.phase == "designs":
        return
    check_made(args, out, specs)
    if args.train:
        train_all(args, specs, prompts, held_out, out)
    if args.phase == "train":
        return
    matrix(args, out, held_out, made, specs)
    if args.phase == "matrix":
        return
    threshold = calibrate(args, out, mismatch, specs)
    run_table(args, out, made, specs)
    design_table(args, out, mismatch, made, specs)
    if args.phase == "calibrate" or threshold is None:
        return
    figure(out, threshold, args.figure, specs)


if __name__ == "__main__":
    main()
