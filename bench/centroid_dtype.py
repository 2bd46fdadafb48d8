"""Do bf16 page centroids change block top-k selections? (issue 25 item 3: half the bytes selection reads)

A bf16 model's keys are bf16. The engine keeps each page's centroid, the mean of its keys, fed one key
per decode step. Stored in fp32 it is the running mean c <- c + (k - c) / (offset + 1) (exact to fp32
rounding). Stored in bf16 it could be that running mean rounded at every one of the page's 16 appends
("bf16 running", not what the kernels do), or, as the kernels do (kernels/append_kv.py), the running mean
while the page fills and the mean of its 16 keys rounded once when its last key arrives ("bf16"); only
complete pages are ever scored. This measures, on a real model's keys and queries (one forward over a
text, every layer's post-RoPE q and k recorded), how often the kept page set of a query and KV head
differs from the fp32 one, and how often each agrees with the set teacher-forced scoring keeps in bf16
(`page_centroids` in bf16, bf16 scores: stages/attention/sparse.py). Then, end to end, a sparse rollout
of the bf16 model with each centroid dtype (torch references, the same seed) against teacher-forced
scoring: the largest and mean |engine - teacher forced| logprob gap.

    .venv/bin/python bench/centroid_dtype.py --model smollm2-135m --tokens 2048 --budgets 128,256

Writes nothing; prints a table (paste into docs/gpu.md with the machine state).
"""

from __future__ import annotations

import numpy as np
import torch
from common import bench_parser

from sparrow.kernels.ops import Backend
from sparrow.stages.attention.block_topk import kept_page_mask, page_centroids
from sparrow.stages.core.sparsity import as_policy
from sparrow.stages.engine import Engine, EngineConfig, SamplingParams
from sparrow.stages.model.llama import AttentionContext, DenseAttention
from sparrow.stages.model.loading import load_model
from sparrow.stages.scoring.mismatch import score_sequences

P = 16


class Recorder(DenseAttention):
    """Dense attention that keeps every layer's post-RoPE q [Hq, T, D] and k [Hkv, T, D]."""

    def __init__(self):
        self.q, self.k = {}, {}

    def __call__(self, layer: int, q, k, v, ctx: AttentionContext):
        self.q[layer], self.k[layer] = q[0], k[0]
        return super().__call__(layer, q, k, v, ctx)


