"""The critical threshold measured: a stability sweep on the embedded model, labelled by outcome.

Profile once, plan a schedule at each threshold of a ladder (by default the measured tails of a few
profiled budgets, from clearly too small to near dense, so that each threshold plans one profiled
budget and every run's tail is measured, not interpolated), train each schedule with the same seeds
plus a dense reference per seed, label every run by what training did (stages/calibrate.py: its own
curves and the dense run of the same seed), and calibrate the threshold from the runs with
`sparrow calibrate-threshold`: the tail statistic (min over bins of p5 alpha) and, beside it, the mean
of alpha, so that one sees which of the two separates stable from collapsed runs.

Every stage is a file or a run directory under --out, and each is skipped when it is complete: the
sweep can be stopped at any point (Ctrl-C, one line and exit status 130; a killed process) and run again
with the same command to continue; a training run stopped midway resumes from its last checkpoint. The
settings that decide a stage are recorded beside it (NAME.settings.json, bench/common.py) and a stage
made with other settings is refused before any work, naming the setting (a run may change only --steps,
--eval-every and --checkpoint-every, as a resumed training run may). Thresholds that plan the same
schedule share its runs. The task is passkey retrieval at --context tokens, where a small budget
reads only part of the prompt, so the tail differs across the ladder.

    .venv/bin/python bench/threshold_sweep.py --threads 1         # the sweep in docs/calibration.md
    .venv/bin/python bench/threshold_sweep.py --thresholds 0.2,0.5,0.8 --seeds 0 --steps 8 --out /tmp/sweep
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from common import (
    bench_parser,
    default_results,
    flags,
    profile_once,
    record_settings,
    reuse_or_refuse,
    sparrow,
    stop_on_interrupt,
)

from sparrow.schemas import artifact_metadata, write_artifact
from sparrow.stages.core.definitions import TAIL_QUANTILE
from sparrow.stages.model.loading import load_model, spec_tokenizer
from sparrow.stages.tasks import TaskError, make_prompts
from sparrow.stages.train import RunOptions, TrainConfig, Trainer, load_prompts
from sparrow.stages.train.run_dir import recorded_summary

# what decides each stage's output (bench/common.py: reuse_or_refuse); each includes what its inputs' did


def prompt_settings(args) -> dict[str, object]:
    return flags(args, "model", "task", "context", "train_prompts", "eval_prompts")


def profile_settings(args) -> dict[str, object]:
    """The profile's, and the planned schedules' (a schedule's threshold is in its file's name)."""
    return prompt_settings(args) | flags(args, "budgets", "samples", "max_new_tokens", "bin_width")


def run_settings(args, sparsity: str) -> dict[str, object]:
    """A run's, besides its name and seed (its folder's name): a planned run's schedule follows from the
    profile; all but --steps, --eval-every and --checkpoint-every, which a resumed run may change."""
    return ((prompt_settings(args) if sparsity == "dense" else profile_settings(args))
            | flags(args, "prompts_per_step", "samples", "max_new_tokens", "lr", "lora_rank", "micro_batch",
                    "bin_width", "correction"))


def prompt_files(args, out: Path) -> tuple[Path, Path]:
    train, held_out = out / "prompts.parquet", out / "eval-prompts.parquet"
    settings = prompt_settings(args)
    if all([reuse_or_refuse(path, settings) for path in (train, held_out)]):  # both checked
        return train, held_out
    tok = spec_tokenizer(args.model)
    for path, n, seed in ((train, args.train_prompts, 0), (held_out, args.eval_prompts, 1)):
        try:
            rows = make_prompts(args.task, n, seed, tok, context_tokens=args.context)
        except TaskError as e:
            raise SystemExit(str(e).replace("--context-tokens", "--context")) from None
        record_settings(path, settings)
        write_artifact(rows, path, "prompts")
    return train, held_out


def ladder(args, mismatch: Path) -> list[str]:
    """The thresholds to plan at: --thresholds, else one per --ladder-budgets budget, at that budget's
    measured tail (min over bins of the p5 of alpha, rounded down), so that each plans that budget."""
    if args.thresholds:
        return args.thresholds.split(",")
    import duckdb

    tails = dict(duckdb.sql(f"""SELECT budget, min(p5) FROM (
        SELECT budget, bin, quantile_cont(alpha, {TAIL_QUANTILE}) AS p5 FROM read_parquet('{mismatch}')
        GROUP BY ALL) GROUP BY budget""").fetchall())
    return [f"{np.floor(tails[int(b)] * 1e4) / 1e4:.4f}" for b in args.ladder_budgets.split(",")]


def plan(args, out: Path, mismatch: Path) -> dict[str, Path]:
    """threshold -> schedule file; thresholds that plan the same budgets share the first one's file."""
    plans: dict[str, Path] = {}
    by_budgets: dict[tuple, Path] = {}
    settings = profile_settings(args)
    for t in ladder(args, mismatch):
        path = out / f"schedule-{t}.parquet"
        if not reuse_or_refuse(path, settings, quiet=True):
            record_settings(path, settings)
            sparrow("plan-schedule", "--model", args.model, "--profile", str(mismatch), "--threshold", t,
                    "--bin-width", str(args.bin_width), "-o", str(path), "--format", "tsv")
        budgets = tuple(pq.read_table(path, columns=["budget"]).column("budget").to_pylist())
        plans[t] = by_budgets.setdefault(budgets, path)
    return plans


