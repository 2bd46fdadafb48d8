"""Teacher-forced sparse scoring vs a dense forward pass over the same sequences (CPU).

Issue target: scoring one budget costs at most 3x a dense forward pass. Measured in one run on the
same machine, SmolLM2-135M, 8 sequences of 4K tokens (a 3K prompt + 1K completion tokens):
- dense forward: one plain forward pass (logits) over the whole sequences, the baseline;
- score(b): `score_sequences` with one budget b, everything the profile does for that budget
  (dense prefill, dense and sparse completion passes, alpha over the full vocabulary);
- marginal(b): score(b) minus scoring with no budget, the cost of each extra budget.
Prints tokens/s, ratios and peak resident memory; writes profile_scoring.parquet into --results (default
bench/results).

    .venv/bin/python bench/profile_scoring.py [--seqs 8] [--prompt 3072] [--completion 1024]
"""

from __future__ import annotations

import resource
import time

import torch
from common import bench_parser, write_results

from sparrow.stages.model.loading import load_model
from sparrow.stages.scoring.mismatch import score_sequences


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    ap = bench_parser(__doc__, "profile_scoring")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=3072)
    ap.add_argument("--completion", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2, help="sequences per pass")
    ap.add_argument("--budgets", default="256,512,1024")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = load_model("smollm2-135m").model
    total = args.prompt + args.completion
    tokens = torch.randint(100, 49000, (args.seqs, total))
    batches = [tokens[s:s + args.batch] for s in range(0, args.seqs, args.batch)]

    def timed(fn) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            for x in batches:
                fn(x)
        return time.perf_counter() - t0

    def score(budgets):
        return lambda x: score_sequences(model, x[:, : args.prompt].tolist(),
                                         x[:, args.prompt:].tolist(), budgets)

    n_tok = args.seqs * total
    dense_s = timed(lambda x: model(x))
    base_s = timed(score([]))
    rows = [{"mode": "dense forward", "budget": 0, "seconds": dense_s, "ratio_to_dense": 1.0},
            {"mode": "score, no budget", "budget": 0, "seconds": base_s,
             "ratio_to_dense": base_s / dense_s}]
    for b in [int(x) for x in args.budgets.split(",")]:
        s = timed(score([b]))
        rows.append({"mode": "score 1 budget", "budget": b, "seconds": s, "ratio_to_dense": s / dense_s})
        rows.append({"mode": "marginal budget", "budget": b, "seconds": s - base_s,
                     "ratio_to_dense": (s - base_s) / dense_s})
    for r in rows:
        r["tokens_per_s"] = n_tok / r["seconds"] if r["seconds"] > 0 else float("inf")
        r["peak_rss_gib"] = peak_rss_gib()
    print(f"SmolLM2-135M, {args.seqs} sequences x {total} tokens ({args.prompt} prompt + "
          f"{args.completion} completion), batch {args.batch}, {torch.get_num_threads()} threads")
    print(f"{'mode':>17} {'budget':>7} {'seconds':>8} {'tok/s':>8} {'x dense fwd':>11}")
    for r in rows:
        print(f"{r['mode']:>17} {r['budget']:>7} {r['seconds']:>8.2f} {r['tokens_per_s']:>8.0f} "
              f"{r['ratio_to_dense']:>11.2f}")
    print(f"peak resident memory {peak_rss_gib():.2f} GiB")
    write_results(rows, "profile_scoring", args.results)


if __name__ == "__main__":
    main()
