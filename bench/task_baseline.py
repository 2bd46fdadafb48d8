"""Starting reward of a task on a model: is there a GRPO signal before any training?

Samples N prompts x K samples with our engine (`run_rollouts`, the `sparrow rollout` path, rewards from
the task registry's scorer) and prints, per variant, the mean reward, the accuracy (reward == 1) and the
fraction of prompts whose K samples do not all get the same reward (the groups from which GRPO gets a
non-zero advantage), at temperature 1 and greedy. Variants: the short prompt (dense), the long prompt
(dense) and the long prompt at a sparse budget (block top-k from the first decode step on). The same
seed gives the same keys and codes at both lengths, so short vs long differ only by filler.

    .venv/bin/python bench/task_baseline.py                      # passkey on smollm2-135m, a few minutes
    .venv/bin/python bench/task_baseline.py --n 16 --k 8 --long-tokens 3000 --budget 256
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np

from sparrow.stages.core.sparsity import as_policy
from sparrow.stages.engine import SamplingParams
from sparrow.stages.model.loading import LoadedModel, load_model
from sparrow.stages.rollout import RolloutOptions, run_rollouts
from sparrow.stages.tasks import make_prompts


@dataclass
class Result:
    variant: str
    prompt_tokens: float
    budget: int
    temperature: float
    samples: int
    reward: float
    accuracy: float
    signal: float  # fraction of prompts whose samples' rewards are not all equal
    new_tokens: float
    seconds: float


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--task", default="passkey")
    p.add_argument("--n", type=int, default=8, help="prompts per variant")
    p.add_argument("--k", type=int, default=4, help="samples per prompt at temperature 1")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (sampling seed too)")
    p.add_argument("--short-tokens", type=int, default=256)
    p.add_argument("--long-tokens", type=int, default=1500)
    p.add_argument("--distractors", type=int, default=None, help="task option, when the task takes it")
    p.add_argument("--budget", type=int, default=128, help="sparse budget for the long variant (0: skip)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=32)
    return p.parse_args()


def run_variant(
    loaded: LoadedModel,
    rows: list[dict],
    variant: str,
    budget: int,
    temperature: float,
    k: int,
    args: argparse.Namespace,
) -> Result:
    sampling = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=temperature,
        n=k if temperature > 0 else 1,
        seed=args.seed,
    )
    opts = RolloutOptions(sampling=sampling, max_batch=args.max_batch, policy=as_policy(budget or None))
    t0 = time.perf_counter()
    table, _ = run_rollouts(loaded, rows, opts)
    seconds = time.perf_counter() - t0
    rewards = np.asarray(table.column("reward").to_pylist(), dtype=np.float64)
    groups = rewards.reshape(len(rows), -1)
    return Result(
        variant,
        float(np.mean([len(r["prompt_token_ids"]) for r in rows])),
        budget,
        temperature,
        rewards.size,
        float(rewards.mean()),
        float((rewards == 1.0).mean()),
        float((groups.max(1) > groups.min(1)).mean()),
        float(np.mean([len(t) for t in table.column("token_ids").to_pylist()])),
        seconds,
    )


def print_table(results: list[Result]) -> None:
    header = (
        f"{'variant':<8} {'prompt tok':>10} {'budget':>7} {'temp':>5} {'samples':>7} {'reward':>7} "
        f"{'acc':>6} {'signal':>7} {'new tok':>8} {'seconds':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.variant:<8} {r.prompt_tokens:>10.0f} {r.budget or 'dense':>7} {r.temperature:>5.1f} "
            f"{r.samples:>7} {r.reward:>7.3f} {r.accuracy:>6.3f} {r.signal:>7.2f} {r.new_tokens:>8.1f} "
            f"{r.seconds:>8.1f}"
        )


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    loaded = load_model(args.model)
    options = {} if args.distractors is None else {"distractors": args.distractors}
    prompts = {
        name: make_prompts(args.task, args.n, args.seed, loaded.tokenizer, context_tokens=tokens, **options)
        for name, tokens in (("short", args.short_tokens), ("long", args.long_tokens))
    }
    plan = [("short", 0), ("long", 0)] + ([("long", args.budget)] if args.budget else [])
    results = []
    for variant, budget in plan:
        for temperature, k in ((1.0, args.k), (0.0, 1)):
            results.append(run_variant(loaded, prompts[variant], variant, budget, temperature, k, args))
            print(
                f"  done: {variant} budget={budget or 'dense'} T={temperature} ({results[-1].seconds:.0f}s)",
                flush=True,
            )
    print(
        f"\n{args.task} on {args.model}: {args.n} prompts x {args.k} samples at T=1 (1 greedy), "
        f"max_new_tokens {args.max_new_tokens}, seed {args.seed}"
    )
    print_table(results)
    print(f"total wall time {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
