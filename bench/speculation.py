"""Exact speculative rollouts against dense and the lossy schedule, in one process on one machine.

Per sampler one `Engine.generate` over the same prompts (--prompts distinct kv_lookup prompts of about
--prompt-len tokens on SmolLM2, or random tokens and random bf16 weights for Qwen3-4B shapes on a GPU),
--samples samples each, --new-tokens tokens with EOS ignored so every sampler does the same work:
dense; block top-k at --budget (lossy); and speculative decoding drafting at --budget with each K of
--speculate (exact: dense samples), its later drafts on the pages its first draft kept, at every step's
own pages, or both (--draft-pages; the static decode step's choice, `EngineConfig.reuse_draft_pages`: on
a CPU, --decode-step eager runs it). Reported: whole-rollout and decode seconds, tokens/s, the speedup over
dense, and for speculation the drafts' acceptance and the mean tokens a sample's cycle emits, against what
the acceptance alpha predicts, (1 - a^(K+1)) / (1 - a), with a 95% t-interval over samples on the
measured tokens per cycle. Alpha is measured on the speculative samples themselves (dense samples, so
teacher-forced scoring of them at --budget gives alpha on the distribution the drafts were verified
against; a is its mean over the tokens cycles drafted at), twice: the lossy sampler's, whose sparse
queries read keys its own sparse layers wrote, and a draft's, whose queries read the dense keys and values
that verification keeps (`score_sequences(drafts=True)`), which is what a cycle's drafts see.

The prediction of the floors: with the acceptance measured here, the analytic cost model of --hardware
for --floor-model at --floor-context tokens (batch --floor-batch) prices a cycle as K decode steps at the
budget and one dense forward of K + 1 tokens per sample (stages/speculative_plan.py), printed beside the
measured ratio: on a CPU the weights, not the KV, dominate a SmolLM2 step, so the verification forward
costs what a dense step does and speculation pays only where the KV read dominates. Writes
speculation.parquet into --results (default bench/results).

    .venv/bin/python bench/speculation.py --threads 2                        # CPU: 6K-token prompts
    .venv/bin/python bench/speculation.py --prompt-len 600 --new-tokens 32 --samples 2 --speculate 2 \\
        --threads 2                                                          # a CPU smoke run
    python bench/speculation.py --device cuda --model qwen3-4b --prompt-len 16384 --samples 8 \\
        --new-tokens 512 --budget 2048 --speculate 2,4,6                       # GPU: Qwen3-4B shapes
    .venv/bin/python bench/speculation.py --threads 2 --speculate 4 --decode-step eager \\
        --draft-pages both                                                   # CPU: kept vs every step's pages
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import torch
from common import bench_parser, t_half_width, write_results

from sparrow.stages.core.definitions import validate_budget
from sparrow.stages.core.sparsity import as_policy
from sparrow.stages.cost import analytic
from sparrow.stages.engine import Engine, EngineConfig, SamplingParams
from sparrow.stages.engine.config import DecodeStep
from sparrow.stages.model.loading import has_tokenizer, load_model, spec_tokenizer
from sparrow.stages.model.presets import get_preset
from sparrow.stages.scoring.mismatch import score_sequences
from sparrow.stages.speculative_plan import cycle_seconds, expected_tokens
from sparrow.stages.tasks import TaskError, make_prompts

DENSE_LAYERS = (0, 1)


def text_prompts(args) -> list[list[int]] | None:
    """The kv_lookup prompts, cut to the shortest, made with the model's tokenizer before its weights are
    read (a --prompt-len the task cannot honour is a TaskError before any work); None where the prompts
    are random tokens (random weights, or a model without a tokenizer)."""
    if args.random_weights or not has_tokenizer(args.model):
        return None
    tokenizer = spec_tokenizer(args.model)
    if tokenizer is None:
        return None
    rows = make_prompts("kv_lookup", args.prompts, 0, tokenizer, context_tokens=args.prompt_len)
    prompts = [list(r["prompt_token_ids"]) for r in rows]
    return [p[: min(map(len, prompts))] for p in prompts]


def random_prompts(loaded, args) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, loaded.config.vocab_size, (args.prompt_len,), generator=g).tolist()
            for _ in range(args.prompts)]


def run(model, prompts, args, label: str, budget: int | None, k: int,
        reuse: bool = True) -> tuple[dict, list]:
    """One sampler's rollout, timed after its CUDA graphs are captured; its row is printed at once."""
    params = SamplingParams(max_new_tokens=args.new_tokens, n=args.samples, temperature=args.temperature,
                            seed=0, ignore_eos=True)
    config = EngineConfig(max_batch=args.prompts * args.samples, dense_layers=DENSE_LAYERS, speculate=k,
                          decode_step=DecodeStep(args.decode_step), reuse_draft_pages=reuse)
    with Engine(model, None if budget is None else as_policy(budget), config) as engine:
        engine.reserve(prompts, params)
        engine.warm_up(config.max_batch, [budget or 0])  # CUDA graphs captured untimed (a CPU: nothing)
        t0 = time.perf_counter()
        if args.profile and k:
            with torch.profiler.profile(activities=profiler_activities()) as prof:
                out = engine.generate(prompts, params)
        else:
            out = engine.generate(prompts, params)
        wall = time.perf_counter() - t0
        st = engine.stats
    if args.profile and k:
        print_profile(prof, label)
    tokens = sum(len(c.token_ids) for group in out for c in group)
    row = {"sampler": label, "budget": budget or 0, "speculate": k,
           "kept_pages": bool(k) and reuse and static_step(args),
           "decode_step": args.decode_step, "total_s": wall,
           "prefill_s": st.prefill_s, "decode_s": st.decode_s, "tokens": tokens,
           "tokens_per_s": tokens / wall, "drafted": st.drafted_tokens, "kept": st.accepted_drafts,
           "acceptance": st.accepted_drafts / st.drafted_tokens if st.drafted_tokens else None}
    print(f"{label}: {wall:.2f} s ({st.decode_s:.2f} s decode), {tokens / wall:.1f} tok/s, acceptance "
          f"{'-' if row['acceptance'] is None else format(row['acceptance'], '.3f')}", flush=True)
    return row, [c for group in out for c in group]


