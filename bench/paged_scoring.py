"""Teacher-forced sparse scoring on the GPU: the paged Triton path and the torch reference in one process.

One random trajectory (a --prompt-tokens prompt, generated tokens up to --length) scored by
`score_sequences` at every one of --budgets together, what `sparrow profile` runs per trajectory (dense
prefill, the dense completion pass, one sparse pass per budget, alpha and logprobs), on --model with
random weights, once per path of --paths: `torch` (`block_topk_sdpa`, masked SDPA over query chunks) and
`paged` (`block_topk_paged`, the paged decode kernels). Each path first scores a short trajectory
(--warmup tokens: Triton compiles, cuBLAS plans). Prints one JSON line per path (seconds, peak device
GiB) and, with both paths, one per budget with the largest and mean differences of the sparse logprobs
and alpha between them and each path's mean alpha.

    python bench/paged_scoring.py --model qwen3-4b --device cuda --length 32768
    TRITON_INTERPRET=1 python bench/paged_scoring.py --model tiny-qwen3 --device cpu --length 200 \\
        --prompt-tokens 150 --warmup 0 --budgets 48,64 --dense-layers 0 --dtype float32  # smoke
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from sparrow.stages.attention import sparse
from sparrow.stages.model.loading import load_model
from sparrow.stages.scoring.mismatch import ScoredTokens, score_sequences

PATHS = ("torch", "paged")


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


def on_path(path: str) -> None:
    """Make the SparseAttention objects built from now on take `path` (the choice is made per object)."""
    sparse.paged_scoring_usable = lambda device: path == "paged"


def random_sequence(vocab: int, prompt: int, length: int, seed: int = 0) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (length,), generator=g).tolist()
    return ids[:prompt], ids[prompt:]


def differences(budgets: Sequence[int], results: dict[str, ScoredTokens]) -> list[dict]:
    a, b = results["torch"], results["paged"]
    rows = []
    for budget in budgets:
        (alpha_a, logp_a), (alpha_b, logp_b) = a.sparse[budget], b.sparse[budget]
        rows.append({"budget": budget, "max_abs_logp_diff": float(np.abs(logp_a - logp_b).max()),
                     "mean_abs_logp_diff": float(np.abs(logp_a - logp_b).mean()),
                     "max_abs_alpha_diff": float(np.abs(alpha_a - alpha_b).max()),
                     "mean_alpha_torch": float(alpha_a.mean()), "mean_alpha_paged": float(alpha_b.mean())})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--length", type=int, default=32768, help="tokens of the trajectory, prompt included")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--budgets", default="1024,2048,3072,4096")
    ap.add_argument("--paths", default=",".join(PATHS), help="which of torch,paged to time, in this order")
    ap.add_argument("--dense-layers", default="0,1", help="layers that attend densely in every mode")
    ap.add_argument("--warmup", type=int, default=2048, help="tokens of the warm-up trajectory (0: none)")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    dense_layers = [int(x) for x in args.dense_layers.split(",") if x]
    paths = args.paths.split(",")
    assert set(paths) <= set(PATHS), f"--paths takes {', '.join(PATHS)}"
    device = torch.device(args.device)
    loaded = load_model(args.model, device=device, dtype=getattr(torch, args.dtype), random_weights=True)
    model = loaded.model.eval()
    vocab = loaded.config.vocab_size
    prompt, completion = random_sequence(vocab, args.prompt_tokens, args.length)
    results = {}
    for path in paths:
        on_path(path)
        if args.warmup:
            short = random_sequence(vocab, min(args.prompt_tokens, args.warmup // 2), args.warmup, seed=1)
            score_sequences(model, [short[0]], [short[1]], budgets, dense_layers=dense_layers)
        results[path], seconds, peak = measure(device, lambda: score_sequences(
            model, [prompt], [completion], budgets, dense_layers=dense_layers))
        print(json.dumps({"path": path, "seconds": round(seconds, 3), "peak_gib": peak, "model": args.model,
                          "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                          "length": args.length, "prompt_tokens": args.prompt_tokens, "budgets": budgets}),
              flush=True)
    if len(results) == 2:
        for row in differences(budgets, results):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
