"""DistillSparse on the embedded model: the tail of an aggressive budget before and after distillation.

Trains the sparse actor's LoRA (`stages.distill`) on trajectories that the plain sparse actor samples at
--budget from --train-prompts prompts (seed 0), then scores held-out prompts (seed 1, another set) on
trajectories of the dense policy (the same prefixes before and after) under every --budgets candidate,
plain and with the adapter. Prints, per position bin: tokens, the p5 of alpha at --budget before -> after,
and the smallest profiled budget whose p5 reaches --threshold before -> after; then the schedule planned
from each profile (`schedule.plan` over `measured_profile`) and its predicted rollout speedup under the
analytic --hardware cost model at the means over the profile's trajectories of their prompt and generated
lengths, as `sparrow plan-schedule --profile` prices it ("no schedule" where none can be planned); and the
training seconds (sampling and scoring not included). The adapter is taught at every candidate budget in turn
(--train-budgets all, the default; `distilled` teaches it at --budget only, as stop 17 did) and is used
with every candidate budget in the "after" profile. The published aim is read off a last table: per bin
and budget b, the distilled actor's p5 at b against the plain actor's at 2b. Writes
distill.parquet into --results (one row per seed, held-out set, bin and budget). With several --seeds each
seed is a distillation of its own (kept under --out, default distill-seeds/ in --results, so a stopped bench
resumes seed by seed) scored on every --eval-sets held-out set, and a last table gives, per set, bin and
budget, the p5 change as a mean with a 95% t-interval over seeds and in how many seeds the aim was reached.
A kept seed is reused only under the same flags (all but --seeds, --out and --results, recorded beside it:
bench/common.py); one kept under other flags is refused before any work, naming the flag.

    .venv/bin/python bench/distill.py                       # defaults: about 30 min on a 2-core CPU
    .venv/bin/python bench/distill.py --seeds 0,1,2 --eval-sets 1,2   # error bars: about 1.5 h
    .venv/bin/python bench/distill.py --steps 40 --objective k3 --train-budgets distilled
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from common import bench_parser, flags, record_settings, reuse_or_refuse, t_half_width, write_results

from sparrow.schemas.io import write_table
from sparrow.stages.core.schedule import ScheduleError, measured_profile, plan
from sparrow.stages.core.sparsity import budget_fn
from sparrow.stages.cost import analytic
from sparrow.stages.distill import DistillConfig, DistillJob, run_distill
from sparrow.stages.model.loading import load_model, spec_tokenizer
from sparrow.stages.plan import half_up, trajectory_lengths
from sparrow.stages.profile import ProfileOptions, sample_trajectories, summarize
from sparrow.stages.tasks import TaskError, make_prompts

NOT_SETTINGS = ("seeds", "out", "results")  # every other flag decides a seed's rows


def parse():
    ap = bench_parser(__doc__, "distill")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="kv_lookup")
    ap.add_argument("--context", type=int, default=768, help="prompt tokens")
    ap.add_argument("--train-prompts", type=int, default=8)
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--seeds", default="0", help="training seeds (adapter init, batches, the plain actor's "
                    "samples); each finished seed is kept under --out and reused")
    ap.add_argument("--eval-sets", default="1", help="held-out prompt sets (their generator seeds; the "
                    "training prompts are set 0), each scored before and after")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--budget", type=int, default=64, help="the aggressive budget the actor is distilled at")
    ap.add_argument("--budgets", default="48,64,96,128,192,256,384", help="profiled candidates")
    ap.add_argument("--train-budgets", default="all", help="all: the candidates in turn; distilled: --budget "
                    "only; or a comma list")
    ap.add_argument("--unbalanced", action="store_true", help="do not weight each taught budget by 1 / its "
                    "starting objective (DistillConfig.balance_budgets, on by default)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--objective", default="kl")
    ap.add_argument("--threshold", type=float, default=0.86)
    ap.add_argument("--quantile", type=float, default=0.05)
    ap.add_argument("--bin-width", type=int, default=256)
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--batch", type=int, default=64, help="decode batch of the cost model")
    ap.add_argument("--out", type=Path, default=None,
                    help="where each finished seed is kept (default: distill-seeds in --results)")
    args = ap.parse_args()
    args.out = args.out or args.results / "distill-seeds"
    return args


@dataclass(frozen=True)
class Prompts:
    """The training prompts (set 0) and each held-out set's, made once for every seed."""

    train: list[dict]
    eval_sets: dict[int, list[dict]]


