"""Run by the distributed tests in real processes (torchrun, Ray workers): a test task with graded rewards
and the entry points those processes start from.

    python tests/dist_helper.py grad MODEL PROMPTS RUN OUT.pt   # one step's gradient, under torchrun
    python tests/dist_helper.py cli ARGS...                     # `sparrow ARGS` with the test task known
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

GRAD_CONFIG = dict(steps=1, prompts_per_step=3, samples=3, max_new_tokens=8, lora_rank=4, lr=5e-2,
                   micro_batch=2, sparsity="budget:48", correction="tis", seed=3)


def _vowels_score(completion: str, answer: str, metadata) -> float:
    """Share of the completion's letters that are vowels: graded, so random text has variance."""
    letters = [ch for ch in completion.lower() if ch.isalpha()]
    return sum(ch in "aeiou" for ch in letters) / max(len(letters), 1)


def register_vowels() -> None:
    from sparrow.stages.tasks import TASKS
    from sparrow.stages.tasks.base import Task

    TASKS["vowels"] = Task("vowels", "math", "test task: use vowels", lambda *a, **k: iter(()), _vowels_score)


def make_tiny(path) -> tuple[str, str]:
    """A tiny random Llama with SmolLM2's tokenizer in `path`, and a prompts file of the `vowels` task."""
    import torch
    import transformers

    from sparrow.schemas import write_artifact
    from sparrow.stages.model.loading import embedded_checkpoint

    tok = transformers.AutoTokenizer.from_pretrained(embedded_checkpoint())
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    rows = []
    for i in range(6):
        text = f"Write the number {i * 37}. " * 12  # about 100 tokens: budget 48 is sparse here
        rows.append({"prompt_id": f"vowels-{i}", "task": "vowels", "prompt": text,
                     "prompt_token_ids": tok(text).input_ids, "answer": str(i * 37), "metadata": None})
    return str(path), str(write_artifact(rows, f"{path}/prompts.parquet", "prompts"))


def step_gradient(model: str, prompts: str, run: str, world=None) -> dict:
    """The LoRA gradient of step 0 of a fresh run (rollout, recompute, correction, loss), and its stats."""
    from sparrow.stages.model.loading import load_model
    from sparrow.stages.train import RunOptions, TrainConfig, Trainer, load_prompts

    loaded = load_model(model)
    rows = load_prompts(prompts, loaded.tokenizer)
    trainer = Trainer(TrainConfig(model=model, **GRAD_CONFIG), loaded, rows, run,
                      options=RunOptions(world=world))
    exp = trainer.experience(0)
    trainer.model.train()
    stats = trainer.learner.gradients(exp)
    grads = {k: p.grad.detach().clone() for k, p in trainer.model.named_parameters() if p.requires_grad}
    return {"grads": grads, "stats": stats, "tokens": [c.token_ids for c in exp.completions],
            "rewards": exp.rewards.tolist()}


TIMING = {"run_id", "seconds", "rollout_seconds", "scoring_seconds", "update_seconds", "tokens_per_second",
          "weight_sync_seconds", "reward_seconds"}


def metrics_without_timing(run: Path) -> list[dict]:
    from sparrow.schemas import read_artifact

    return [{k: v for k, v in r.items() if k not in TIMING}
            for r in read_artifact(run / "metrics.parquet", "metrics").to_pylist()]


def assert_same_run(a: Path, b: Path) -> None:
    """The same steps, rewards and sampled tokens; float metrics and weights up to summation order."""
    ma, mb = metrics_without_timing(a), metrics_without_timing(b)
    assert [r["step"] for r in ma] == [r["step"] for r in mb]
    for ra, rb in zip(ma, mb):
        for k, v in ra.items():
            if isinstance(v, float) and not (k == "reward_mean" or k == "accuracy"):
                assert math.isclose(rb[k], v, rel_tol=1e-4, abs_tol=1e-6), (ra["step"], k, v, rb[k])
            elif isinstance(v, list) and v and all(isinstance(x, float) for x in v):  # per-bin float metrics
                assert len(rb[k]) == len(v) and all(
                    math.isclose(y, x, rel_tol=1e-4, abs_tol=1e-6) for x, y in zip(v, rb[k])), (ra["step"], k)
            else:
                assert rb[k] == v, (ra["step"], k)
    import torch

    wa = torch.load(a / "checkpoint" / "state.pt", weights_only=False)["weights"]
    wb = torch.load(b / "checkpoint" / "state.pt", weights_only=False)["weights"]
    assert wa.keys() == wb.keys()
    for k in wa:  # Adam divides by a gradient's own scale, so a tiny one's summation order shows
        assert float((wa[k] - wb[k]).abs().max()) < 1e-4, (k, float((wa[k] - wb[k]).abs().max()))


def main(argv: list[str]) -> None:
    register_vowels()
    if argv[0] == "grad":
        import torch

        from sparrow.stages.train.distributed import init_world, shutdown_world

        world = init_world()
        out = step_gradient(*argv[1:4], world=world)
        if world.main:
            torch.save({**out, "world": world.size}, argv[4])
        shutdown_world()
    elif argv[0] == "cli":
        from sparrow.cli.app import app

        app(argv[1:])
    else:
        raise SystemExit(f"unknown mode {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
