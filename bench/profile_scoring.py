"""Teacher-forced sparse scoring vs a dense forward pass over the same sequences (CPU).

Issue target: scoring one budget costs at most 3x a dense forward pass. Measured in one run on the
same machine: a dense teacher-forced forward (hidden states, as the profile's dense pass) against a
sparse one at each budget, SmolLM2-135M, 8 sequences of 4K tokens (a 3K prompt + 1K generated).
Prints tokens/s, the ratio and peak resident memory; writes bench/results/profile_scoring.parquet.

    .venv/bin/python bench/profile_scoring.py [--seqs 8] [--len 4096] [--budgets 256,512,1024]
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from sparrow.stages.attention import SparseAttention
from sparrow.stages.mismatch import decode_budgets
from sparrow.stages.model.loading import load_model


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--len", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=3072)
    ap.add_argument("--batch", type=int, default=2, help="sequences per forward pass")
    ap.add_argument("--budgets", default="256,512,1024")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = load_model("smollm2-135m").model
    tokens = torch.randint(100, 49000, (args.seqs, args.len))
    positions = torch.arange(args.len).expand(args.batch, args.len)
    prompt_lens = torch.full((args.batch,), args.prompt)

    def run(attention_for) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            for s in range(0, args.seqs, args.batch):
                model.hidden_states(tokens[s:s + args.batch], positions=positions,
                                    attention=attention_for())
        return time.perf_counter() - t0

    rows = []
    dense_s = run(lambda: None)
    n_tok = args.seqs * args.len
    rows.append({"mode": "dense", "budget": 0, "seconds": dense_s, "tokens_per_s": n_tok / dense_s,
                 "ratio_to_dense": 1.0, "peak_rss_gib": peak_rss_gib()})
    for b in [int(x) for x in args.budgets.split(",")]:
        q_budgets = decode_budgets(positions, prompt_lens, lambda _, b=b: b)
        s = run(lambda q=q_budgets: SparseAttention(q))
        rows.append({"mode": "sparse", "budget": b, "seconds": s, "tokens_per_s": n_tok / s,
                     "ratio_to_dense": s / dense_s, "peak_rss_gib": peak_rss_gib()})
    print(f"SmolLM2-135M, {args.seqs} sequences x {args.len} tokens ({args.prompt} prompt), "
          f"batch {args.batch}, {torch.get_num_threads()} threads")
    print(f"{'mode':>7} {'budget':>7} {'seconds':>8} {'tok/s':>9} {'x dense':>8} {'peak GiB':>9}")
    for r in rows:
        print(f"{r['mode']:>7} {r['budget']:>7} {r['seconds']:>8.2f} {r['tokens_per_s']:>9.0f} "
              f"{r['ratio_to_dense']:>8.2f} {r['peak_rss_gib']:>9.2f}")
    out = Path(__file__).parent / "results" / "profile_scoring.parquet"
    out.parent.mkdir(exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out)


if __name__ == "__main__":
    main()