def profiler_activities() -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def print_profile(prof, label: str, top: int = 25) -> None:
    """Where a speculative rollout's time went: device kernels and host ops, totals over the run."""
    events = prof.key_averages()
    for key, what in (("self_device_time_total", "device"), ("self_cpu_time_total", "host")):
        rows = sorted(events, key=lambda e: getattr(e, key, 0) or 0, reverse=True)[:top]
        print(f"{label}: {what} time by op (total ms, calls):")
        for e in rows:
            print(f"  {(getattr(e, key, 0) or 0) / 1e3:10.1f} {e.count:8d}  {e.key[:100]}")


def static_step(args) -> bool:
    """Whether the engine runs the static decode step here, the one that can keep a cycle's pages."""
    step = EngineConfig(decode_step=DecodeStep(args.decode_step)).for_device(torch.device(args.device))
    return step.decode_step != DecodeStep.PLAIN


def cycles_per_sample(samples) -> np.ndarray:
    """Tokens each sample's cycles emitted on average: every cycle ends with one token drawn densely
    (a resampled or bonus token); the first token comes from the prefill."""
    out = []
    for c in samples:
        cycles = sum(not a for a in c.accepted[1:])
        out.append((len(c.token_ids) - 1) / max(cycles, 1))
    return np.array(out)


