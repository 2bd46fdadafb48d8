"""Teacher-forced sparse scoring on the GPU: the Triton paths and the torch reference in one process.

One random trajectory (a --prompt-tokens prompt, generated tokens up to --length) scored by
`score_sequences` at every one of --budgets together, what `sparrow profile` runs per trajectory (dense
prefill, the dense completion pass, one sparse pass per budget, alpha and logprobs), on --model with
random weights, once per path of --paths: `torch` (`block_topk_sdpa`, masked SDPA over query chunks),
`decode` (every position a decode query of the sparse paged decode kernel, which re-reads its kept pages
per position: the baseline of the tile kernel) and `paged` (`block_topk_paged`, the selection kernels
and the block-sparse prefill kernel, what `sparrow profile` runs on a GPU). Each path first scores a
short trajectory (--warmup tokens: Triton compiles, cuBLAS plans). Prints one JSON line per path
(seconds, peak device GiB) and, for each later path, one per budget with the largest and mean
differences of the sparse logprobs and alpha from the first path's, and both mean alphas.
`paged:ROWSxKEYSxWARPS` is the paged path with the prefill kernel's tile (query rows, keys per
iteration, warps) set. `--profile`: the device time by kernel of the last path's run (torch's profiler),
printed after it. `--text FILE` scores the tokens of a text (repeated up to --length) with the model's
own weights (a preset that has them, e.g. smollm2-135m), where a trained model's selections cluster and
the prefill kernel skips key blocks; without it, random tokens and random weights.

    python bench/paged_scoring.py --model qwen3-4b --device cuda --length 32768 --paths decode,paged
    python bench/paged_scoring.py --model smollm2-135m --device cuda --length 8192 --text docs/engine.md \
        --budgets 256,512,1024 --paths decode,paged,paged:128x32x8,paged:64x32x4
    TRITON_INTERPRET=1 python bench/paged_scoring.py --model tiny-qwen3 --device cpu --length 200 \\
        --prompt-tokens 150 --warmup 0 --budgets 48,64 --dense-layers 0 --dtype float32  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from common import device_name
from torch import Tensor

from sparrow.kernels import sparse_prefill
from sparrow.kernels.ops import TRITON
from sparrow.stages.attention import sparse, sparse_paged
from sparrow.stages.core.definitions import PAGE_SIZE
from sparrow.stages.model.loading import load_model
from sparrow.stages.scoring.mismatch import ScoredTokens, score_sequences

PATHS = ("torch", "decode", "paged")


def measure(device: torch.device,
            run: Callable[[], ScoredTokens]) -> tuple[ScoredTokens, float, float | None]:
    """run()'s result, seconds and peak device GiB."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    out = run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return out, time.perf_counter() - t0, peak


