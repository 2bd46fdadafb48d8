"""Rollout throughput with Ray workers: one process against 1 and 2 workers (`RolloutPool`), same rollouts.

Measured in one run on this machine, on the same prompts, seeds and engine settings (EOS ignored so
every configuration generates the same tokens): the engine in this process (1 thread, and torch's
default threads), then a pool of 1 worker and a pool of 2 workers, each worker one process with
`--threads` torch threads and the model loaded once. Pool start-up (processes, imports, model load)
is timed apart from the rollouts; each configuration does one warm-up run, then `--reps` timed runs
(the best is reported: the machine is shared, and the best run is the least disturbed one). The
2-worker / 1-worker ratio of tokens/s is the scaling; with 2 CPU cores shared with other users expect
well under 2x. On a cluster each worker owns a GPU (`--device cuda`, one per actor).
Writes scale.parquet into --results (default bench/results).

    .venv/bin/python bench/scale.py                              # SmolLM2-135M, 4 prompts x 2 x 32 tokens
    .venv/bin/python bench/scale.py --prompts 16 --new-tokens 128 --reps 2   # a longer one
"""

from __future__ import annotations

import os
import platform
import time

import torch
from common import bench_parser, write_results

from sparrow.stages.backends.ray_pool import RolloutPool
from sparrow.stages.core.sparsity import as_policy
from sparrow.stages.engine import SamplingParams
from sparrow.stages.model.loading import load_model
from sparrow.stages.rollout import RolloutOptions, merge_summaries, rollout_shard, run_rollouts
from sparrow.stages.tasks import make_prompts


def best(fn, reps: int) -> tuple[float, object]:
    fn()  # warm-up
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        runs.append((time.perf_counter() - t0, out))
    return min(runs, key=lambda r: r[0])


def main() -> None:
    ap = bench_parser(__doc__, "scale")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--budget", type=int, default=None, help="sparse rollouts at this budget (default dense)")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    loaded = load_model(args.model)
    rows = make_prompts("basic_arithmetic", args.prompts, 0, loaded.tokenizer)
    rows = [{k: r[k] for k in ("prompt_id", "prompt_token_ids")} for r in rows]
    opts = RolloutOptions(sampling=SamplingParams(max_new_tokens=args.new_tokens, n=args.samples, seed=0,
                                                  ignore_eos=True),
                          max_batch=args.prompts * args.samples, policy=as_policy(args.budget))
    tokens = args.prompts * args.samples * args.new_tokens
    results = []
    default_threads = torch.get_num_threads()
    for threads in sorted({1, default_threads}):
        torch.set_num_threads(threads)
        seconds, _ = best(lambda: run_rollouts(loaded, rows, opts), args.reps)
        results.append({"config": f"in-process ({threads} thread(s))", "workers": 0, "startup_s": 0.0,
                        "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds})
        print(f"in-process, {threads} thread(s): {seconds:.2f} s", flush=True)
    torch.set_num_threads(default_threads)
    for n in (int(x) for x in args.workers.split(",")):
        t0 = time.perf_counter()
        pool = RolloutPool(args.model, n, device=args.device, threads=args.threads)
        pool.pids()  # every worker up, model loaded
        startup = time.perf_counter() - t0
        try:
            seconds, parts = best(lambda: pool.map(rollout_shard, rows, opts), args.reps)  # noqa: B023 (used at once)
        finally:
            pool.close()
        summary = merge_summaries(parts, seconds)
        assert summary.tokens == tokens
        results.append({"config": f"{n} Ray worker(s) x {args.threads} thread(s)", "workers": n,
                        "startup_s": startup, "seconds": seconds, "tokens": tokens,
                        "tokens_per_s": tokens / seconds})
        print(f"{n} worker(s): start-up {startup:.1f} s, {seconds:.2f} s", flush=True)
    base = next((r for r in results if r["workers"] == 1), results[0])
    print(f"{platform.node()}: {os.cpu_count()} CPUs (shared), {args.model}, {args.prompts} prompts x "
          f"{args.samples} samples x {args.new_tokens} tokens, budget {args.budget or 'dense'}")
    print(f"{'config':<34}{'startup s':>10}{'seconds':>9}{'tokens/s':>10}{'vs 1 worker':>13}")
    for r in results:
        r["vs_one_worker"] = r["tokens_per_s"] / base["tokens_per_s"]
        print(f"{r['config']:<34}{r['startup_s']:>10.1f}{r['seconds']:>9.2f}{r['tokens_per_s']:>10.1f}"
              f"{r['vs_one_worker']:>12.2f}x")
    write_results(results, "scale", args.results)


if __name__ == "__main__":
    main()