def measured_alpha(model, prompts, samples, args, budget: int) -> tuple[float, float]:
    """Mean alpha at `budget` over the positions the speculative samples' cycles drafted at (all but the
    first token, the prefill's): the lossy sampler's (over its own sparse keys), and a draft's (over the
    dense keys and values that verification keeps, `score_sequences(drafts=True)`)."""
    n = args.samples
    lossy, draft = [], []
    for i, c in enumerate(samples[: args.alpha_samples or None]):
        scored = score_sequences(model, [prompts[i // n]], [c.token_ids], [budget],
                                 temperature=args.temperature, dense_layers=DENSE_LAYERS, drafts=True)
        lossy.append(scored.sparse[budget][0][1:])
        draft.append(scored.draft[budget][1:])
    return float(np.mean(np.concatenate(lossy))), float(np.mean(np.concatenate(draft)))


def floor_prediction(args, a: float, k: int, kept: bool) -> float:
    """The analytic cost model's speedup of speculation over dense at the floor workload."""
    cost = analytic(get_preset(args.floor_model).config, args.hardware, dense_layers=DENSE_LAYERS)
    b, c = args.floor_batch, args.floor_context
    cycle = float(cycle_seconds(cost, b, c, args.budget, k, kept))
    return expected_tokens(a, k) * float(cost.step_seconds(b, c, 0)) / cycle


TABLE_HEADER = (f"{'sampler':52} {'total s':>8} {'decode s':>9} {'tok/s':>7} {'x dense':>8} {'accept':>7} "
                f"{'alpha':>6} {'draft a':>7} {'tok/cycle (95%)':>17} {'predicted':>9} {'by draft a':>10} "
                f"{'floor x':>8}")


def cell(value: float | None, width: int, digits: int, suffix: str = "") -> str:
    """A number in a column of `width` (its suffix included), or "-" where it does not apply."""
    text = "-" if value is None else f"{value:.{digits}f}{suffix}"
    return f"{text:>{width}}"


def table_line(r: dict) -> str:
    """A row of the table: acceptance, alpha, tokens per cycle, their predictions and the floor apply to
    speculation only, and are "-" on the dense and lossy rows."""
    spec = r["speculate"] > 0
    cyc = f"{r['tokens_per_cycle']:.2f} +- {r['tokens_per_cycle_half_width']:.2f}" if spec else None
    return (f"{r['sampler']:52} {r['total_s']:8.1f} {r['decode_s']:9.1f} {r['tokens_per_s']:7.1f} "
            f"{cell(r['speedup'], 8, 2, 'x')} {cell(r.get('acceptance'), 7, 3)} "
            f"{cell(r.get('alpha_mean'), 6, 3)} {cell(r.get('draft_alpha_mean'), 7, 3)} {cyc or '-':>17} "
            f"{cell(r.get('predicted_tokens_per_cycle'), 9, 2)} "
            f"{cell(r.get('draft_predicted_tokens_per_cycle'), 10, 2)} "
            f"{cell(r.get('floor_speedup'), 8, 2, 'x')}")


def main() -> None:
    ap = bench_parser(__doc__, "speculation")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=6000)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--budget", type=int, default=512, help="the lossy budget and the drafts'")
    ap.add_argument("--speculate", default="2,4", help="K values (drafts per cycle)")
    ap.add_argument("--draft-pages", choices=("kept", "every", "both"), default="kept",
                    help="a cycle's later drafts on the pages its first draft kept, or on their own")
    ap.add_argument("--decode-step", choices=[s.value for s in DecodeStep], default="auto",
                    help="auto: CUDA graphs on a GPU, the plain step on a CPU; eager: the static step")
    ap.add_argument("--alpha-samples", type=int, default=0,
                    help="score the first N speculative samples for alpha (0 = all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="torch.profiler over each speculative rollout")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--floor-model", default="qwen3-4b")
    ap.add_argument("--floor-context", type=int, default=32768)
    ap.add_argument("--floor-batch", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    args.random_weights = args.random_weights or (device.type == "cuda" and args.model == "qwen3-4b")
    try:
        validate_budget(args.budget)
    except ValueError as e:
        ap.error(f"--budget: {e}")
    try:
        prompts = text_prompts(args)
    except TaskError as e:
        ap.error(str(e).replace("--context-tokens", "--prompt-len"))
    loaded = load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype),
                        random_weights=args.random_weights)
    model = loaded.model
    prompts = prompts or random_prompts(loaded, args)
    print(f"{args.model} on {platform.node()} ({args.device}, {args.dtype}, {args.threads} threads): "
          f"{len(prompts)} prompt(s) of {len(prompts[0])} tokens x {args.samples} samples x "
          f"{args.new_tokens} new tokens, temperature {args.temperature}", flush=True)
    run(model, [prompts[0][:256]], argparse.Namespace(**{**vars(args), "new_tokens": 4}), "warm-up", None, 0)
    rows = []
    dense, _ = run(model, prompts, args, "dense", None, 0)
    rows.append(dense)
    lossy, _ = run(model, prompts, args, f"budget {args.budget}", args.budget, 0)
    rows.append(lossy)
    modes = {"kept": [True], "every": [False], "both": [True, False]}[args.draft_pages]
    modes = modes if static_step(args) else modes[:1]  # the plain step selects at every draft either way
    for k in [int(x) for x in args.speculate.split(",")]:
        alphas = None  # alpha on the dense samples: the same law whichever pages drafted
        for reuse in modes:
            pages = ("kept pages" if reuse else "every step's pages") if static_step(args) \
                else "plain step: every draft selects"
            row, samples = run(model, prompts, args, f"speculative K={k} at {args.budget}, {pages}",
                               args.budget, k, reuse)
            per_sample = cycles_per_sample(samples)
            mean, half = float(per_sample.mean()), t_half_width(per_sample)
            if alphas is None:
                alphas = measured_alpha(model, prompts, samples, args, args.budget)
            a, a_draft = alphas
            row.update(tokens_per_cycle=mean, tokens_per_cycle_half_width=half, alpha_mean=a,
                       draft_alpha_mean=a_draft, predicted_tokens_per_cycle=expected_tokens(a, k),
                       draft_predicted_tokens_per_cycle=expected_tokens(a_draft, k),
                       floor_speedup=floor_prediction(args, a, k, reuse))
            rows.append(row)
    print(TABLE_HEADER)
    for r in rows:
        r["speedup"] = dense["total_s"] / r["total_s"]
        print(table_line(r))
    print(f"floor x: the analytic {args.hardware} model's speedup over dense for {args.floor_model} at "
          f"{args.floor_context} tokens, batch {args.floor_batch}, with this acceptance")
    for r in rows:
        r.update(model=args.model, device=args.device, dtype=args.dtype, threads=args.threads,
                 prompt_tokens=len(prompts[0]), samples=args.samples, new_tokens=args.new_tokens)
    write_results(rows, "speculation", args.results)


if __name__ == "__main__":
    main()