def make_all_prompts(args) -> Prompts:
    """Every prompt, with the model's tokenizer and before its weights are read: a --context the task
    cannot honour is one sentence before any work."""
    tok = spec_tokenizer(args.model)
    try:
        train = make_prompts(args.task, args.train_prompts, 0, tok, context_tokens=args.context)
        held = {e: make_prompts(args.task, args.eval_prompts, e, tok, context_tokens=args.context)
                for e in (int(x) for x in args.eval_sets.split(","))}
    except TaskError as e:
        raise SystemExit(str(e).replace("--context-tokens", "--context")) from None
    return Prompts(train, held)


def tails(table, quantile: float, threshold: float) -> dict[tuple[int, int], dict]:
    return {(r["bin"], r["budget"]): r for r in summarize(table, quantile, threshold).to_pylist()}


def smallest(t: dict, b: int, budgets: list[int], threshold: float) -> int | None:
    ok = [k for k in budgets if (b, k) in t and t[(b, k)]["tail_alpha"] >= threshold]
    return min(ok) if ok else None


@dataclass(frozen=True)
class Planned:
    """The schedule planned from a profile and its predicted speedup (None: no schedule, and why), at the
    means over the profile's trajectories of their prompt and generated lengths."""

    budgets: tuple[int, ...]
    speedup: float | None
    prompt_len: int
    gen_len: int
    trajectories: int
    why_none: str = ""

    def describe(self, args, name: str) -> str:
        what = f"schedule planned from the {name} profile at {args.threshold}"
        if self.speedup is None:
            return f"{what}: no schedule ({self.why_none})"
        return (f"{what}: budgets {list(self.budgets)} per {args.bin_width}-token bin, predicted speedup "
                f"{self.speedup:.3f}x ({args.hardware}, batch {args.batch}, a mean of {self.gen_len} "
                f"generated tokens after a mean prompt of {self.prompt_len}, over {self.trajectories} "
                "trajectories)")


def predicted_speedup(table, args, cfg) -> Planned:
    """As `sparrow plan-schedule --profile` prices a measured profile: at the means over its trajectories
    (prompt_id, sample), a trajectory's generated tokens being its distinct positions."""
    prompts, generated = trajectory_lengths(table)
    prompt_len, gen_len = half_up(np.mean(prompts)), half_up(np.mean(generated))
    lengths = (prompt_len, gen_len, len(prompts))
    if gen_len < 2:  # the first token comes from the dense prefill: no decode step to price
        return Planned((), None, *lengths, f"a mean of {gen_len} generated token: no decode step to price")
    last = max(max(p + g - 1 for p, g in zip(prompts, generated, strict=True)), prompt_len + gen_len - 1)
    try:
        result = plan(measured_profile(table, args.quantile, args.bin_width, last // args.bin_width + 1,
                                       "the profile", min_tokens=20), args.threshold)
    except ScheduleError as e:  # too few tokens in every bin to plan from
        return Planned((), None, *lengths, str(e))
    cost = analytic(cfg, args.hardware)
    speedup = cost.speedup(result.schedule.budgets_at, gen_len, args.batch, prompt_len)
    return Planned(result.schedule.budgets, float(speedup), *lengths)


