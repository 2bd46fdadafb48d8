"""TRL's GRPOTrainer with Sparrow's sparse sampler, on the embedded SmolLM2-135M, on a CPU (docs/trl.md).

Passkey prompts (a number hidden in filler text, asked for at the end) as chat messages, a reward of 1
for the right number, LoRA, a few GRPO steps. TRL trains; Sparrow's engine generates every completion
under block top-k attention at --budget (or --schedule), with its weights copied from the trainer after
each optimizer step, and the mismatch metrics appear among TRL's logs as sparrow/... .

    .venv/bin/python examples/trl_grpo_sparse.py                       # 3 steps, budget 64
    .venv/bin/python examples/trl_grpo_sparse.py --schedule run/schedule.parquet --steps 10

Needs TRL and datasets (the `bench` extra): .venv/bin/uv pip install --python .venv/bin/python trl datasets.
Every flag, the prompts' length and the extra are checked before the model loads, each refusal one line.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
from typing import TYPE_CHECKING

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL

from sparrow.schemas import ArtifactError, artifact_metadata  # noqa: E402
from sparrow.stages.core.definitions import validate_budget  # noqa: E402
from sparrow.stages.integrations.trl import SparseRollout  # noqa: E402
from sparrow.stages.model.adapter import TARGET_MODULES  # noqa: E402
from sparrow.stages.model.loading import embedded_checkpoint, resolve_config  # noqa: E402
from sparrow.stages.tasks import TaskError, chat_format, get_task, score  # noqa: E402
from sparrow.stages.tasks.learnable import MIN_CONTEXT_TOKENS  # noqa: E402

if TYPE_CHECKING:
    from datasets import Dataset

INSTALL = ".venv/bin/uv pip install --python .venv/bin/python trl datasets"


def passkey_rows(tokenizer, n: int, context: int, seed: int) -> list[tuple[str, str, int]]:
    """n passkey prompts of about `context` tokens -> (user message, answer, prompt tokens) each."""
    measure = lambda user: len(chat_format(tokenizer, user)[1])
    return [(r.user, r.answer, measure(r.user))
            for r in get_task("passkey").generate(n, seed, measure, context_tokens=context)]


def passkey_dataset(rows: list[tuple[str, str, int]]) -> Dataset:
    """The prompts as TRL's conversational rows (prompt = messages)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": user}] for user, _, _ in rows],
                              "answer": [answer for _, answer, _ in rows]})


def passkey_reward(completions, answer, **_) -> list[float]:
    """TRL reward function: 1 when the completion gives the passkey."""
    return [score("passkey", c[0]["content"], a, None) for c, a in zip(completions, answer)]


MODEL = "smollm2-135m"
# samples: GRPO compares a prompt's samples, so one gives no advantage
# context: the passkey task's shortest document
AT_LEAST = {"steps": 1, "prompts_per_step": 1, "samples": 2, "context": MIN_CONTEXT_TOKENS,
            "max_new_tokens": 1, "bin_width": 1, "seed": 0}


def checked_rollout(ap: argparse.ArgumentParser, args: argparse.Namespace) -> SparseRollout:
    """The flags checked (argparse's one-line error, exit 2) and the sampler built from them."""
    for name, low in AT_LEAST.items():
        if getattr(args, name) < low:
            ap.error(f"--{name.replace('_', '-')} must be at least {low}, got {getattr(args, name)}")
    window = resolve_config(MODEL).max_position_embeddings
    if args.context + args.max_new_tokens > window:
        ap.error(f"--context {args.context} with --max-new-tokens {args.max_new_tokens} exceeds {MODEL}'s "
                 f"context of {window} tokens")
    if args.schedule is not None and not args.schedule.strip():
        ap.error("--schedule is an empty path; give a schedule file")
    budget = 64 if args.budget is None else args.budget
    try:
        validate_budget(budget)
    except ValueError as e:
        ap.error(f"--budget: {e}")
    sparsity = f"schedule:{args.schedule}" if args.schedule is not None else f"budget:{budget}"
    try:
        rollout = SparseRollout(sparsity, bin_width=args.bin_width)
    except (ValueError, ArtifactError) as e:
        ap.error(f"--{sparsity.split(':')[0]}: {e}")
    planned_for = artifact_metadata(args.schedule).get("model") if args.schedule else None
    if planned_for and planned_for != MODEL:
        print(f"warning: --schedule {args.schedule} was planned for {planned_for}, not {MODEL}",
              file=sys.stderr)
    return rollout


def checked_prompts(ap: argparse.ArgumentParser, args: argparse.Namespace, tokenizer
                    ) -> list[tuple[str, str, int]]:
    """The passkey prompts, made with the tokenizer alone (each at most --context tokens, which `main`
    checked against the model's context with --max-new-tokens); a --context too short is one line."""
    try:
        return passkey_rows(tokenizer, args.steps * args.prompts_per_step, args.context, args.seed)
    except TaskError as e:
        ap.error(str(e).replace("--context-tokens", "--context"))


def require_extra(ap: argparse.ArgumentParser) -> None:
    """TRL and datasets importable, else one line naming the install (exit 2)."""
    missing = []
    for module in ("trl", "datasets"):
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        ap.exit(2, f"{ap.prog}: error: this example needs {' and '.join(missing)} (the bench extra), which "
                   f"are not installed; install them with: {INSTALL}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--samples", type=int, default=4, help="TRL's num_generations")
    ap.add_argument("--context", type=int, default=400, help="prompt tokens")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    sparsity = ap.add_mutually_exclusive_group()
    sparsity.add_argument("--budget", type=int, default=None,
                          help="block top-k budget in tokens (default 64)")
    sparsity.add_argument("--schedule", default=None, help="a schedule artifact instead of --budget")
    ap.add_argument("--bin-width", type=int, default=512, help="position bin of the sparrow/ tail metrics")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rollout = checked_rollout(ap, args)  # before the model loads: a bad flag is one line, not a traceback
    folder = str(embedded_checkpoint(MODEL))  # the packaged GGUF, converted once, offline

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = checked_prompts(ap, args, tokenizer)
    require_extra(ap)
    train(args, rollout, folder, tokenizer, passkey_dataset(rows))


def train(args: argparse.Namespace, rollout: SparseRollout, folder: str, tokenizer, data: Dataset) -> None:
    """The model loaded and TRL's GRPO steps with Sparrow's sampler; each logged step printed."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    n = args.prompts_per_step * args.samples
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-sparse-"), max_steps=args.steps, seed=args.seed,
        per_device_train_batch_size=n, num_generations=args.samples,
        max_completion_length=args.max_new_tokens, learning_rate=1e-4, beta=0.0,
        vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.5,
        vllm_importance_sampling_clip_max=2.0, use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(TARGET_MODULES),
                      task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=rollout.with_metrics(passkey_reward), args=config,
                          train_dataset=data, processing_class=tokenizer, peft_config=lora,
                          rollout_func=rollout)
    trainer.train()
    for row in trainer.state.log_history:
        if "sparrow/alpha_lb_p5" in row:
            print(f"step {row['step']}: reward {row['reward']:.3f}, "
                  f"alpha_lb_p5 {row['sparrow/alpha_lb_p5']:.3f}, "
                  f"masked {row['sparrow/masked_fraction']:.3f}, "
                  f"mean budget {row['sparrow/mean_budget']:.0f}")


if __name__ == "__main__":
    main()
