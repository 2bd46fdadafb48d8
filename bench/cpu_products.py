"""A CPU decode step's products alone: our C++ products against the ones the engine uses without them.

For each --rows (a decode step's batch: 8 samples; a speculative verification's 8 x (K + 1)), every layer's
products of the model in turn as the decode step calls them (q/k/v stacked, o, gate/up stacked, down,
then the lm_head), all layers' weights streamed from memory as in a step: ours (`PackedLinears`, our
kernel's packed layout, kernels/cpu_layers.cpp) against the engine's path without our kernels (oneDNN's
packed fp32 product, or torch's generic bf16 one where oneDNN has no bf16 products, as on AVX2). Reported
per row count: the milliseconds a step's products take (median of --reps passes), ours over torch's, and
GB/s of weights read against the copy bandwidth (a product of few rows is bound by reading its weights).
Writes cpu_products.parquet into --results (default bench/results).

    .venv/bin/python bench/cpu_products.py --threads 2                     # SmolLM2, fp32 and bf16
"""

from __future__ import annotations

import numpy as np
import torch
from common import bench_parser, copy_bandwidth, device_name, timed, write_results

from sparrow.stages.engine.cpu.packed_linears import DOT_MAX_ROWS, PackedLinears
from sparrow.stages.model.loading import load_model


def parse():
    ap = bench_parser(__doc__, "cpu_products")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", default="1,8,24", help="rows per product, comma-separated")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reps", type=int, default=7, help="passes over every layer, per row count")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    args.rows = [int(r) for r in args.rows.split(",")]
    if min(args.rows) < 1 or args.reps < 1:
        ap.error("--rows and --reps must be at least 1")
    return args


def step_products(model: torch.nn.Module, x: torch.Tensor) -> None:
    """Every product of a decode step on rows `x` [rows, 1, hidden], in the step's order."""
    for block in model.layers:
        block.attn.qkv(x)
        block.attn.o_proj(x)
        _, up = block.mlp.gate_up(x)
        block.mlp.down_proj(up)
    model.lm_head(x)


def weight_bytes(model: torch.nn.Module) -> int:
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = {id(m.weight): m.weight for m in linears}.values()  # a tied lm_head counted once
    return sum(w.numel() * w.element_size() for w in weights)


def timed_ms(model, packed: PackedLinears, x: torch.Tensor, reps: int) -> float:
    with torch.inference_mode(), packed.active():
        return 1e3 * float(np.median(timed(lambda: step_products(model, x), torch.device("cpu"), reps)))


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    bandwidth = copy_bandwidth(torch.device("cpu"), 0.5)
    machine = device_name(torch.device("cpu"))
    print(f"{machine}, {args.threads} threads, copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        model = load_model(args.model, dtype=dtype).model
        hint = min(max(args.rows), DOT_MAX_ROWS)  # the engine's batch; a verification's rows take the same
        ours, theirs = (PackedLinears(model, batch_hint=hint, own_kernel=k) for k in (True, False))
        if not ours.dot:
            print(f"{dtype_name}: our C++ products do not run here (SPARROW_CPU_KERNELS=0, or no compiler)")
            continue
        size = weight_bytes(model)
        for n in args.rows:
            x = torch.randn(n, 1, model.cfg.hidden_size).to(dtype)
            ms = {name: timed_ms(model, p, x, args.reps) for name, p in (("ours", ours), ("torch", theirs))}
            row = {"machine": machine, "model": args.model, "dtype": dtype_name, "rows": n,
                   "threads": args.threads, "weights_mb": size / 1e6, "ours_ms": ms["ours"],
                   "torch_ms": ms["torch"], "speedup": ms["torch"] / ms["ours"],
                   "ours_gb_s": size / ms["ours"] / 1e6, "copy_gb_s": bandwidth / 1e9}
            rows.append(row)
            print(f"{dtype_name:9s} {n:3d} rows: ours {ms['ours']:7.1f} ms, torch {ms['torch']:7.1f} ms "
                  f"({row['speedup']:.2f}x), ours read {row['ours_gb_s']:.1f} GB/s of weights")
    write_results(rows, "cpu_products", args.results)


if __name__ == "__main__":
    main()
