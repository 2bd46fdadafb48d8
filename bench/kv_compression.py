"""KV compression (Sparse-RL's SnapKV and R-KV eviction) against dense and block top-k, at equal budgets.

Three parts, each printed as a table and written to kv_compression-<part>.parquet in --results
(default bench/results; the train part's runs in its kv-compression-runs/):

- `rollout`: long generation (EOS ignored) after a passkey prompt, every policy at --budget: the KV
  tokens the decode steps held against what dense caches would have held (mean and fullest step;
  "saved" = 1 - mean held / mean dense), the pool pages in use at the fullest step, the decode tokens/s
  with a pool large enough for everyone, then a fixed pool of the pages dense needs for --samples
  samples at full length: how many samples it holds at full length with no preemption by the engine's
  own sizing (`Workload.pages`, "admits"), and --pool-batch x the samples run through it: the largest
  batch that ran, the mean batch and the preemptions; and, by teacher-forced scoring of each policy's
  own trajectories (the eviction replayed, full-vocabulary alpha against dense), the mean and the 5th
  percentile of alpha per position bin, and the largest |replayed - sampled| logprob (the replay
  invariant at this scale).
  Block top-k keeps every token, so it saves no KV storage: its row is the read-budget baseline. The
  CPU's cascade attention is off for every policy here (its prompt copies hold pool pages for dense and
  block top-k, never for eviction, which would skew the page counts; "pages" counts samples' KV only).
- `accuracy`: greedy passkey accuracy on --eval-prompts held-out prompts, dense and each policy at each
  of --budgets (the answer needs tokens far back in the prompt, which eviction may have dropped).
- `train`: GRPO as bench/train.py runs it, dense and SnapKV at --train-budget with and without
  `--correction sparse-rl` (and SnapKV at --small-budget, Sparse-RL's failure case): eval accuracy
  before and after (greedy, dense) and, for every run, after training under SnapKV at --train-budget and
  at --small-budget (robustness: does training with compression make the model better under
  compression than training dense does?), training reward first -> last, mismatch KL, masked / vetoed
  fractions, the label.

On a CPU run it with --threads 1 (the machine is shared); the GPU variant (bench/gpu_checks.sh
kv-compression) runs `rollout` at Qwen3-4B shapes with random bf16 weights and random prompt tokens.

    .venv/bin/python bench/kv_compression.py all --threads 1
    .venv/bin/python bench/kv_compression.py rollout --model qwen3-4b --random-weights --device cuda \\
        --context 4096 --new-tokens 2048 --samples 32 --budget 512
"""

from __future__ import annotations

import shutil
import time

import numpy as np
import torch
from common import bench_parser, write_results

from sparrow.schemas import write_artifact
from sparrow.stages.core.sparsity import as_policy
from sparrow.stages.engine import Engine, EngineConfig, SamplingParams
from sparrow.stages.engine.memory import Workload
from sparrow.stages.kv_policies import RKV, SnapKV
from sparrow.stages.model.loading import load_model
from sparrow.stages.scoring.mismatch import score_sequences
from sparrow.stages.tasks import make_prompts, score_batch

RUNS = "kv-compression-runs"  # in --results
CASCADE = False  # the CPU's shared-prompt copies take pool pages for dense and block top-k only: off for all


def policies(budget: int, buffer: int | None) -> dict[str, object]:
    """Dense, SnapKV, R-KV and block top-k at one budget (block top-k's a multiple of 16 pages)."""
    kw = {} if buffer is None else {"buffer": buffer}
    return {"dense": None, f"snapkv:{budget}": SnapKV(budget, **kw), f"rkv:{budget}": RKV(budget, **kw),
            f"block-topk:{budget // 16 * 16}": budget // 16 * 16}


def passkey_prompts(loaded, n: int, seed: int, context: int) -> list[dict]:
    return make_prompts("passkey", n, seed, loaded.tokenizer, context_tokens=context)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_id": f"r{i}", "task": "passkey", "answer": None, "metadata": None,
             "prompt_token_ids": torch.randint(3, vocab, (length,), generator=g).tolist()} for i in range(n)]


