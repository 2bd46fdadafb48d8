"""Decode kernels, one layer: dense paged attention vs block top-k (selection + sparse attention), and the
fused elementwise chain of the GPU decode step (add_rms_norm, qk_norm_rope_append, silu_mul) against the
eager torch chains they replace.

Issue targets (reported, not asserted), on a GPU: Qwen3-4B attention shapes (32 query heads, 8 KV
heads, head dim 128), bf16, batch 32, contexts 16K and 32K, pages of 16 tokens scattered over the pool
the way a real block manager leaves them: the sparse kernel at a 2,048-token budget at least 6x the
dense kernel at 32K. Also reported: the selection's own cost, whole and as its two kernels (page scores
over the centroids, bf16 with bf16 pages as in the engine's pool, then the radix select), and the
fraction of the memory-bandwidth limit each kernel reaches (K/V bytes it must read, plus the centroids
for selection, over the device's measured copy bandwidth).
Times are CUDA-event medians over repeated replays of a CUDA graph of each op, as the engine's decode
step replays them (each call reads far more than the L2 cache holds); `--eager` times plain calls, which
adds the host's launch gaps between small kernels. "select-torch" is the selection before its fused
kernel (Triton scores, then topk, masks and a sort in torch), kept for comparison. The elementwise
kernels are tiny (well under a microsecond of bytes each at batch 32), so each is timed as 20 calls
captured in one graph, per call: what a decode step's graph pays for it, launch latency included; the
table gives their bytes, the time those bytes take at the measured bandwidth and at 3.0 TB/s, and how
many calls a Qwen3-4B-shaped step makes (2 norms per layer and the final one, one of each other per layer).
On a CPU the torch references run instead, at a smaller default size (the CPU engine's path).
Writes kernels.parquet into --results (default bench/results).

    .venv/bin/python bench/kernel_times.py                                  # GPU: the issue's shapes
    .venv/bin/python bench/kernel_times.py --part elementwise               # the fused chain only
    .venv/bin/python bench/kernel_times.py --device cpu --batch 4 --contexts 4096,8192
"""

from __future__ import annotations

import re
import statistics

import torch
from common import bench_parser, copy_bandwidth, device_name, timed, timed_graph, write_results
from select_candidates import select_count_triton

from sparrow.kernels import ops, page_scoring
from sparrow.kernels.page_scoring import finish_selection, select_from_scores_triton
from sparrow.stages.model.presets import get_preset