def run_one(args, loaded, prompts: Prompts, seed: int) -> list[dict]:
    """One distillation (training seed `seed`: the adapter's initialisation and batches, and the plain
    actor's training samples), scored on every --eval-sets held-out set; rows per set, bin and budget."""
    budgets = [int(x) for x in args.budgets.split(",")]
    torch.manual_seed(seed)
    train_rows, eval_rows = prompts.train, prompts.eval_sets
    eval_sets = list(eval_rows)
    ids = lambda rows: [r["prompt_id"] for r in rows]
    toks = lambda rows: [r["prompt_token_ids"] for r in rows]
    t0 = time.perf_counter()
    sampling = dict(samples=args.samples, max_new_tokens=args.max_new_tokens, batch_size=16)
    plain = ProfileOptions(budgets=budgets, sampler=f"budget:{args.budget}", seed=seed * 1000, **sampling)
    train = sample_trajectories(loaded, ids(train_rows), toks(train_rows), plain)
    rows_all = [r for e in eval_sets for r in eval_rows[e]]
    held = sample_trajectories(loaded, ids(rows_all), toks(rows_all),
                               ProfileOptions(budgets=budgets, sampler="dense", seed=1, **sampling))
    print(f"seed {seed}: sampled {len(train)} training trajectories (plain actor, budget {args.budget}) and "
          f"{len(held)} held-out dense ones in {time.perf_counter() - t0:.0f} s")
    cfg = DistillConfig(steps=args.steps, batch_size=args.batch_size, lora_rank=args.rank,
                        lora_alpha=args.alpha, lr=args.lr, objective=args.objective,
                        balance_budgets=not args.unbalanced, seed=seed)

    def on_step(r: dict) -> None:
        print(f"  step {r['step']:3d}  {args.objective} loss {r['loss']:.4g}  "
              f"grad norm {r['grad_norm']:.3g}  {r['seconds']:.1f} s", flush=True)

    taught = {"all": budgets, "distilled": [args.budget]}.get(args.train_budgets)
    taught = taught or [int(x) for x in args.train_budgets.split(",")]
    job = DistillJob(train, [budget_fn(b) for b in taught], held, budgets, args.bin_width)
    distiller, result = run_distill(loaded, job, cfg, on_step, lambda p: print(p, flush=True))
    print(f"\n{args.model}, {args.task} at {args.context} prompt tokens, {args.max_new_tokens} new "
          f"tokens; sampled at budget {args.budget}, taught at budgets {taught}"
          f"{' (unbalanced)' if args.unbalanced else ' (balanced)'} ({args.objective}, rank "
          f"{args.rank}, alpha {args.alpha}, lr {args.lr}, {args.steps} steps x {args.batch_size} "
          f"trajectories, seed {seed}): {result.seconds:.0f} s of training")
    if not args.unbalanced:
        print("budget weights: " + ", ".join(f"{b}: {w:.3g}" for b, w in zip(taught, distiller.weights)))
    out = []
    for e in eval_sets:
        of_set = lambda t, prefix=f"{args.task}-{e}-": t.filter(pc.starts_with(t.column("prompt_id"), prefix))
        before, after = of_set(result.before), of_set(result.after)
        rows = report(args, budgets, tails(before, args.quantile, args.threshold),
                      tails(after, args.quantile, args.threshold), f"seed {seed}, held-out set {e}")
        plan_before = predicted_speedup(before, args, loaded.config)
        plan_after = predicted_speedup(after, args, loaded.config)
        for name, planned in (("before", plan_before), ("after", plan_after)):
            print(planned.describe(args, name))
        meta = {"seed": seed, "eval_set": e, "training_seconds": result.seconds,
                "speedup_before": plan_before.speedup, "speedup_after": plan_after.speedup,
                "taught": str(taught), "schedule_before": str(list(plan_before.budgets)),
                "schedule_after": str(list(plan_after.budgets)), "prompt_len": plan_before.prompt_len,
                "gen_len": plan_before.gen_len,
                "loss_first": result.history[0]["loss"], "loss_last": result.history[-1]["loss"],
                **{k: v for k, v in vars(args).items() if k not in (*NOT_SETTINGS, "eval_sets")}}
        out += [{**meta, **r} for r in rows]  # the row's own budget, not --budget
    return out


