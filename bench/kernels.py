"""Decode attention kernels, one layer: dense paged attention vs block top-k (selection + sparse attention).

Issue targets (reported, not asserted), on a GPU: Qwen3-4B attention shapes (32 query heads, 8 KV
heads, head dim 128), bf16, batch 32, contexts 16K and 32K, pages of 16 tokens scattered over the pool
the way a real block manager leaves them: the sparse kernel at a 2,048-token budget at least 6x the
dense kernel at 32K. Also reported: the selection's own cost (Triton page scoring + torch.topk), and
the fraction of the memory-bandwidth limit each kernel reaches (K/V bytes it must read, plus the
centroids for selection, over the device's measured copy bandwidth).
Times are CUDA-event medians over repeated replays of a CUDA graph of each op, as the engine's decode
step replays them (each call reads far more than the L2 cache holds); `--eager` times plain calls, which
adds the host's launch gaps between small kernels. "select-torch" is the selection before its fused
kernel (Triton scores, then topk, masks and a sort in torch), kept for comparison.
On a CPU the torch references run instead, at a smaller default size (the CPU engine's path).
Writes bench/results/kernels.parquet.

    .venv/bin/python bench/kernels.py                                  # GPU: the issue's shapes
    .venv/bin/python bench/kernels.py --device cpu --batch 4 --contexts 4096,8192
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import copy_bandwidth, timed, timed_graph, write_results

from sparrow.kernels import ops
from sparrow.kernels.page_scoring import finish_selection
from sparrow.stages.model.presets import get_preset


def paged_layer(batch: int, context: int, hkv: int, d: int, page: int, dtype, device, seed: int = 0):
    """One layer's cache: `batch` requests of `context` tokens on distinct pages in shuffled order."""
    g = torch.Generator(device=device).manual_seed(seed)
    pages_per_seq = -(-context // page)
    total = batch * pages_per_seq
    shape = (total, hkv, page, d)
    k_pages = torch.randn(shape, generator=g, device=device, dtype=dtype)
    v_pages = torch.randn(shape, generator=g, device=device, dtype=dtype)
    centroids = k_pages.float().mean(2)  # every page is full
    order = torch.randperm(total, generator=g, device=device).to(torch.int32)
    block_table = order.view(batch, pages_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return k_pages, v_pages, centroids, block_table, seq_lens


def bench_context(args, device, dtype, context: int, bw: float) -> list[dict]:
    cfg = get_preset(args.model).config
    hq, hkv, d, page = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16
    k_pages, v_pages, cents, table, lens = paged_layer(args.batch, context, hkv, d, page, dtype, device)
    q = torch.randn(args.batch, hq, d, device=device, dtype=dtype)
    budgets = torch.full((args.batch,), args.budget, dtype=torch.int32, device=device)
    scale = d**-0.5
    k_sel = args.budget // page
    selected = ops.select_pages(q, cents, table, lens, budgets, page, max_selected=k_sel)
    runs = {
        "dense": lambda: ops.dense_paged_attention(q, k_pages, v_pages, table, lens, scale),
        "select": lambda: ops.select_pages(q, cents, table, lens, budgets, page, max_selected=k_sel),
        "select-torch": lambda: finish_selection(ops.page_scores(q, cents, table, lens, page), lens,
                                                 budgets, page, max_selected=k_sel),
        "sparse-attn": lambda: ops.sparse_paged_attention(q, k_pages, v_pages, table, lens, selected,
                                                          scale),
        "sparse": lambda: ops.sparse_paged_attention(
            q, k_pages, v_pages, table, lens,
            ops.select_pages(q, cents, table, lens, budgets, page, max_selected=k_sel), scale),
    }
    elem = k_pages.element_size()
    kv_token = 2 * hkv * d * elem
    n_pages = table.shape[1]
    read = {"dense": args.batch * context * kv_token,
            "select": args.batch * n_pages * hkv * d * 4,
            "select-torch": args.batch * n_pages * hkv * d * 4,
            "sparse-attn": args.batch * min(args.budget, context) * kv_token}
    read["sparse"] = read["select"] + read["sparse-attn"]
    rows = []
    timer = timed if args.eager else timed_graph
    for name, fn in runs.items():
        seconds = statistics.median(timer(fn, device, args.reps))
        rows.append({"kernel": name, "context": context, "batch": args.batch, "budget": args.budget,
                     "hq": hq, "hkv": hkv, "head_dim": d, "dtype": str(dtype).removeprefix("torch."),
                     "device": str(device), "ms": 1e3 * seconds, "bytes": read[name],
                     "bw_fraction": read[name] / seconds / bw})
    dense_ms = rows[0]["ms"]
    for r in rows:
        r["x_dense"] = dense_ms / r["ms"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    gpu = torch.cuda.is_available()
    ap.add_argument("--device", default="cuda" if gpu else "cpu")
    ap.add_argument("--model", default="qwen3-4b", help="a preset whose attention shapes to use")
    ap.add_argument("--batch", type=int, default=None, help="default: 32 on a GPU, 4 on a CPU")
    ap.add_argument("--contexts", default=None, help="default: 16384,32768 on a GPU, 4096,8192 on a CPU")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=None, help="timed calls per kernel (default 20 / 3)")
    ap.add_argument("--eager", action="store_true", help="time plain calls instead of CUDA graph replays")
    args = ap.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    args.batch = args.batch or (32 if on_gpu else 4)
    args.reps = args.reps or (20 if on_gpu else 3)
    contexts = [int(c) for c in (args.contexts or ("16384,32768" if on_gpu else "4096,8192")).split(",")]
    dtype = torch.bfloat16 if on_gpu else torch.float32
    bw = copy_bandwidth(device)
    name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    impl = "Triton" if ops.use_triton("auto", torch.empty(0, device=device)) else "torch reference"
    timing = "eager calls" if args.eager or not on_gpu else "CUDA graph replays"
    print(f"{args.model} attention shapes, batch {args.batch}, budget {args.budget}, {dtype}, {name}, "
          f"{timing}, copy bandwidth {bw / 1e9:.0f} GB/s, {impl}")
    print(f"{'context':>8} {'kernel':>12} {'ms':>9} {'x dense':>8} {'GB read':>8} {'BW frac':>8}")
    rows = []
    for context in contexts:
        for r in bench_context(args, device, dtype, context, bw):
            rows.append(r)
            print(f"{context:>8} {r['kernel']:>12} {r['ms']:>9.3f} {r['x_dense']:>8.2f} "
                  f"{r['bytes'] / 1e9:>8.2f} {r['bw_fraction']:>8.2f}")
    write_results(rows, "kernels")


if __name__ == "__main__":
    main()