def paged_layer(batch: int, context: int, hkv: int, d: int, page: int, dtype, device, seed: int = 0):
    """One layer's cache: `batch` requests of `context` tokens on distinct pages in shuffled order."""
    g = torch.Generator(device=device).manual_seed(seed)
    pages_per_seq = -(-context // page)
    total = batch * pages_per_seq
    shape = (total, hkv, page, d)
    k_pages = torch.randn(shape, generator=g, device=device, dtype=dtype)
    v_pages = torch.randn(shape, generator=g, device=device, dtype=dtype)
    # every page is full; bf16 pages keep bf16 centroids, as the GPU runner's pool does
    centroids = k_pages.float().mean(2).to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    order = torch.randperm(total, generator=g, device=device).to(torch.int32)
    block_table = order.view(batch, pages_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return k_pages, v_pages, centroids, block_table, seq_lens


def select_only(scores, lens, budgets, page: int, k_sel: int):
    """The selection from given page scores alone: the Triton kernel on CUDA, the torch reference off it."""
    if scores.is_cuda:
        return select_from_scores_triton(scores, lens, budgets, page, max_selected=k_sel)
    return finish_selection(scores, lens, budgets, page, max_selected=k_sel)


def bench_context(args, device, dtype, context: int, bw: float) -> list[dict]:
    cfg = get_preset(args.model).config
    hq, hkv, d, page = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16
    k_pages, v_pages, cents, table, lens = paged_layer(args.batch, context, hkv, d, page, dtype, device)
    q = torch.randn(args.batch, hq, d, device=device, dtype=dtype)
    budgets = torch.full((args.batch,), args.budget, dtype=torch.int32, device=device)
    scale = d**-0.5
    k_sel = args.budget // page
    kernels = ops.ops_for(device)
    selected = kernels.select_pages(q, cents, table, lens, budgets, page, max_selected=k_sel)
    scores = kernels.page_scores(q, cents, table, lens, page)
    runs = {
        "dense": lambda: kernels.dense_paged_attention(q, k_pages, v_pages, table, lens, scale),
        "select": lambda: kernels.select_pages(q, cents, table, lens, budgets, page, max_selected=k_sel),
        "select-torch": lambda: finish_selection(kernels.page_scores(q, cents, table, lens, page), lens,
                                                 budgets, page, max_selected=k_sel),
        "page-scores": lambda: kernels.page_scores(q, cents, table, lens, page),
        "select-only": lambda: select_only(scores, lens, budgets, page, k_sel),
        "sparse-attn": lambda: kernels.sparse_paged_attention(q, k_pages, v_pages, table, lens, selected,
                                                          scale),
        "sparse": lambda: kernels.sparse_paged_attention(
            q, k_pages, v_pages, table, lens,
            kernels.select_pages(q, cents, table, lens, budgets, page, max_selected=k_sel), scale),
    }
    elem = k_pages.element_size()
    kv_token = 2 * hkv * d * elem
    n_pages = table.shape[1]
    read = {"dense": args.batch * context * kv_token,
            "select": args.batch * n_pages * hkv * d * cents.element_size(),
            "select-torch": args.batch * n_pages * hkv * d * cents.element_size(),
            "page-scores": args.batch * n_pages * hkv * d * cents.element_size(),
            "select-only": args.batch * n_pages * hkv * 4,
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


def select_config(config: str, scores, lens, budgets, page: int, k_sel: int):
    """The selection of one --select-configs entry: "BLOCKxWARPS" the radix select with BLOCK pages a chunk,
    "countBITSxWARPS" the counting candidate (bench/select_candidates.py) with BITS-bit digits."""
    if config.startswith("count"):
        bits, warps = (int(x) for x in config.removeprefix("count").split("x"))
        return select_count_triton(scores, lens, budgets, page, k_sel, digit_bits=bits, num_warps=warps)
    return select_only(scores, lens, budgets, page, k_sel)


def bench_select_sweep(args, device, context: int) -> list[dict]:
    """The selection alone (select-only) under each configuration of --select-configs (the radix select's
    pages per chunk x warps, and the counting candidate's digit bits x warps), at --batch samples of
    `context` tokens; each configuration's pages checked against the default radix select's."""
    cfg = get_preset(args.model).config
    hkv, d, page = cfg.num_kv_heads, cfg.head_dim, 16
    _, _, cents, table, lens = paged_layer(args.batch, context, hkv, d, page, torch.bfloat16, device)
    q = torch.randn(args.batch, cfg.num_heads, d, device=device, dtype=torch.bfloat16)
    budgets = torch.full((args.batch,), args.budget, dtype=torch.int32, device=device)
    k_sel = args.budget // page
    scores = ops.ops_for(device).page_scores(q, cents, table, lens, page)
    default = (page_scoring.SELECT_BLOCK, page_scoring.SELECT_WARPS)
    want = select_only(scores, lens, budgets, page, k_sel).sort(-1).values
    rows = []
    try:
        for config in args.select_configs.split(","):
            if not config.startswith("count"):
                page_scoring.SELECT_BLOCK, page_scoring.SELECT_WARPS = (int(x) for x in config.split("x"))
            got = select_config(config, scores, lens, budgets, page, k_sel).sort(-1).values
            seconds = statistics.median(timed_graph_calls(
                lambda c=config: select_config(c, scores, lens, budgets, page, k_sel), device, args.reps))
            rows.append({"kernel": f"select-only {config}", "context": context, "batch": args.batch,
                         "budget": args.budget, "config": config, "ms": 1e3 * seconds,
                         "same_pages": bool(torch.equal(got, want)), "device": str(device)})
    finally:
        page_scoring.SELECT_BLOCK, page_scoring.SELECT_WARPS = default
    return rows


def timed_graph_calls(fn, device, reps: int, calls: int = 20) -> list[float]:
    """Seconds per call of fn when `calls` calls replay from one CUDA graph (the step's situation for a
    kernel of a few hundred KB); plain calls off CUDA."""
    if device.type != "cuda":
        return timed(fn, device, reps)
    return [t / calls for t in timed_graph(lambda: [fn() for _ in range(calls)], device, reps)]


def bench_elementwise(args, device, dtype, bw: float) -> list[dict]:
    """The fused kernels of the decode layer at the preset's shapes and `args.batch` rows, each against
    the eager chain it replaces (the torch reference, which is that chain)."""
    from sparrow.kernels.add_rms_norm import add_rms_norm_reference
    from sparrow.kernels.qk_norm_rope_append import qk_norm_rope_append_reference
    from sparrow.kernels.silu_mul import silu_mul_reference

    cfg = get_preset(args.model).config
    b, h, inter, d = args.batch, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hq, hkv, page = cfg.num_heads, cfg.num_kv_heads, 16
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(b, h, generator=g, device=device, dtype=dtype)
    residual = torch.randn(b, h, generator=g, device=device, dtype=dtype)
    w = torch.ones(h, device=device, dtype=dtype)
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=g, device=device, dtype=dtype)
    positions = torch.arange(b, device=device) + 1000
    slots = torch.arange(b, device=device) * page + 5  # row r appends at offset 5 of page r
    cos = torch.randn(4096, d, generator=g, device=device).to(dtype)  # the model's tables, in its dtype
    sin = torch.randn(4096, d, generator=g, device=device).to(dtype)
    qn = torch.ones(d, device=device, dtype=dtype)
    k_pages = torch.zeros(b, hkv, page, d, device=device, dtype=dtype)
    v_pages = torch.zeros_like(k_pages)
    cent_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    cents = torch.zeros(b, hkv, d, device=device, dtype=cent_dtype)
    gate_up = torch.randn(b, 2 * inter, generator=g, device=device, dtype=dtype)
    e, c = torch.tensor([], dtype=dtype).element_size(), torch.tensor([], dtype=cent_dtype).element_size()
    kernels = ops.ops_for(device) if device.type == "cuda" else ops.TORCH
    runs = {
        "add_rms_norm": (lambda: kernels.add_rms_norm(x, residual, w, 1e-6),
                         lambda: add_rms_norm_reference(x, residual, w, 1e-6),
                         4 * b * h * e + h * e, 2 * cfg.num_layers + 1),
        "qk_norm_rope_append": (
            lambda: kernels.qk_norm_rope_append(qkv, positions, slots, cos, sin, qn, qn, 1e-6, k_pages,
                                                v_pages, cents, hq),
            lambda: qk_norm_rope_append_reference(qkv, positions, slots, cos, sin, qn, qn, 1e-6, k_pages,
                                                  v_pages, cents, hq),
            b * (hq + 2 * hkv) * d * e + b * hq * d * e + 2 * b * hkv * d * e + 2 * b * hkv * d * c
            + 2 * b * d * e + 2 * d * e, cfg.num_layers),
        "silu_mul": (lambda: kernels.silu_mul(gate_up), lambda: silu_mul_reference(gate_up),
                     3 * b * inter * e, cfg.num_layers),
    }
    rows = []
    for name, (fused, eager, nbytes, per_step) in runs.items():
        t_fused = statistics.median(timed_graph_calls(fused, device, args.reps))
        t_eager = statistics.median(timed_graph_calls(eager, device, args.reps))
        rows.append({"kernel": name, "batch": b, "dtype": str(dtype).removeprefix("torch."),
                     "device": str(device), "us": 1e6 * t_fused, "eager_us": 1e6 * t_eager, "bytes": nbytes,
                     "floor_us": 1e6 * nbytes / bw, "floor_us_3tbs": 1e6 * nbytes / 3.0e12,
                     "per_step": per_step, "step_us": 1e6 * t_fused * per_step,
                     "eager_step_us": 1e6 * t_eager * per_step})
    return rows


def main() -> None:
    ap = bench_parser(__doc__, "kernels")
    gpu = torch.cuda.is_available()
    ap.add_argument("--device", default="cuda" if gpu else "cpu")
    ap.add_argument("--model", default="qwen3-4b", help="a preset whose attention shapes to use")
    ap.add_argument("--batch", type=int, default=None, help="default: 32 on a GPU, 4 on a CPU")
    ap.add_argument("--contexts", default=None, help="default: 16384,32768 on a GPU, 4096,8192 on a CPU")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=None, help="timed calls per kernel (default 20 / 3)")
    ap.add_argument("--eager", action="store_true", help="time plain calls instead of CUDA graph replays")
    ap.add_argument("--part", default="attention,elementwise",
                    help="attention (dense vs sparse, selection), elementwise (the fused decode chain), "
                         "select-sweep (the selection under each of --select-configs)")
    ap.add_argument("--select-configs",
                    default="1024x4,2048x4,2048x8,4096x8,2048x16,count2x4,count2x8,count2x16",
                    help="for --part select-sweep: BLOCKxWARPS, the radix select's pages per chunk and "
                         "warps; countBITSxWARPS, the counting candidate's digit bits and warps")
    args = ap.parse_args()
    parts = set(args.part.split(","))
    if not parts <= {"attention", "elementwise", "select-sweep"}:
        ap.error(f"--part takes attention, elementwise and/or select-sweep, got {args.part!r}")
    shape = re.compile(r"(count)?\d+x\d+")
    if "select-sweep" in parts and not all(shape.fullmatch(c) for c in args.select_configs.split(",")):
        ap.error(f"--select-configs takes BLOCKxWARPS or countBITSxWARPS, got {args.select_configs!r}")
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    args.batch = args.batch or (32 if on_gpu else 4)
    args.reps = args.reps or (20 if on_gpu else 3)
    contexts = [int(c) for c in (args.contexts or ("16384,32768" if on_gpu else "4096,8192")).split(",")]
    dtype = torch.bfloat16 if on_gpu else torch.float32
    bw = copy_bandwidth(device)
    name = device_name(device)
    impl = "Triton" if ops.ops_for(device) is ops.TRITON else "torch reference"
    timing = "eager calls" if args.eager or not on_gpu else "CUDA graph replays"
    print(f"{args.model} attention shapes, batch {args.batch}, budget {args.budget}, {dtype}, {name}, "
          f"{timing}, copy bandwidth {bw / 1e9:.0f} GB/s, {impl}")
    rows = []
    if "attention" in parts:
        print(f"{'context':>8} {'kernel':>12} {'ms':>9} {'x dense':>8} {'GB read':>8} {'BW frac':>8}")
        for context in contexts:
            for r in bench_context(args, device, dtype, context, bw):
                rows.append(r)
                print(f"{context:>8} {r['kernel']:>12} {r['ms']:>9.3f} {r['x_dense']:>8.2f} "
                      f"{r['bytes'] / 1e9:>8.2f} {r['bw_fraction']:>8.2f}")
    if "elementwise" in parts:
        print(f"fused decode-step kernels, batch {args.batch} (us per call; eager = the torch chain "
              "replaced):")
        print(f"{'kernel':>20} {'us':>8} {'eager us':>9} {'KB':>8} {'floor us':>9} {'@3TB/s':>7} "
              f"{'calls':>6} {'step us':>8} {'eager step':>11}")
        for r in bench_elementwise(args, device, dtype, bw):
            rows.append(r)
            print(f"{r['kernel']:>20} {r['us']:>8.2f} {r['eager_us']:>9.2f} {r['bytes'] / 1e3:>8.1f} "
                  f"{r['floor_us']:>9.3f} {r['floor_us_3tbs']:>7.3f} {r['per_step']:>6} {r['step_us']:>8.1f} "
                  f"{r['eager_step_us']:>11.1f}")
    if "select-sweep" in parts:
        print(f"the selection alone, batch {args.batch}, budget {args.budget} (radix: pages per chunk x "
              "warps; count: digit bits x warps):")
        for context in contexts:
            for r in bench_select_sweep(args, device, context):
                rows.append(r)
                print(f"{context:>8} {r['kernel']:>22} {r['ms']:>9.4f} ms  same pages: {r['same_pages']}")
    write_results(rows, "kernels", args.results)


if __name__ == "__main__":
    main()