def report(args, budgets: list[int], before: dict, after: dict, what: str) -> list[dict]:
    """Print one held-out set's p5 table (plain -> distilled) and the published aim; its rows."""
    bins = sorted({k[0] for k in before})
    mark = lambda v: f"{v:.3f}{'*' if v >= args.threshold else ' '}"
    print(f"{what}: p5 of alpha per bin (rows) and budget (columns), plain -> distilled; '*': >= "
          f"{args.threshold}")
    print(f"{'bin':>4} {'tokens':>6} " + " ".join(f"{b:>13}" for b in budgets))
    rows = []
    for b in bins:
        cells = []
        for k in budgets:
            x, y = before.get((b, k)), after.get((b, k))
            if x is None or y is None:
                cells.append(f"{'':>13}")
                continue
            half = before.get((b, 2 * k))
            rows.append({"bin": b, "budget": k, "tokens": x["tokens"], "p5_before": x["tail_alpha"],
                         "p5_after": y["tail_alpha"], "mean_before": x["mean_alpha"],
                         "mean_after": y["mean_alpha"],
                         "p5_before_at_double": half["tail_alpha"] if half else None,
                         "min_budget_before": smallest(before, b, budgets, args.threshold),
                         "min_budget_after": smallest(after, b, budgets, args.threshold)})
            cells.append(f"{mark(x['tail_alpha'])}->{mark(y['tail_alpha'])}")
        tokens = before[(b, budgets[0])]["tokens"] if (b, budgets[0]) in before else 0
        print(f"{b:>4} {tokens:>6} " + " ".join(cells))
    print("the published aim, per bin: the distilled actor at budget b against the plain actor at 2b")
    for r in rows:
        if r["p5_before_at_double"] is not None:
            verdict = "reached" if r["p5_after"] >= r["p5_before_at_double"] else "not reached"
            print(f"  bin {r['bin']}: distilled at {r['budget']:>4}: {r['p5_after']:.3f}   plain at "
                  f"{2 * r['budget']:>4}: {r['p5_before_at_double']:.3f}   {verdict}")
    return rows


def summary(rows: list[dict]) -> None:
    """Across seeds, per held-out set, bin and budget: the p5 change (distilled - plain) as a mean with a
    95% t-interval over seeds, and in how many seeds the distilled actor at b reached the plain one at 2b."""
    keys = sorted({(r["eval_set"], r["bin"], r["budget"]) for r in rows})
    print("\nacross seeds: p5 change (distilled - plain), mean [95% t-interval over seeds]; the aim reached "
          "in k of n seeds")
    for e, b, k in keys:
        cell = [r for r in rows if (r["eval_set"], r["bin"], r["budget"]) == (e, b, k)]
        d = np.array([r["p5_after"] - r["p5_before"] for r in cell])
        half = t_half_width(d)
        aim = [r["p5_after"] >= r["p5_before_at_double"] for r in cell
               if r["p5_before_at_double"] is not None]
        print(f"  set {e} bin {b} budget {k:>4}: {d.mean():+.3f} [{d.mean() - half:+.3f}, "
              f"{d.mean() + half:+.3f}] over {len(d)} seeds"
              + (f"; aim reached in {sum(aim)} of {len(aim)}" if aim else ""))


def main() -> None:
    args = parse()
    settings = flags(args, *(k for k in vars(args) if k not in NOT_SETTINGS))
    tag = (f"{args.task}-{args.context}-b{args.budget}-{args.train_budgets}-{args.objective}-s{args.steps}"
           f"-e{args.eval_sets.replace(',', '_')}")
    paths = {int(x): args.out / f"{tag}-seed{x}.parquet" for x in args.seeds.split(",")}
    kept = {seed: reuse_or_refuse(path, settings) for seed, path in paths.items()}  # before any work
    prompts = None if all(kept.values()) else make_all_prompts(args)
    loaded = None if prompts is None else load_model(args.model)
    rows = []
    for seed, path in paths.items():
        if kept[seed]:  # a finished seed: the bench resumes seed by seed
            rows += pq.read_table(path).to_pylist()
            continue
        record_settings(path, settings)
        part = run_one(args, loaded, prompts, seed)
        write_table(pa.Table.from_pylist(part), path)
        rows += part
    write_results(rows, "distill", args.results)
    if len({r["seed"] for r in rows}) > 1:
        summary(rows)


if __name__ == "__main__":
    main()
