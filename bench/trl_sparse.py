"""Seconds per TRL GRPOTrainer step: Sparrow's sparse sampler (`rollout_func`) against TRL's own generation.

Both sides are the same `trl.GRPOTrainer` run on the embedded SmolLM2-135M (fp32, the checkpoint directory
`load_model` converts under $SPARROW_HOME), on the same passkey prompts in the same order, P prompts x K
samples per step (one rollout, micro-batches of --micro-batch sequences), LoRA rank 16 on
q/k/v/o/gate/up/down, no KL, one PPO epoch, temperature 1, no gradient checkpointing, no
importance-sampling correction, and exactly --max-new-tokens tokens per completion (TRL's generate with
`min_new_tokens`, our engine with `ignore_eos`). Sides:
- `trl`: TRL's generation (transformers `generate`, the path a run without vLLM takes);
- `sparse`: `SparseRollout("budget:--budget")` as `rollout_func` (stages/integrations/trl.py): our engine
  samples under block top-k, then scores the samples densely for the sparrow/ mismatch metrics.
Per step: the wall time (`on_step_begin` to `on_step_end`) and the rollout (TRL's `_generate`, which calls
the rollout function). Each side's steps after the first (reported apart, as warm-up) give its medians;
the ratio is TRL's step time over ours, both measured in the same run. A side measured before with the same
settings is read back from trl_sparse-sides/ in --results instead of run again (--fresh reruns it).
Writes trl_sparse.parquet into --results (default bench/results).

    .venv/bin/python bench/trl_sparse.py                 # 2 prompts x 4 samples x 64 tokens at 1K tokens
    .venv/bin/python bench/trl_sparse.py --context 2048 --budget 256 --fresh
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from common import bench_parser, write_results  # noqa: E402

from sparrow.stages.model.adapter import TARGET_MODULES  # noqa: E402
from sparrow.stages.model.loading import embedded_checkpoint, load_model  # noqa: E402
from sparrow.stages.tasks import make_prompts, score  # noqa: E402

SIDES = "trl_sparse-sides"  # in --results


def run_side(side: str, args, rows: list[dict]) -> list[dict]:
    """One GRPOTrainer run of --steps steps; per step its wall and rollout seconds and tokens."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from sparrow.stages.integrations.trl import SparseRollout

    folder = str(embedded_checkpoint(args.model))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    data = Dataset.from_dict({"prompt": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows],
                              "metadata": [r["metadata"] for r in rows]})

    def passkey_reward(completions, answer, metadata, **_):
        return [score(args.task, c, a, m) for c, a, m in zip(completions, answer, metadata)]

    n = args.prompts_per_step * args.samples
    if n % args.micro_batch:
        raise SystemExit(f"--micro-batch {args.micro_batch} must divide prompts x samples ({n})")
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-sparse-bench-"), max_steps=args.steps, seed=args.seed,
        per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=n // args.micro_batch,
        num_generations=args.samples,
        max_completion_length=args.max_new_tokens,
        generation_kwargs={"min_new_tokens": args.max_new_tokens}, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=2e-4, lr_scheduler_type="constant", weight_decay=0.0, beta=0.0, num_iterations=1,
        loss_type="dapo", shuffle_dataset=False, gradient_checkpointing=False, use_cpu=True,
        vllm_importance_sampling_correction=False, report_to="none", save_strategy="no",
        logging_strategy="no", disable_tqdm=True)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, bias="none", target_modules=list(TARGET_MODULES),
                      task_type="CAUSAL_LM")
    steps: list[dict] = []
    cur: dict = {}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            cur.clear()
            cur.update(rollout=0.0, t0=time.perf_counter())

        def on_step_end(self, *_, **__):
            steps.append({**cur, "wall": time.perf_counter() - cur.pop("t0")})

    rollout = (SparseRollout(f"budget:{args.budget}", bin_width=args.bin_width, ignore_eos=True)
               if side == "sparse" else None)
    trainer = GRPOTrainer(model=model, reward_funcs=passkey_reward if rollout is None
                          else rollout.with_metrics(passkey_reward), args=config, train_dataset=data,
                          processing_class=tokenizer, peft_config=lora, callbacks=[StepTimer()],
                          rollout_func=rollout)
    generate = trainer._generate  # the rollout phase of both sides: TRL calls the rollout function in it

    def timed_generate(prompts):
        t0 = time.perf_counter()
        out = generate(prompts)
        cur["rollout"] += time.perf_counter() - t0
        cur["tokens"] = sum(len(c) for c in out[1])
        return out

    trainer._generate = timed_generate
    trainer.train()
    return steps


