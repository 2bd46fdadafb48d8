"""bf16 on a CPU whose oneDNN has no bf16 products (AVX2 only): a prefill and teacher-forced scoring with the
linears' products in fp32 (stages/model/bf16_products.py) against torch's generic bf16 products, and fp32
as the baseline, in one process.

One prompt of --context random tokens: the engine's prefill (a request of --samples samples, one new token)
and `score_sequences` of the prompt with --new-tokens more, each timed --repeats times, interleaved; prints
the medians and the ratios. On a CPU whose oneDNN runs bf16 (AVX512, AMX) there is nothing to compare: it
says so and stops. Writes nothing.

    .venv/bin/python bench/bf16_prefill.py --context 2048 --repeats 3
"""

from __future__ import annotations

import time

import numpy as np
import torch
from common import bench_parser

from sparrow.stages.engine import Engine, EngineConfig, SamplingParams
from sparrow.stages.model import bf16_products
from sparrow.stages.model.loading import load_model
from sparrow.stages.scoring.mismatch import score_sequences


def parse():
    ap = bench_parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=32, help="completion tokens scored after the prompt")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    return ap.parse_args()


def time_prefill(model, prompt: list[int], samples: int) -> float:
    engine = Engine(model, None, EngineConfig(max_batch=samples))
    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_new_tokens=1, n=samples, seed=0, ignore_eos=True))
    return time.perf_counter() - start


def time_scoring(model, prompt: list[int], completion: list[int]) -> float:
    start = time.perf_counter()
    score_sequences(model, [prompt], [completion], [])
    return time.perf_counter() - start


def main():
    args = parse()
    torch.set_num_threads(args.threads)
    if bf16_products.onednn_runs_bf16():
        print("this CPU's oneDNN runs bf16 products: the engine packs bf16 weights for them; nothing to "
              "compare")
        return
    fp32 = load_model(args.model).model
    bf16 = load_model(args.model, dtype=torch.bfloat16).model
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, fp32.cfg.vocab_size, (args.context,), generator=g).tolist()
    completion = torch.randint(0, fp32.cfg.vocab_size, (args.new_tokens,), generator=g).tolist()
    generic = "bf16, generic bf16 products"
    ways = {"fp32": (fp32, 16), "bf16, fp32 products": (bf16, 16), generic: (bf16, 1 << 62)}
    times: dict[str, dict[str, list[float]]] = {w: {"prefill": [], "scoring": []} for w in ways}
    for _ in range(args.repeats):
        for way, (model, min_rows) in ways.items():
            bf16_products.MIN_ROWS = min_rows  # above any row count: the generic products throughout
            times[way]["prefill"].append(time_prefill(model, prompt, args.samples))
            times[way]["scoring"].append(time_scoring(model, prompt, completion))
    print(f"{args.model}, {args.context}-token prompt, {args.threads} threads, median of {args.repeats} "
          "(interleaved):")
    base = {part: np.median(times[generic][part]) for part in ("prefill", "scoring")}
    for way in ways:
        medians = {part: np.median(times[way][part]) for part in ("prefill", "scoring")}
        cells = [f"{part} {m:.2f} s ({base[part] / m:.2f}x the generic)" for part, m in medians.items()]
        print(f"  {way:<28} " + ", ".join(cells))


if __name__ == "__main__":
    main()
