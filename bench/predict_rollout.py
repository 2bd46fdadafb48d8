"""The whole-rollout speedups a fitted cost model predicts for runs of bench/rollout.py, beside the measured
ones (the same table `bench/rollout.py --cost` prints after its runs), from their results file: for a run
measured in another device call than the one that fitted the model.

    python bench/predict_rollout.py --cost cost.parquet --results bench/results/rollout.parquet
"""

from __future__ import annotations

import pyarrow.parquet as pq
from common import bench_parser
from rollout import predict

from sparrow.stages.cost import load_cost
from sparrow.stages.model.loading import resolve_config


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--cost", required=True, help="a `sparrow fit-cost` artifact for the runs' model")
    ap.add_argument("--results", required=True,
                    help="bench/rollout.py's results table (a whole-rollout run); read, not written")
    args = ap.parse_args()
    rows = pq.read_table(args.results).to_pylist()
    if not rows or "sampler" not in rows[0] or "kv_tokens" in rows[0]:
        raise SystemExit(f"--results {args.results}: expected the rows of a whole-rollout run of "
                         "bench/rollout.py")
    cost = load_cost(args.cost, resolve_config(rows[0]["model"]))
    predict(rows, cost, args.cost)


if __name__ == "__main__":
    main()