def as_pages(x: Tensor, page: int = PAGE_SIZE) -> tuple[Tensor, int]:
    """x [B, H, S, D] -> (pages [N, H, page, D], pages_per_sequence): page j of sequence b is page
    b * pages_per_sequence + j; a view of a zero-padded contiguous copy."""
    b, h, s, d = x.shape
    n = -(-s // page)
    x = F.pad(x, (0, 0, 0, n * page - s)).contiguous()
    return x.as_strided(((b - 1) * h * n + n, h, page, d), (page * d, n * page * d, d, 1)), h * n


def per_position_decode(q: Tensor, keys: Tensor, values: Tensor, centroids: Tensor, positions: Tensor,
                        budgets: Tensor, widest: int | None, page: int = PAGE_SIZE,
                        score_elements: int = sparse_paged.SCORE_ELEMENTS) -> Tensor:
    """`block_topk_paged` with every position a decode query of `sparse_paged_attention` (the decode
    kernel, one program per query and KV head over its own kept pages)."""
    b, hq, t, d = q.shape
    k_pages, per_sequence = as_pages(keys, page)
    v_pages, _ = as_pages(values, page)
    cents, _ = sparse_paged.centroid_pages(centroids)
    n_pages = centroids.shape[2]
    width = sparse_paged.kept_width(n_pages, widest)
    chunk = max(1, min(t, score_elements // (keys.shape[1] * n_pages)))
    seq_lens, budgets = (positions + 1).to(torch.int32), budgets.to(torch.int32)
    pages = torch.arange(n_pages, dtype=torch.int32, device=q.device)
    out = torch.empty_like(q)
    for i in range(b):
        table = (pages + i * per_sequence).expand(chunk, n_pages).contiguous()
        for lo in range(0, t, chunk):
            hi = min(t, lo + chunk)
            rows = q[i, :, lo:hi].transpose(0, 1)  # [C, Hq, D]
            lens, block_table = seq_lens[i, lo:hi], table[: hi - lo]
            selected = TRITON.select_pages(rows, cents, block_table, lens, budgets[i, lo:hi], page, width)
            attended = TRITON.sparse_paged_attention(rows, k_pages, v_pages, block_table, lens, selected)
            out[i, :, lo:hi] = attended.transpose(0, 1)
    return out


PAGED = sparse.block_topk_paged
TILE = (sparse_prefill.BLOCK_ROWS, sparse_prefill.BLOCK_TOKENS, sparse_prefill.WARPS)


def parse_path(path: str) -> tuple[str, tuple[int, int, int]]:
    """"paged:ROWSxKEYSxWARPS" -> ("paged", (rows, keys, warps)); a bare name gets the module's tile."""
    name, _, tile = path.partition(":")
    parts = tile.split("x")
    well_formed = name == "paged" and len(parts) == 3 and all(map(str.isdigit, parts))
    if name not in PATHS or (tile and not well_formed):
        raise ValueError(f"--paths: {path!r} is none of {', '.join(PATHS)} or paged:ROWSxKEYSxWARPS")
    return name, tuple(int(x) for x in parts) if tile else TILE


def on_path(path: str) -> None:
    """Make the SparseAttention objects built from now on take `path` (the choice is made per object);
    `paged:ROWSxKEYSxWARPS` sets the prefill kernel's tile."""
    name, tile = parse_path(path)
    sparse.paged_scoring_usable = lambda device: name != "torch"
    sparse.block_topk_paged = per_position_decode if name == "decode" else PAGED
    sparse_prefill.BLOCK_ROWS, sparse_prefill.BLOCK_TOKENS, sparse_prefill.WARPS = tile


def device_time_by_kernel(device: torch.device, run: Callable[[], ScoredTokens], rows: int = 20) -> str:
    """run() under torch's profiler -> its kernels by total device time, a table."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize(device)
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def random_sequence(vocab: int, prompt: int, length: int, seed: int = 0) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (length,), generator=g).tolist()
    return ids[:prompt], ids[prompt:]


def text_sequence(tokens: list[int], prompt: int, length: int,
                  offset: int = 0) -> tuple[list[int], list[int]]:
    """A text's tokens from `offset`, repeated up to `length`, as (prompt, completion)."""
    ids = (tokens * (length // max(1, len(tokens)) + 2))[offset:offset + length]
    return ids[:prompt], ids[prompt:]


def differences(budgets: Sequence[int], first: str, path: str,
                results: dict[str, ScoredTokens]) -> list[dict]:
    a, b = results[first], results[path]
    rows = []
    for budget in budgets:
        (alpha_a, logp_a), (alpha_b, logp_b) = a.sparse[budget], b.sparse[budget]
        rows.append({"budget": budget, "paths": f"{path} vs {first}",
                     "max_abs_logp_diff": float(np.abs(logp_a - logp_b).max()),
                     "mean_abs_logp_diff": float(np.abs(logp_a - logp_b).mean()),
                     "max_abs_alpha_diff": float(np.abs(alpha_a - alpha_b).max()),
                     f"mean_alpha_{first}": float(alpha_a.mean()),
                     f"mean_alpha_{path}": float(alpha_b.mean())})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--length", type=int, default=32768, help="tokens of the trajectory, prompt included")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--budgets", default="1024,2048,3072,4096")
    ap.add_argument("--paths", default="torch,paged",
                    help="which of torch,decode,paged (or paged:ROWSxKEYSxWARPS) to time, in this order")
    ap.add_argument("--text", default=None, help="score this text's tokens with the model's own weights")
    ap.add_argument("--dense-layers", default="0,1", help="layers that attend densely in every mode")
    ap.add_argument("--warmup", type=int, default=2048, help="tokens of the warm-up trajectory (0: none)")
    ap.add_argument("--profile", action="store_true", help="the last path's device time by kernel (CUDA)")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    dense_layers = [int(x) for x in args.dense_layers.split(",") if x]
    paths = args.paths.split(",")
    try:
        [parse_path(p) for p in paths]
    except ValueError as e:
        ap.error(str(e))
    if args.profile and not args.device.startswith("cuda"):
        ap.error("--profile times CUDA kernels: give --device cuda")
    if args.text and not os.path.isfile(args.text):
        ap.error(f"--text {args.text}: no such file")
    device = torch.device(args.device)
    loaded = load_model(args.model, device=device, dtype=getattr(torch, args.dtype),
                        random_weights=args.text is None)
    model = loaded.model.eval()
    vocab = loaded.config.vocab_size
    if args.text:
        tokens = loaded.tokenizer.encode(open(args.text).read())
        prompt, completion = text_sequence(tokens, args.prompt_tokens, args.length)
        warm = text_sequence(tokens, min(args.prompt_tokens, args.warmup // 2), args.warmup, offset=101)
    else:
        prompt, completion = random_sequence(vocab, args.prompt_tokens, args.length)
        warm = random_sequence(vocab, min(args.prompt_tokens, args.warmup // 2), args.warmup, seed=1)
    results = {}
    for path in paths:
        on_path(path)
        if args.warmup:
            score_sequences(model, [warm[0]], [warm[1]], budgets, dense_layers=dense_layers)
        results[path], seconds, peak = measure(device, lambda: score_sequences(
            model, [prompt], [completion], budgets, dense_layers=dense_layers))
        print(json.dumps({"path": path, "seconds": round(seconds, 3), "peak_gib": peak, "model": args.model,
                          "device": device_name(device),
                          "length": args.length, "prompt_tokens": args.prompt_tokens, "budgets": budgets,
                          "text": args.text}),
              flush=True)
    for path in paths[1:]:
        for row in differences(budgets, paths[0], path, results):
            print(json.dumps(row), flush=True)
    if args.profile:
        print(device_time_by_kernel(device, lambda: score_sequences(
            model, [prompt], [completion], budgets, dense_layers=dense_layers)), flush=True)


if __name__ == "__main__":
    main()