def train(args, name: str, sparsity: str, seed: int, prompts: Path, held_out: Path, out: Path) -> Path:
    """One run directory, trained to --steps (skipped when done, resumed when stopped midway)."""
    run_dir = out / "runs" / f"{name}-seed{seed}"
    summary = recorded_summary(run_dir)  # written last: a run stopped before it is resumed
    if summary is not None and summary.get("steps", 0) >= args.steps:
        return run_dir
    record_settings(run_dir, run_settings(args, sparsity))
    loaded = load_model(args.model)  # fresh base weights for every run
    cfg = TrainConfig(model=args.model, steps=args.steps, prompts_per_step=args.prompts_per_step,
                      samples=args.samples, max_new_tokens=args.max_new_tokens, lr=args.lr,
                      lora_rank=args.lora_rank, seed=seed, micro_batch=args.micro_batch,
                      checkpoint_every=args.checkpoint_every, eval_every=args.eval_every,
                      bin_width=args.bin_width, sparsity=sparsity, correction=args.correction)
    resume = (run_dir / "checkpoint").exists()
    print(f"== {name}, seed {seed}{' (resumed)' if resume else ''}", flush=True)
    trainer = Trainer(cfg, loaded, load_prompts(prompts, loaded.tokenizer), run_dir,
                      eval_prompts=load_prompts(held_out, loaded.tokenizer), options=RunOptions(
                          resume=resume, force=not resume,
                          on_step=lambda r: print(f"    {name} seed {seed} step {r['step']}: reward "
                                                  f"{r['reward_mean']:.3f} ({r['seconds']:.0f} s)",
                                                  flush=True)))
    t0 = time.perf_counter()
    trainer.run()
    print(f"    {name} seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
    return run_dir


def summarise(run_dir: Path, threshold_meta: dict) -> dict:
    """The docs/calibration.md row of a run: its plan, outcome and label (the label as calibrate-threshold
    gave it)."""
    m = pq.read_table(run_dir / "metrics.parquet").to_pylist()
    meta = artifact_metadata(run_dir / "metrics.parquet")
    cfg = json.loads(meta["config"])
    k = max(1, len(m) // 4)
    evals = [r["eval_accuracy"] for r in m if r.get("eval_accuracy") is not None]
    label = next((r for r in json.loads(threshold_meta["runs"]) if Path(r["run"]) == run_dir), {})
    first = meta.get("initial_eval_accuracy")  # 0.0 is an accuracy, not a missing one
    return {"run": run_dir.name, "sparsity": cfg["sparsity"], "seed": cfg["seed"],
            "eval_first": float(first) if first is not None else None,
            "eval_last": evals[-1] if evals else None,
            "reward_first": float(np.mean([r["reward_mean"] for r in m[:k]])),
            "reward_last": float(np.mean([r["reward_mean"] for r in m[-k:]])),
            "tail": label.get("tail"), "mean_alpha": label.get("mean"),
            "label": "collapsed" if label.get("collapsed") else "stable",
            "reasons": "; ".join(label.get("reasons", [])),
            "warnings": "; ".join(label.get("warnings", [])),
            "seconds": float(sum(r["seconds"] for r in m))}


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="passkey")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens")
    ap.add_argument("--train-prompts", type=int, default=64)
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--budgets", default="48,64,80,96,112,128,160,192", help="profiled budgets")
    ap.add_argument("--ladder-budgets", default="48,64,80,96,160",
                    help="plan at the measured tail of each of these profiled budgets (the default ladder)")
    ap.add_argument("--thresholds", default=None, help="an explicit ladder of thresholds instead")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=12,
                    help="eval before the first step, after the last and every this many steps")
    ap.add_argument("--checkpoint-every", type=int, default=4)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--bin-width", type=int, default=512)
    ap.add_argument("--correction", default="tis")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ship", action="store_true",
                    help="copy a calibrated threshold into the package as the model's default")
    ap.add_argument("--out", type=Path, default=default_results() / "threshold-sweep",
                    help="every stage's file and run directory (under $SPARROW_BENCH_RESULTS when set)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    prompts, held_out = prompt_files(args, out)
    mismatch = profile_once(out / "mismatch.parquet", profile_settings(args), args.model, prompts,
                            args.budgets, args.samples, args.max_new_tokens, args.bin_width)
    plans = plan(args, out, mismatch)
    seeds = [int(s) for s in args.seeds.split(",")]
    configs = [("dense", "dense")]
    for t, schedule in plans.items():
        if schedule.name != f"schedule-{t}.parquet":
            print(f"== threshold {t} plans the same schedule as {schedule.name}: its runs stand for both")
            continue
        configs.append((f"t{t}", f"schedule:{schedule}"))
    for s in seeds:  # every run begun, before any work
        for name, sparsity in configs:
            reuse_or_refuse(out / "runs" / f"{name}-seed{s}", run_settings(args, sparsity), quiet=True)
    # seed by seed: a sweep stopped early still holds a whole ladder
    runs = [train(args, name, sparsity, s, prompts, held_out, out)
            for s in seeds for name, sparsity in configs]
    threshold = out / "threshold.parquet"
    sparrow("calibrate-threshold", "--profile", str(mismatch), "--runs", *map(str, runs),
            "-o", str(threshold), "--force", "--format", "tsv")
    rows = [summarise(r, artifact_metadata(threshold)) for r in runs]
    plan_of = {str(p): t for t, p in plans.items()}
    for r in rows:
        s = r["sparsity"]
        r["threshold"] = plan_of.get(s.removeprefix("schedule:"), "dense") if s != "dense" else "dense"
        if s != "dense":
            r["budgets"] = pq.read_table(s.removeprefix("schedule:"), columns=["budget"]).column(
                "budget").to_pylist()
    print("| threshold | budget | seed | tail | mean alpha | eval first -> last | reward first -> last | "
          "label | reasons | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        budget = "dense" if "budgets" not in r else "/".join(str(b or "dense") for b in r["budgets"])
        print(f"| {r['threshold']} | {budget} | {r['seed']} | {r['tail']:.3f} | "
              f"{r['mean_alpha']:.3f} | {r['eval_first']:.3f} -> {r['eval_last']:.3f} | "
              f"{r['reward_first']:.3f} -> {r['reward_last']:.3f} | {r['label']} | {r['reasons'] or '-'} | "
              f"{r['seconds']:.0f} |")
    t = pq.read_table(threshold).to_pylist()[0]
    print(f"threshold {t['threshold']:.4f} [{t['lower']}, {t['upper']}] ({t['source']}): {t['note']}")
    if args.ship:
        ship(args, threshold, rows)


def ship(args, threshold: Path, rows: list[dict]) -> None:
    """Copy a calibrated threshold into the package (stages/data/threshold-<model>.parquet), with its
    provenance, as the default of plan-schedule, profile and calibrate-threshold for this model."""
    from sparrow.schemas import read_artifact
    from sparrow.stages.calibrate import SHIPPED

    table = read_artifact(threshold, "threshold")
    row = table.to_pylist()[0]
    if row["source"] != "calibrated":
        raise SystemExit(f"not shipped: the runs did not calibrate a threshold ({row['note']})")
    meta = artifact_metadata(threshold)
    runs = [{**r, "run": Path(r["run"]).name, "reference": r["reference"] and Path(r["reference"]).name}
            for r in json.loads(meta["runs"])]
    seeds = sorted({r["seed"] for r in rows})
    ladder_ = args.thresholds or f"at the tails of budgets {args.ladder_budgets}"
    provenance = (f"bench/threshold_sweep.py: {args.task} at {args.context} tokens, {len(rows)} GRPO runs of "
                  f"{args.steps} steps ({args.prompts_per_step} prompts x {args.samples} samples, "
                  f"{args.max_new_tokens} new tokens, LoRA rank {args.lora_rank}, lr {args.lr}, "
                  f"{args.correction}), seeds {seeds}, dense + thresholds {ladder_}; "
                  f"95% bootstrap interval [{row['lower']:.4f}, {row['upper']:.4f}]")
    SHIPPED.mkdir(exist_ok=True)
    path = SHIPPED / f"threshold-{args.model}.parquet"
    write_artifact(table, path, "threshold", metadata={**meta, "runs": json.dumps(runs), "model": args.model,
                                                       "task": args.task, "profile": "mismatch.parquet",
                                                       "provenance": provenance})
    print(f"shipped {path}: {provenance}")


if __name__ == "__main__":
    stop_on_interrupt(main, "finished stages and runs kept, and a stopped run resumes from its last "
                      "complete step")
