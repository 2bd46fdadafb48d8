"""Seconds per GRPO step: our Trainer against TRL's GRPOTrainer, same model, prompts and batch, one process.

Each side trains from the same fp32 weights of the embedded SmolLM2-135M (TRL loads the checkpoint directory
that `load_model` converts under $SPARROW_HOME) on the same passkey prompts in the same order, P prompts x K
samples per step, both generating exactly --max-new-tokens tokens (our engine ignores EOS, TRL suppresses it
with `min_new_tokens`), LoRA of the same rank/alpha on q/k/v/o/gate/up/down, no KL, one PPO epoch, AdamW at
a constant lr, temperature 1, micro-batches of --micro-batch sequences, no gradient checkpointing. Sides:
- `dense`, `sparse`: `sparrow.stages.train.Trainer` with dense rollouts or `budget:--budget`; its phases are
  those of its metrics rows (rollout, dense old-logprob scoring, update);
- `trl`: `trl.GRPOTrainer` (HF `generate`); rollout = `_generate` (tokenize, generate, decode), scoring = its
  no-grad logprob passes (old/reference logps: none in this setup, TRL skips them when one generation feeds
  one optimizer step and there is no KL), update = the rest of the optimizer step (`on_step_begin` to
  `on_step_end`) less the reward function.
Prints per side the median over the steps after the first (reported apart, as warm-up) of rollout / scoring /
update seconds, their total, the wall time of the whole step, generated tokens per step, and each side's
ratio to the first side. Writes train_vs_trl.parquet into --results (default bench/results; our runs in its
train_vs_trl-runs/).

    .venv/bin/python bench/train_vs_trl.py            # ours dense vs TRL: 1K-token prompts, 64 new tokens
    .venv/bin/python bench/train_vs_trl.py --long     # ours dense vs ours budget:256 at 512 new tokens
    .venv/bin/python bench/train_vs_trl.py --long --sides dense,sparse,trl
"""

from __future__ import annotations

import functools
import shutil
import statistics
import tempfile
import time

import numpy as np
import pyarrow.parquet as pq
import torch
from common import bench_parser, write_results

from sparrow.stages.model.adapter import TARGET_MODULES
from sparrow.stages.model.loading import embedded_checkpoint, load_model
from sparrow.stages.tasks import make_prompts, score
from sparrow.stages.train import PromptRow, TrainConfig, Trainer

RUNS = "train_vs_trl-runs"  # in --results
PHASES = ("rollout", "scoring", "update")