# ---------------------------------------------------------------- rollout

def run_rollout(args, loaded, rows) -> list[dict]:
    model, device = loaded.model, loaded.model.embed_tokens.weight.device
    prompts = [r["prompt_token_ids"] for r in rows]
    params = SamplingParams(max_new_tokens=args.new_tokens, n=args.samples, temperature=1.0, seed=0,
                            ignore_eos=True)
    n_samples = len(prompts) * args.samples
    dense_pool = Workload.of([(len(p), args.samples, args.new_tokens) for p in prompts], n_samples,
                             16).pages()
    out = []
    for name, sparsity in policies(args.budget, args.buffer).items():
        with Engine(model, as_policy(sparsity), EngineConfig(max_batch=n_samples, cascade=CASCADE)) as engine:
            t0 = time.perf_counter()
            results = engine.generate(prompts, params)
            wall = time.perf_counter() - t0
            s = engine.stats
        row = {"policy": name, "prompt_tokens": int(np.mean([len(p) for p in prompts])),
               "samples": n_samples, "new_tokens": args.new_tokens,
               "kv_mean": s.kv_tokens_sum / s.decode_steps,
               "dense_kv_mean": s.dense_kv_tokens_sum / s.decode_steps, "kv_peak": s.kv_tokens_peak,
               "dense_kv_peak": s.dense_kv_tokens_peak, "peak_pages": s.peak_pages,
               "compactions": s.compactions, "decode_tok_s": s.decode_tokens / s.decode_s, "wall_s": wall}
        row["kv_saved"] = 1 - row["kv_mean"] / row["dense_kv_mean"]
        row["admits"] = admitted(prompts, args.new_tokens, sparsity, dense_pool)
        # the same requests, more samples each, through the pool dense needs for --samples per prompt
        more = SamplingParams(max_new_tokens=args.new_tokens, n=args.samples * args.pool_batch,
                              temperature=1.0, seed=0, ignore_eos=True)
        with Engine(model, as_policy(sparsity), EngineConfig(max_batch=n_samples * args.pool_batch,
                                                             num_pages=dense_pool,
                                                             cascade=CASCADE)) as engine:
            engine.generate(prompts, more)
            s = engine.stats
        row.update({"pool_pages": dense_pool, "pool_samples": n_samples * args.pool_batch,
                    "pool_max_batch": s.max_running, "pool_mean_batch": s.decode_tokens / s.decode_steps,
                    "pool_preemptions": s.preemptions, "pool_decode_tok_s": s.decode_tokens / s.decode_s})
        if not args.no_alpha:
            row.update(alpha_by_bin(args, model, prompts, results, sparsity, device))
        out.append(row)
        print(f"  {name}: {row}", flush=True)
    return out


def admitted(prompts: list[list[int]], new_tokens: int, sparsity, pages: int) -> int:
    """The most samples (the same number per prompt) a pool of `pages` holds at full length with no
    preemption, by the engine's own sizing (`Workload.pages`)."""
    policy = () if sparsity is None or isinstance(sparsity, int) else (sparsity,)
    best = 0
    for n in range(1, 257):
        work = Workload.of([(len(p), n, new_tokens, *policy) for p in prompts], n * len(prompts), 16)
        if work.pages() > pages:
            break
        best = n
    return best * len(prompts)