def summarize(side: str, steps: list[dict], args) -> dict:
    rest = steps[1:] or steps
    return {"side": side, "sampler": "sparrow SparseRollout" if side == "sparse" else "trl generate",
            "sparsity": f"budget:{args.budget}" if side == "sparse" else "dense",
            "wall_s": statistics.median(s["wall"] for s in rest),
            "rollout_s": statistics.median(s["rollout"] for s in rest),
            "first_step_wall_s": steps[0]["wall"], "tokens_per_step": rest[0]["tokens"],
            "steps_measured": len(rest), **settings(args)}


def settings(args) -> dict:
    """What a side's numbers depend on (a stored side is reused only when all of it matches)."""
    return {"model": args.model, "task": args.task, "context": args.context,
            "max_new_tokens": args.max_new_tokens,
            "prompts_per_step": args.prompts_per_step, "samples": args.samples, "steps": args.steps,
            "budget": args.budget, "micro_batch": args.micro_batch, "seed": args.seed,
            "threads": torch.get_num_threads()}


def main() -> None:
    ap = bench_parser(__doc__, "trl_sparse")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="passkey")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="the first is warm-up, reported apart")
    ap.add_argument("--budget", type=int, default=128, help="the sparse side's block top-k budget (tokens)")
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per forward/backward (TRL's "
                    "per_device_train_batch_size; one rollout still samples the whole step)")
    ap.add_argument("--bin-width", type=int, default=512)
    ap.add_argument("--sides", default="trl,sparse")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--fresh", action="store_true", help="rerun sides measured before")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base = load_model(args.model)
    rows = make_prompts(args.task, args.prompts_per_step * args.steps, args.seed, base.tokenizer,
                        context_tokens=args.context)
    del base
    sides = args.results / SIDES
    sides.mkdir(parents=True, exist_ok=True)
    results = []
    for side in args.sides.split(","):
        stored = sides / f"{side}.json"
        kept = json.loads(stored.read_text()) if stored.exists() and not args.fresh else None
        if kept is not None and all(kept.get(k) == v for k, v in settings(args).items()):
            print(f"== {side}: measured before ({stored}; --fresh reruns it)", flush=True)
            results.append(kept)
            continue
        print(f"== {side}", flush=True)
        steps = run_side(side, args, rows)
        for i, s in enumerate(steps):
            print(f"    step {i}: wall {s['wall']:.2f} s, rollout {s['rollout']:.2f} s, {s['tokens']} tokens",
                  flush=True)
        result = summarize(side, steps, args)
        stored.write_text(json.dumps(result, indent=2))
        results.append(result)
    print(f"{args.model}, {args.task} at {args.context} tokens, {args.prompts_per_step} prompts x "
          f"{args.samples} samples x {args.max_new_tokens} new tokens, budget {args.budget}, "
          f"{torch.get_num_threads()} threads; "
          f"median of steps 1..{args.steps - 1}")
    for r in results:
        print(f"{r['side']:>7}: step {r['wall_s']:.2f} s, rollout {r['rollout_s']:.2f} s, "
              f"first step {r['first_step_wall_s']:.2f} s")
    by = {r["side"]: r for r in results}
    if {"trl", "sparse"} <= by.keys():
        print(f"trl / sparse: step {by['trl']['wall_s'] / by['sparse']['wall_s']:.2f}x, rollout "
              f"{by['trl']['rollout_s'] / by['sparse']['rollout_s']:.2f}x")
    write_results(results, "trl_sparse", args.results)


if __name__ == "__main__":
    main()