def running_centroids(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """keys [Hkv, S, D] -> [Hkv, S // P, D] (complete pages): the engine's running mean, stored in dtype."""
    h, s, d = keys.shape
    pages = keys[:, : s // P * P].float().view(h, s // P, P, d)
    c = pages[:, :, 0].to(dtype)
    for off in range(1, P):
        cf = c.float()
        c = (cf + (pages[:, :, off] - cf) / (off + 1)).to(dtype)
    return c.float()


def kept(q: torch.Tensor, cents: torch.Tensor, positions: torch.Tensor, budgets: torch.Tensor,
         dtype: torch.dtype) -> torch.Tensor:
    """Kept pages [Hkv, T, n] of queries q [Hq, T, D] at `positions` over centroids [Hkv, n, D], scored
    in `dtype`."""
    return kept_page_mask(q[None].to(dtype), cents[None].to(dtype), positions[None], budgets, P)[0]


def selection_agreement(model, tokens: list[int], budget: int, stride: int) -> list[dict]:
    rec = Recorder()
    with torch.inference_mode():
        model.hidden_states(torch.tensor([tokens]), attention=rec)
    rows = []
    n_tok = len(tokens)
    for layer in sorted(rec.q):
        q, k = rec.q[layer], rec.k[layer]
        positions = torch.arange(budget + P, n_tok, stride)
        qs = q[:, positions]
        fp32 = running_centroids(k, torch.float32)
        running = running_centroids(k, torch.bfloat16)
        stored = k[:, : n_tok // P * P].float().unflatten(1, (-1, P)).mean(2).to(torch.bfloat16).float()
        tf = page_centroids(k[None], P)[0][:, : n_tok // P]  # teacher forced: in the keys' dtype (bf16)
        budgets = torch.full((1, len(positions)), budget)

        f32 = torch.float32
        a, b, o, c = (kept(qs, cents, positions, budgets, dtype) for cents, dtype in
                      ((fp32, f32), (running, f32), (stored, f32), (tf, tf.dtype)))
        same = lambda x, y: (x == y).all(-1).float().mean().item()  # noqa: E731
        rows.append({"layer": layer, "queries": len(positions) * k.shape[0],
                     "bf16_vs_fp32": same(o, a), "running_vs_fp32": same(b, a), "fp32_vs_tf": same(a, c),
                     "bf16_vs_tf": same(o, c), "running_vs_tf": same(b, c)})
    return rows


def rollout_gaps(model, prompt: list[int], args) -> dict:
    out = {}
    params = SamplingParams(max_new_tokens=args.new_tokens, n=args.samples, seed=3, temperature=1.0,
                            ignore_eos=True)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        engine = Engine(model, as_policy(args.budget), EngineConfig(max_batch=args.samples,
                                                                    kernels=Backend.TORCH, cascade=False))
        engine.runner.centroid_dtype = dtype
        samples = engine.generate([prompt], params)[0]
        assert engine.runner.cache.centroids.dtype == dtype
        completions = [c.token_ids for c in samples]
        scored = score_sequences(model, [prompt] * len(samples), completions, [args.budget])
        got = np.concatenate([c.logprobs for c in samples])
        gap = np.abs(got - scored.sparse[args.budget][1])
        out[name] = (gap.max(), gap.mean(), float((gap > 0.05).mean()), [c.token_ids for c in samples])
    return out


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=2048, help="length of the text for the selection study")
    ap.add_argument("--budgets", default="128,256")
    ap.add_argument("--stride", type=int, default=7, help="every stride-th position is a query")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=600)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=torch.bfloat16)
    model = loaded.model.eval()
    tok = loaded.tokenizer
    text = " ".join(f"Item {i}: the value of key{i} is {i * 37 % 101}; remember it." for i in range(400))
    ids = tok(text).input_ids if tok is not None else list(range(3, 3 + args.tokens))
    tokens = (ids * (args.tokens // max(len(ids), 1) + 1))[: args.tokens]
    keys = ("bf16_vs_fp32", "running_vs_fp32", "fp32_vs_tf", "bf16_vs_tf", "running_vs_tf")
    print(f"{args.model} bf16, {args.tokens} tokens, every {args.stride}th position a query: share of "
          "(query, KV head) whose kept page set is the same")
    print(f"{'budget':>6} " + " ".join(f"{k:>15}" for k in keys))
    for budget in [int(b) for b in args.budgets.split(",")]:
        rows = selection_agreement(model, tokens, budget, args.stride)
        w = np.array([r["queries"] for r in rows], dtype=float)
        means = [np.average([r[k] for r in rows], weights=w) for k in keys]
        print(f"{budget:>6} " + " ".join(f"{m:>15.4f}" for m in means))
    args.budget = int(args.budgets.split(",")[0])
    gaps = rollout_gaps(model, tokens[: args.prompt_len], args)
    print(f"rollout: {args.samples} samples x {args.new_tokens} tokens after {args.prompt_len}, budget "
          f"{args.budget}, |engine - teacher forced| logprob:")
    for name, (mx, mean, frac, _) in gaps.items():
        print(f"  centroids {name}: max {mx:.4f}, mean {mean:.5f}, share > 0.05: {frac:.4f}")
    same = np.mean([a == b for a, b in zip(gaps["fp32"][3], gaps["bf16"][3])])
    print(f"  samples identical between the two: {same:.2f}")


if __name__ == "__main__":
    main()