def alpha_by_bin(args, model, prompts, results, sparsity, device) -> dict:
    """Mean and p5 alpha per position bin of the policy's own trajectories, scored teacher forced."""
    if sparsity is None:
        return {"replay_max_err": 0.0}
    mode = sparsity
    alphas, positions, errs = [], [], []
    t0 = time.perf_counter()
    for prompt, samples in zip(prompts, results):
        scored = score_sequences(model, [prompt] * len(samples), [c.token_ids for c in samples], [mode])
        alpha, logp = scored.sparse[mode]
        alphas.append(alpha)
        positions.append(scored.position)
        errs.append(np.abs(logp - np.concatenate([c.logprobs for c in samples])).max())
    alpha, position = np.concatenate(alphas), np.concatenate(positions)
    bins = position // args.bin_width
    out = {"replay_max_err": float(max(errs)), "scoring_s": time.perf_counter() - t0,
           "alpha_mean": float(alpha.mean()), "alpha_p5": float(np.quantile(alpha, 0.05))}
    for b in np.unique(bins):
        sel = alpha[bins == b]
        out[f"bin{b}_mean"], out[f"bin{b}_p5"] = float(sel.mean()), float(np.quantile(sel, 0.05))
    return out


def print_rollout(rows: list[dict], args) -> None:
    print(f"{'policy':>16} {'KV mean':>8} {'dense':>7} {'saved':>6} {'KV peak':>8} {'dense':>7} "
          f"{'pages':>6} {'dec tok/s':>9} | {'pool':>5} {'admits':>6} {'max b':>5} {'mean b':>6} "
          f"{'preempt':>7} {'tok/s':>6} | "
          f"{'a mean':>6} {'a p5':>5} {'replay err':>10}")
    for r in rows:
        a = (f"{r['alpha_mean']:>6.3f} {r['alpha_p5']:>5.3f} {r['replay_max_err']:>10.1e}"
             if "alpha_mean" in r else f"{'1':>6} {'1':>5} {'-':>10}")
        print(f"{r['policy']:>16} {r['kv_mean']:>8.0f} {r['dense_kv_mean']:>7.0f} {r['kv_saved']:>6.3f} "
              f"{r['kv_peak']:>8} {r['dense_kv_peak']:>7} {r['peak_pages']:>6} {r['decode_tok_s']:>9.1f} | "
              f"{r['pool_pages']:>5} {r['admits']:>6} {r['pool_max_batch']:>5} {r['pool_mean_batch']:>6.1f} "
              f"{r['pool_preemptions']:>7} {r['pool_decode_tok_s']:>6.1f} | {a}")
    bins = sorted({k.split("_")[0] for r in rows for k in r if k.startswith("bin")},
                  key=lambda k: int(k[3:]))
    if bins:
        print(f"alpha per {args.bin_width}-token position bin (mean / p5):")
        print(f"{'policy':>16} " + " ".join(f"{b + ' [' + str(int(b[3:]) * args.bin_width) + ')':>14}"
                                            for b in bins))
        for r in rows:
            if "alpha_mean" in r:
                print(f"{r['policy']:>16} " + " ".join(
                    f"{r.get(b + '_mean', float('nan')):>6.3f} / {r.get(b + '_p5', float('nan')):>5.3f}"
                    for b in bins))


# ---------------------------------------------------------------- accuracy

def run_accuracy(args, loaded) -> list[dict]:
    rows = passkey_prompts(loaded, args.eval_prompts, 1, args.context)
    prompts = [r["prompt_token_ids"] for r in rows]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    out = []
    specs = {"dense": None}
    for b in [int(x) for x in args.budgets.split(",")]:
        specs.update({k: v for k, v in policies(b, args.buffer).items() if v is not None})
    for name, sparsity in specs.items():
        with Engine(loaded.model, as_policy(sparsity), EngineConfig(max_batch=16)) as engine:
            results = engine.generate(prompts, params)
        texts = [loaded.tokenizer.decode(r[0].token_ids, skip_special_tokens=True) for r in results]
        rewards = score_batch([(r["task"], t, r["answer"], r.get("metadata")) for r, t in zip(rows, texts)])
        acc = float(np.mean([x >= 1 - 1e-9 for x in rewards]))
        out.append({"policy": name, "prompts": len(rows), "accuracy": acc})
        print(f"  {name}: accuracy {acc:.3f}", flush=True)
    return out


# ---------------------------------------------------------------- train

