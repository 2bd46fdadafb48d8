"""GRPO on the embedded model: dense vs sparse rollouts with and without correction, same seeds.

Runs `sparrow.stages.train.Trainer` once per configuration (and per seed), each from the same base
weights, on a learnable task (`passkey` by default, its answer pages back in the prompt), and prints per
run: eval accuracy (greedy, dense, held-out prompts of another seed) at the start and at the end,
training reward over the first and last steps, the p5 of the top-20 lower bound of alpha, the mismatch
KL, masked/vetoed fractions, the collapse label, and seconds per step split into rollout / scoring /
update. Configurations:
- `dense`: the dense sampler (the reference: rollouts are on-policy up to float rounding);
- `planned+tis`: the --planned budget (the schedule a user would plan) with truncated IS;
- `aggressive`: the --aggressive budget, no correction (the baseline expected to drift);
- `aggressive+sparse-rl`: the same budget with Sparse-RL's correction;
- the peers' modes (issue 29), each on the aggressive budget (does any keep the run stable, at what
  masked fraction?) and on the planned one (does any cost accuracy?): `+icepop`, `+seq-mask-tis`
  (geometric-mean filter + token TIS), `+geo-rs` (verl's seq_mean_k1 alone), `+opsm`, `+sparrow` (the
  released recipe: stochastic rejection + alpha reweighting + TIS) and `+sparrow-os` (the same with
  8 samples per prompt, the 4 of highest acceptance kept).
Whether GRPO learned: the dense run's eval gain against the spread of its final eval accuracy over
--seeds (reported, not asserted). Writes train.parquet into --results (default bench/results) and one run
directory per run under its train-runs/.

    .venv/bin/python bench/train.py                                     # defaults: minutes per run on 2 cores
    .venv/bin/python bench/train.py --steps 30 --seeds 0,1,2 --configs dense
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import torch
from common import bench_parser, write_results

from sparrow.schemas import write_artifact
from sparrow.stages.model.loading import load_model
from sparrow.stages.tasks import make_prompts
from sparrow.stages.train import RunOptions, TrainConfig, Trainer, load_prompts

RUNS = "train-runs"  # in --results


def make_prompt_file(loaded, task: str, n: int, seed: int, context: int, path: Path) -> Path:
    rows = make_prompts(task, n, seed, loaded.tokenizer, context_tokens=context)
    return write_artifact(rows, path, "prompts")


def configs(args) -> dict[str, dict]:
    all_configs = {
        "dense": dict(sparsity="dense", correction="tis"),
        "planned+tis": dict(sparsity=f"budget:{args.planned}", correction="tis"),
        "aggressive": dict(sparsity=f"budget:{args.aggressive}", correction="none"),
        "aggressive+sparse-rl": dict(sparsity=f"budget:{args.aggressive}", correction="sparse-rl"),
    }
    modes = {"icepop": dict(correction="icepop"), "seq-mask-tis": dict(correction="seq-mask-tis"),
             "geo-rs": dict(correction="none",
                            loss={"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.5_2"}),
             "opsm": dict(correction="opsm"), "sparrow": dict(correction="sparrow"),
             "sparrow-os": dict(correction="sparrow", oversample=2 * args.samples)}
    for budget_name, budget in (("planned", args.planned), ("aggressive", args.aggressive)):
        for mode, options in modes.items():
            all_configs[f"{budget_name}+{mode}"] = dict(sparsity=f"budget:{budget}", **options)
    unknown = [k for k in args.configs.split(",") if k not in all_configs]
    if unknown:
        raise SystemExit(f"--configs: unknown {', '.join(unknown)} (known: {', '.join(all_configs)})")
    return {k: all_configs[k] for k in args.configs.split(",")}


def run_one(args, name: str, overrides: dict, seed: int, prompts: Path, eval_prompts: Path) -> dict:
    loaded = load_model(args.model)  # fresh base weights for every run
    run_dir = args.results / RUNS / f"{name}-seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = TrainConfig(model=args.model, steps=args.steps, prompts_per_step=args.prompts_per_step,
                      samples=args.samples, max_new_tokens=args.max_new_tokens, lr=args.lr,
                      lora_rank=args.lora_rank, seed=seed, micro_batch=args.micro_batch,
                      checkpoint_every=args.steps, eval_every=args.eval_every or args.steps,
                      bin_width=args.bin_width,
                      **overrides)
    rows = load_prompts(prompts, loaded.tokenizer)
    held_out = load_prompts(eval_prompts, loaded.tokenizer)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, loaded, rows, run_dir, eval_prompts=held_out,
                      options=RunOptions(on_step=lambda r: print(
                          f"    {name} seed {seed} step {r['step']}: reward {r['reward_mean']:.3f} "
                          f"({r['seconds']:.0f} s)", flush=True)))
    summary = trainer.run()
    h = trainer.history
    k = max(1, len(h) // 4)
    mean = lambda key, part: float(np.mean([r[key] for r in part if r.get(key) is not None]))
    return {"config": name, "seed": seed, "steps": len(h), "sparsity": cfg.sparsity,
            "correction": cfg.correction, "eval_start": summary["initial_eval_accuracy"],
            "eval_end": summary["final_eval_accuracy"], "reward_first": mean("reward_mean", h[:k]),
            "reward_last": mean("reward_mean", h[-k:]), "alpha_lb_p5": mean("alpha_lb_p5", h),
            "mismatch_kl": mean("mismatch_kl", h), "masked": mean("masked_fraction", h),
            "vetoed": mean("vetoed_fraction", h), "label": summary["label"],
            "eval_sparse_end": next((r["eval_accuracy_sparse"] for r in reversed(h)
                                     if r.get("eval_accuracy_sparse") is not None), None),
            "rs_masked": mean("rollout_corr/rollout_rs_masked_fraction", h),
            "is_ess": mean("rollout_corr/rollout_is_eff_sample_size", h) if any(
                r.get("rollout_corr/rollout_is_eff_sample_size") is not None for r in h) else None,
            "skipped_updates": sum(r.get("update_skipped") is not None for r in h),
            "rollout_s": mean("rollout_seconds", h), "scoring_s": mean("scoring_seconds", h),
            "update_s": mean("update_seconds", h), "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = bench_parser(__doc__, "train")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="passkey")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--train-prompts", type=int, default=64)
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--eval-every", type=int, default=None, help="steps between evals (default: --steps)")
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--bin-width", type=int, default=512)
    ap.add_argument("--planned", type=int, default=256, help="the planned budget (tokens)")
    ap.add_argument("--aggressive", type=int, default=64, help="the aggressive budget (tokens)")
    ap.add_argument("--configs", default="dense,planned+tis,aggressive,aggressive+sparse-rl")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base = load_model(args.model)
    runs = args.results / RUNS
    runs.mkdir(parents=True, exist_ok=True)
    prompts = make_prompt_file(base, args.task, args.train_prompts, 0, args.context, runs / "prompts.parquet")
    eval_prompts = make_prompt_file(base, args.task, args.eval_prompts, 1, args.context,
                                    runs / "eval_prompts.parquet")
    rows = []
    for name, overrides in configs(args).items():
        for seed in [int(s) for s in args.seeds.split(",")]:
            print(f"== {name}, seed {seed}", flush=True)
            rows.append(run_one(args, name, overrides, seed, prompts, eval_prompts))
    print(f"{args.model}, {args.task} at {args.context} tokens, {args.steps} steps x {args.prompts_per_step} "
          f"prompts x {args.samples} samples, {args.max_new_tokens} new tokens, LoRA rank {args.lora_rank}, "
          f"lr {args.lr}, {torch.get_num_threads()} threads")
    print(f"{'config':>22} {'seed':>4} {'eval 0':>6} {'eval N':>6} {'rwd 1st':>7} {'rwd last':>8} "
          f"{'a-lb p5':>7} {'mis KL':>8} {'masked':>6} {'vetoed':>6} {'label':>9} {'roll s':>6} "
          f"{'score s':>7} {'upd s':>6} {'evalsp N':>8} {'skipped':>7}")
    for r in rows:
        print(f"{r['config']:>22} {r['seed']:>4} {r['eval_start']:>6.3f} {r['eval_end']:>6.3f} "
              f"{r['reward_first']:>7.3f} {r['reward_last']:>8.3f} {r['alpha_lb_p5']:>7.3f} "
              f"{r['mismatch_kl']:>8.2e} {r['masked']:>6.3f} {r['vetoed']:>6.3f} {r['label']:>9} "
              f"{r['rollout_s']:>6.1f} {r['scoring_s']:>7.1f} {r['update_s']:>6.1f} "
              f"{'-' if r['eval_sparse_end'] is None else format(r['eval_sparse_end'], '.3f'):>8} "
              f"{r['skipped_updates']:>7}")
    dense = [r for r in rows if r["config"] == "dense"]
    if len(dense) > 1:
        finals = np.array([r["eval_end"] for r in dense])
        gains = finals - np.array([r["eval_start"] for r in dense])
        print(f"dense: eval gain {gains.mean():.3f} (per seed {np.round(gains, 3).tolist()}), "
              f"spread of final eval accuracy over seeds: range {finals.max() - finals.min():.3f}, "
              f"std {finals.std(ddof=1):.3f}")
    write_results(rows, "train", args.results)


if __name__ == "__main__":
    main()
