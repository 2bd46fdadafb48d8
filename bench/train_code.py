"""GRPO on the code task: dense vs the planned sparse schedule, rewards from programs run in the sandbox.

Runs `sparrow.stages.train.Trainer` on `code` prompts (small function-writing problems whose reward is the
fraction of hidden tests the completion's function passes, run in the bubblewrap sandbox, plus a format
credit), once per configuration and seed from the same base weights, and prints:
- per step: train reward, accuracy, eval accuracy (greedy, dense, held-out prompts of another seed) where
  evaluated, and the seconds of the step's rewards (`reward_seconds`: every sample's program run in the
  pool of sandboxes) next to rollout / scoring / update seconds;
- per run: eval accuracy at the start and the end, train reward over the first and last quarter of the
  steps, the p5 of the top-20 lower bound of alpha (mean over steps; the tail statistic, to set against
  bench/train.py's passkey runs), mismatch KL, the collapse label, median seconds per phase.
Configurations: `dense`, and `planned` (the --planned budget, or --schedule FILE, with truncated IS).
Whether GRPO learned: the eval gain against the seed spread when --seeds has several (reported, not
asserted). Writes train_code.parquet into --results (default bench/results) and one run directory per
run under --out (default train-code-runs/ in --results); a finished run leaves its row there
(`bench_row.json`) and is not run again, so a stopped study (Ctrl-C: one line, exit status 130) continues
where it stopped with the same command, a stopped run starting over (it keeps no checkpoint), and seeds
can run in separate processes (one `--seeds 0`, another `--seeds 1`) before one call with every seed
prints the whole table. The settings
that decide the prompts and each run are recorded beside them (NAME.settings.json, bench/common.py), and
one made with other settings is refused before any work, naming the setting.

    .venv/bin/python bench/train_code.py --steps 2 --prompts-per-step 2 --samples 2 --eval-prompts 4
    .venv/bin/python bench/train_code.py --steps 24 --seeds 0,1,2     # the study (long on a CPU)
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from common import bench_parser, flags, record_settings, reuse_or_refuse, stop_on_interrupt, write_results

from sparrow.schemas import write_artifact
from sparrow.schemas.io import write_bytes
from sparrow.stages.model.loading import load_model, spec_tokenizer
from sparrow.stages.tasks import make_prompts
from sparrow.stages.train import RunOptions, TrainConfig, Trainer, load_prompts

PHASES = ("rollout_seconds", "scoring_seconds", "update_seconds", "reward_seconds")
CONFIGS = ("dense", "planned")


def parse_args() -> argparse.Namespace:
    ap = bench_parser(__doc__, "train_code")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--level", type=int, default=None, help="code task level (default: the task's)")
    ap.add_argument("--train-prompts", type=int, default=64)
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=None, help="steps between evals (default: --steps)")
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--bin-width", type=int, default=128)
    ap.add_argument("--planned", type=int, default=128, help="the planned budget in tokens")
    ap.add_argument("--schedule", type=Path, default=None, help="a schedule artifact instead of --planned")
    ap.add_argument("--configs", default="dense,planned")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None,
                    help="the prompts and the run directories (default: train-code-runs in --results)")
    args = ap.parse_args()
    args.out = args.out or args.results / "train-code-runs"
    return args


def prompt_file(tokenizer, args, count: str, seed: int, path: Path) -> Path:
    """`count` (train_prompts or eval_prompts) code prompts of generator seed `seed`, made once."""
    settings = flags(args, "model", "level", count)
    if reuse_or_refuse(path, settings):
        return path
    options = {} if args.level is None else {"level": args.level}
    record_settings(path, settings)
    rows = make_prompts("code", getattr(args, count), seed, tokenizer, **options)
    return write_artifact(rows, path, "prompts")


def run_one(args, name: str, seed: int, prompts: Path, eval_prompts: Path) -> dict:
    run_dir = args.out / f"{name}-seed{seed}"
    done = run_dir / "bench_row.json"
    if reuse_or_refuse(run_dir, run_key(args, name), quiet=True) and done.exists():
        print(f"    done before: {run_dir} (same settings)", flush=True)
        return json.loads(done.read_text())
    record_settings(run_dir, run_key(args, name))
    loaded = load_model(args.model)  # fresh base weights for every run
    shutil.rmtree(run_dir, ignore_errors=True)  # a stopped run starts over: it kept no checkpoint
    sparsity = "dense" if name == "dense" else (
        f"schedule:{args.schedule}" if args.schedule else f"budget:{args.planned}")
    cfg = TrainConfig(model=args.model, steps=args.steps, prompts_per_step=args.prompts_per_step,
                      samples=args.samples, max_new_tokens=args.max_new_tokens, lr=args.lr,
                      lora_rank=args.lora_rank, seed=seed, micro_batch=args.micro_batch,
                      checkpoint_every=args.steps, eval_every=args.eval_every or args.steps,
                      bin_width=args.bin_width, sparsity=sparsity, correction="tis")

    def on_step(r: dict) -> None:
        ev = "" if r.get("eval_accuracy") is None else f", eval {r['eval_accuracy']:.3f}"
        print(f"    {name} seed {seed} step {r['step']}: reward {r['reward_mean']:.3f}, accuracy "
              f"{r['accuracy']:.3f}{ev}; s rollout / scoring / update / reward "
              + " / ".join(f"{r[k]:.1f}" for k in PHASES), flush=True)

    t0 = time.perf_counter()
    trainer = Trainer(cfg, loaded, load_prompts(prompts, loaded.tokenizer), run_dir,
                      eval_prompts=load_prompts(eval_prompts, loaded.tokenizer),
                      options=RunOptions(on_step=on_step))
    summary = trainer.run()
    h = trainer.history
    k = max(1, len(h) // 4)
    mean = lambda key, part: float(np.mean([r[key] for r in part if r.get(key) is not None]))
    median = lambda key: float(np.median([r[key] for r in h]))
    row = {"config": name, "seed": seed, "steps": len(h), "sparsity": sparsity,
            "eval_start": summary["initial_eval_accuracy"], "eval_end": summary["final_eval_accuracy"],
            "reward_first": mean("reward_mean", h[:k]), "reward_last": mean("reward_mean", h[-k:]),
            "alpha_lb_p5": mean("alpha_lb_p5", h), "mismatch_kl": mean("mismatch_kl", h),
            "label": summary["label"], **{k.replace("_seconds", "_s"): median(k) for k in PHASES},
            "wall_s": time.perf_counter() - t0}
    write_bytes(done, json.dumps(row).encode())
    return row


def run_key(args, name: str) -> dict[str, object]:
    """What a finished run must agree on to be reused (its config and seed are in its folder's name)."""
    keys = ("model", "level", "train_prompts", "eval_prompts", "steps", "eval_every", "prompts_per_step",
            "samples", "max_new_tokens", "lr", "lora_rank", "micro_batch", "bin_width")
    sparse = flags(args, "planned") | {"--schedule": str(args.schedule) if args.schedule else None}
    return flags(args, *keys) | (sparse if name == "planned" else {})


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    configs, seeds = args.configs.split(","), [int(s) for s in args.seeds.split(",")]
    for name in configs:
        if name not in CONFIGS:
            raise SystemExit(f"--configs takes dense and planned, got {name!r}")
    for name in configs:  # every run begun, before any work
        for seed in seeds:
            reuse_or_refuse(args.out / f"{name}-seed{seed}", run_key(args, name), quiet=True)
    tokenizer = spec_tokenizer(args.model)
    prompts = prompt_file(tokenizer, args, "train_prompts", 0, args.out / "prompts.parquet")
    eval_prompts = prompt_file(tokenizer, args, "eval_prompts", 1, args.out / "eval_prompts.parquet")
    rows = []
    for name in configs:
        for seed in seeds:
            print(f"== {name}, seed {seed}", flush=True)
            rows.append(run_one(args, name, seed, prompts, eval_prompts))
    print(f"{args.model}, code (level {args.level or 'default'}), {args.steps} steps x "
          f"{args.prompts_per_step} prompts x {args.samples} samples, {args.max_new_tokens} new tokens, "
          f"LoRA rank {args.lora_rank}, lr {args.lr}, {torch.get_num_threads()} threads")
    print(f"{'config':>8} {'seed':>4} {'eval 0':>6} {'eval N':>6} {'rwd 1st':>7} {'rwd last':>8} "
          f"{'a-lb p5':>7} {'mis KL':>8} {'label':>9} {'roll s':>6} {'score s':>7} {'upd s':>6} "
          f"{'reward s':>8}")
    for r in rows:
        print(f"{r['config']:>8} {r['seed']:>4} {r['eval_start']:>6.3f} {r['eval_end']:>6.3f} "
              f"{r['reward_first']:>7.3f} {r['reward_last']:>8.3f} {r['alpha_lb_p5']:>7.3f} "
              f"{r['mismatch_kl']:>8.2e} {r['label']:>9} {r['rollout_s']:>6.1f} {r['scoring_s']:>7.1f} "
              f"{r['update_s']:>6.1f} {r['reward_s']:>8.2f}")
    dense = [r for r in rows if r["config"] == "dense"]
    if len(dense) > 1:
        finals = np.array([r["eval_end"] for r in dense])
        gains = finals - np.array([r["eval_start"] for r in dense])
        print(f"dense: eval gain {gains.mean():.3f} (per seed {np.round(gains, 3).tolist()}), spread of the "
              f"final eval accuracy over seeds: range {finals.max() - finals.min():.3f}")
    write_results(rows, "train_code", args.results)


if __name__ == "__main__":
    stop_on_interrupt(main, "finished runs kept (a stopped run starts over: it keeps no checkpoint)")