def step_batches(rows: list[PromptRow], seed: int, p: int, steps: int) -> list[list[PromptRow]]:
    """The prompts of each step as our Trainer visits them: epoch e in the order permutation(seed, e)."""
    n = len(rows)
    order = {e: np.random.default_rng([seed, e]).permutation(n) for e in range(steps * p // n + 1)}
    return [[rows[int(order[k // n][k % n])] for k in range(s * p, (s + 1) * p)] for s in range(steps)]


def run_ours(args, side: str, rows: list[PromptRow], batches) -> list[dict]:
    loaded = load_model(args.model)
    run_dir = args.results / RUNS / side
    shutil.rmtree(run_dir, ignore_errors=True)
    config = dict(
        model=args.model,
        steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        temperature=1.0,
        lr=args.lr,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        kl_coef=0.0,
        ppo_epochs=1,
        micro_batch=args.micro_batch,
        seed=args.seed,
        checkpoint_every=args.steps,
        eval_every=args.steps,
        sparsity="dense" if side == "dense" else f"budget:{args.budget}",
        ignore_eos=True,
    )
    trainer = Trainer(TrainConfig(**config), loaded, rows, run_dir)
    walls = []
    train_step = trainer.train_step

    def timed_step():
        t0 = time.perf_counter()
        row = train_step()
        walls.append(time.perf_counter() - t0)
        return row

    trainer.train_step = timed_step
    trainer.run()
    n = args.prompts_per_step * args.samples
    out = []
    for row, wall, batch in zip(trainer.history, walls, batches):
        seen = pq.read_table(run_dir / "mismatch" / f"step={row['step']:05d}.parquet", columns=["prompt_id"])
        out.append(
            {
                "rollout": row["rollout_seconds"],
                "scoring": row["scoring_seconds"],
                "update": row["update_seconds"],
                "wall": wall,
                "tokens": row["response_length"] * n,
                "prompt_tokens": args.samples * sum(len(r.token_ids) for r in batch),
                "same_prompts": set(seen.column("prompt_id").to_pylist()) == {r.prompt_id for r in batch},
            }
        )
    return out


def run_trl(args, batches, texts: dict[str, str]) -> list[dict]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    folder = embedded_checkpoint(args.model)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    flat = [r for batch in batches for r in batch]  # in step order: TRL's sampler does not shuffle here
    data = Dataset.from_dict(
        {
            "prompt": [texts[r.prompt_id] for r in flat],
            "task": [r.task for r in flat],
            "answer": [r.answer for r in flat],
            "metadata": [r.metadata for r in flat],
        }
    )

    def passkey_reward(completions, task, answer, metadata, **_):
        return [score(t, c, a, m) for c, t, a, m in zip(completions, task, answer, metadata)]

    n = args.prompts_per_step * args.samples
    if n % args.micro_batch:
        raise SystemExit(f"--micro-batch {args.micro_batch} must divide prompts x samples ({n}) for TRL")
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"),
        max_steps=args.steps,
        seed=args.seed,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=n // args.micro_batch,
        num_generations=args.samples,
        max_completion_length=args.max_new_tokens,
        generation_kwargs={"min_new_tokens": args.max_new_tokens},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",
        max_grad_norm=1.0,
        beta=0.0,
        num_iterations=1,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        shuffle_dataset=False,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    lora = LoraConfig(
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=0.0,
        bias="none",
        target_modules=list(TARGET_MODULES),
        task_type="CAUSAL_LM",
    )
    steps: list[dict] = []
    cur: dict = {}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            cur.clear()
            cur.update(rollout=0.0, scoring=0.0, rewards=0.0, t0=time.perf_counter())

        def on_step_end(self, *_, **__):
            wall = time.perf_counter() - cur.pop("t0")
            cur["update"] = wall - cur["rollout"] - cur["scoring"] - cur["rewards"]
            steps.append({**cur, "wall": wall})

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=passkey_reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[StepTimer()],
    )

    def timing(fn, phase=None):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            key = phase or ("scoring" if not torch.is_grad_enabled() else None)
            if key:
                cur[key] += time.perf_counter() - t0
            if fn.__name__ == "_generate":
                prompt_ids, completion_ids = out[0], out[1]
                cur["tokens"] = sum(len(c) for c in completion_ids)
                cur["prompt_tokens"] = sum(len(p) for p in prompt_ids)
                cur["prompt_ids"] = {tuple(p) for p in prompt_ids}
            return out

        return wrapper

    trainer._generate = timing(trainer._generate, "rollout")
    trainer._calculate_rewards = timing(trainer._calculate_rewards, "rewards")
    trainer._get_per_token_logps_and_entropies = timing(trainer._get_per_token_logps_and_entropies)
    trainer.train()
    for s, batch in zip(steps, batches):
        s["same_prompts"] = s.pop("prompt_ids") == {tuple(r.token_ids) for r in batch}
    return steps


def summarize(side: str, steps: list[dict], args) -> dict:
    rest = steps[1:] or steps
    med = {k: statistics.median(s[k] for s in rest) for k in (*PHASES, "wall", "tokens")}
    return {
        "side": side,
        "sparsity": {"dense": "dense", "sparse": f"budget:{args.budget}"}.get(side, "dense"),
        "engine": "trl GRPOTrainer" if side == "trl" else "sparrow Trainer",
        **{f"{k}_s": med[k] for k in PHASES},
        "total_s": sum(med[k] for k in PHASES),
        "wall_s": med["wall"],
        "first_step_total_s": sum(steps[0][k] for k in PHASES),
        "tokens_per_step": med["tokens"],
        "mean_response_length": med["tokens"] / (args.prompts_per_step * args.samples),
        "prompt_tokens_per_step": steps[0]["prompt_tokens"],
        "same_prompts": all(s["same_prompts"] for s in steps),
        "steps_measured": len(rest),
        "context": args.context,
        "max_new_tokens": args.max_new_tokens,
        "prompts_per_step": args.prompts_per_step,
        "samples": args.samples,
        "lora_rank": args.lora_rank,
        "micro_batch": args.micro_batch,
        "lr": args.lr,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    ap = bench_parser(__doc__, "train_vs_trl")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="passkey")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="64 (512 with --long)")
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="the first is warm-up, reported apart")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward, both sides")
    ap.add_argument("--budget", type=int, default=256, help="the sparse side's budget (tokens)")
    ap.add_argument(
        "--sides", default=None, help="of dense,sparse,trl (default dense,trl; --long: dense,sparse)"
    )
    ap.add_argument("--long", action="store_true", help="long generation: 512 new tokens, dense vs sparse")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    args.max_new_tokens = args.max_new_tokens or (512 if args.long else 64)
    sides = (args.sides or ("dense,sparse" if args.long else "dense,trl")).split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    base = load_model(args.model)
    n = args.prompts_per_step * args.steps
    made = make_prompts(args.task, n, args.seed, base.tokenizer, context_tokens=args.context)
    rows = [
        PromptRow(r["prompt_id"], r["task"], r["prompt_token_ids"], r["answer"], r["metadata"]) for r in made
    ]
    texts = {r["prompt_id"]: r["prompt"] for r in made}  # chat-formatted text: what TRL tokenizes
    batches = step_batches(rows, args.seed, args.prompts_per_step, args.steps)
    del base
    (args.results / RUNS).mkdir(parents=True, exist_ok=True)
    results = []
    for side in sides:
        print(f"== {side}", flush=True)
        steps = run_trl(args, batches, texts) if side == "trl" else run_ours(args, side, rows, batches)
        for i, s in enumerate(steps):
            print(
                f"    step {i}: "
                + " / ".join(f"{s[k]:.2f}" for k in PHASES)
                + f" s, wall {s['wall']:.2f} s, {s['tokens']} tokens",
                flush=True,
            )
        results.append(summarize(side, steps, args))
    print(
        f"{args.model}, {args.task} at {args.context} tokens, {args.prompts_per_step} prompts x "
        f"{args.samples} samples x {args.max_new_tokens} new tokens, LoRA rank {args.lora_rank}, "
        f"lr {args.lr}, micro-batch {args.micro_batch}, {torch.get_num_threads()} threads; "
        + (f"median of steps 1..{args.steps - 1}" if args.steps > 1 else "step 0 only (no warm-up)")
    )
    print(
        f"{'side':>6} {'rollout s':>9} {'scoring s':>9} {'update s':>8} {'total s':>7} {'wall s':>6} "
        f"{'step 0 s':>8} {'gen tok':>7} {'resp len':>8} {'prompt tok':>10} {'same prompts':>12}"
    )
    for r in results:
        print(
            f"{r['side']:>6} {r['rollout_s']:>9.2f} {r['scoring_s']:>9.2f} {r['update_s']:>8.2f} "
            f"{r['total_s']:>7.2f} {r['wall_s']:>6.2f} {r['first_step_total_s']:>8.2f} "
            f"{r['tokens_per_step']:>7.0f} {r['mean_response_length']:>8.1f} "
            f"{r['prompt_tokens_per_step']:>10} {'yes' if r['same_prompts'] else 'NO':>12}"
        )
    ref = results[0]
    ratio = lambda a, b: a / b if b > 0 else float("nan")
    for r in results[1:]:
        print(
            f"{r['side']}/{ref['side']}: "
            + ", ".join(f"{k} {ratio(r[f'{k}_s'], ref[f'{k}_s']):.2f}x" for k in (*PHASES, "total", "wall"))
        )
    write_results(results, "train_vs_trl", args.results)


if __name__ == "__main__":
    main()