def train_configs(args) -> dict[str, dict]:
    snap = SnapKV(args.train_budget, **({} if args.buffer is None else {"buffer": args.buffer})).spec()
    small = SnapKV(args.small_budget, **({} if args.buffer is None else {"buffer": args.buffer})).spec()
    every = {"dense": dict(sparsity="dense", correction="tis"),
             f"snapkv:{args.train_budget}": dict(sparsity=snap, correction="none"),
             f"snapkv:{args.train_budget}+sparse-rl": dict(sparsity=snap, correction="sparse-rl"),
             f"snapkv:{args.small_budget}+sparse-rl": dict(sparsity=small, correction="sparse-rl")}
    names = args.configs.split(",") if args.configs else list(every)
    unknown = [k for k in names if k not in every]
    if unknown:
        raise SystemExit(f"--configs: unknown {', '.join(unknown)} (known: {', '.join(every)})")
    return {k: every[k] for k in names}


def run_train(args) -> list[dict]:
    from sparrow.stages.train import RunOptions, TrainConfig, Trainer, load_prompts

    base = load_model(args.model)
    runs = args.results / RUNS
    runs.mkdir(parents=True, exist_ok=True)
    train_file = write_artifact(passkey_prompts(base, args.train_prompts, 0, args.context),
                                runs / "prompts.parquet", "prompts")
    eval_file = write_artifact(passkey_prompts(base, args.eval_prompts, 1, args.context),
                               runs / "eval_prompts.parquet", "prompts")
    buffer = {} if args.buffer is None else {"buffer": args.buffer}
    probes = {b: SnapKV(b, **buffer) for b in (args.train_budget, args.small_budget)}
    out = []
    for name, overrides in train_configs(args).items():
        loaded = load_model(args.model)
        run_dir = runs / name.replace(":", "-")
        shutil.rmtree(run_dir, ignore_errors=True)
        cfg = TrainConfig(model=args.model, steps=args.steps, prompts_per_step=args.prompts_per_step,
                          samples=args.samples, max_new_tokens=args.max_new_tokens, lr=args.lr,
                          lora_rank=args.lora_rank, seed=0, micro_batch=args.micro_batch,
                          checkpoint_every=args.steps, eval_every=args.steps, bin_width=args.bin_width,
                          **overrides)
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        trainer = Trainer(cfg, loaded, load_prompts(train_file, loaded.tokenizer), run_dir,
                          eval_prompts=load_prompts(eval_file, loaded.tokenizer),
                          options=RunOptions(on_step=lambda r: print(
                              f"    step {r['step']}: reward {r['reward_mean']:.3f} ({r['seconds']:.0f} s)",
                              flush=True)))
        summary = trainer.run()
        under = {}
        for b, probe in probes.items():  # the trained model, evaluated under SnapKV at both budgets
            trainer.sparsity = probe
            under[f"eval_end_snapkv{b}"] = trainer.evaluate(sparse=True)
        h = trainer.history
        k = max(1, len(h) // 4)
        mean = lambda key, part: float(np.mean([r[key] for r in part if r.get(key) is not None]))
        out.append({"config": name, "steps": len(h), "sparsity": cfg.sparsity,
                    "correction": cfg.correction, "eval_start": summary["initial_eval_accuracy"],
                    "eval_end": summary["final_eval_accuracy"],
                    **under, "reward_first": mean("reward_mean", h[:k]),
                    "reward_last": mean("reward_mean", h[-k:]), "alpha_lb_p5": mean("alpha_lb_p5", h),
                    "mismatch_kl": mean("mismatch_kl", h), "masked": mean("masked_fraction", h),
                    "vetoed": mean("vetoed_fraction", h), "label": summary["label"],
                    "rollout_s": mean("rollout_seconds", h), "wall_s": time.perf_counter() - t0})
    return out


def print_train(rows: list[dict], budgets: tuple[int, int]) -> None:
    under = [f"eval_end_snapkv{b}" for b in budgets]
    print(f"{'config':>26} {'eval 0':>6} {'eval N':>6} " + " ".join(f"{'N@' + str(b):>6}" for b in budgets)
          + f" {'rwd 1st':>7} {'rwd last':>8} {'a-lb p5':>7} {'mis KL':>8} {'masked':>6} {'vetoed':>6} "
          f"{'label':>10} {'roll s':>6}")
    for r in rows:
        print(f"{r['config']:>26} {r['eval_start']:>6.3f} {r['eval_end']:>6.3f} "
              + " ".join(f"{r[k]:>6.3f}" for k in under) + " "
              f"{r['reward_first']:>7.3f} {r['reward_last']:>8.3f} {r['alpha_lb_p5']:>7.3f} "
              f"{r['mismatch_kl']:>8.2e} {r['masked']:>6.3f} {r['vetoed']:>6.3f} {r['label']:>10} "
              f"{r['rollout_s']:>6.1f}")


def main() -> None:
    ap = bench_parser(__doc__, "kv_compression-rollout", "kv_compression-accuracy", "kv_compression-train")
    ap.add_argument("part", choices=("rollout", "accuracy", "train", "all"))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--random-weights", action="store_true",
                    help="shapes-only preset, random prompt tokens")
    ap.add_argument("--context", type=int, default=256, help="passkey prompt tokens")
    ap.add_argument("--budget", type=int, default=128, help="rollout: the KV budget of every policy")
    ap.add_argument("--buffer", type=int, default=None, help="eviction buffer (default 128)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--samples", type=int, default=4, help="per prompt")
    ap.add_argument("--new-tokens", type=int, default=384, help="rollout: tokens generated per sample")
    ap.add_argument("--pool-batch", type=int, default=2,
                    help="rollout: the fixed pool's samples, x --samples")
    ap.add_argument("--bin-width", type=int, default=128)
    ap.add_argument("--no-alpha", action="store_true", help="rollout: skip the teacher-forced scoring")
    ap.add_argument("--budgets", default="64,128,192", help="accuracy: KV budgets")
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=12, help="accuracy and train")
    ap.add_argument("--train-budget", type=int, default=128)
    ap.add_argument("--small-budget", type=int, default=64)
    ap.add_argument("--configs", default=None, help="train: a comma list (default: all)")
    ap.add_argument("--train-prompts", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    print(f"{args.model} on {args.device} ({dtype}), {torch.get_num_threads()} threads", flush=True)
    if args.part in ("rollout", "all"):
        loaded = load_model(args.model, device=args.device, dtype=dtype, random_weights=args.random_weights)
        rows = (random_prompts(args.prompts, args.context, loaded.config.vocab_size, 0)
                if args.random_weights else passkey_prompts(loaded, args.prompts, 0, args.context))
        print(f"rollout: {args.prompts} prompts of ~{args.context} tokens x {args.samples} samples x "
              f"{args.new_tokens} new tokens, budget {args.budget}", flush=True)
        result = run_rollout(args, loaded, rows)
        print_rollout(result, args)
        write_results(result, "kv_compression-rollout", args.results)
    if args.part in ("accuracy", "all"):
        loaded = load_model(args.model, device=args.device, dtype=dtype)
        print(f"accuracy: passkey at {args.context} tokens, {args.eval_prompts} prompts, greedy", flush=True)
        write_results(run_accuracy(args, loaded), "kv_compression-accuracy", args.results)
    if args.part in ("train", "all"):
        rows = run_train(args)
        print(f"GRPO: passkey at {args.context} tokens, {args.steps} steps x {args.prompts_per_step} "
              f"prompts x {args.samples} samples, {args.max_new_tokens} new tokens, LoRA {args.lora_rank}, "
              f"lr {args.lr}")
        print_train(rows, (args.train_budget, args.small_budget))
        write_results(rows, "kv_compression-train", args.results)


if __name__ == "__main__":
    main()
