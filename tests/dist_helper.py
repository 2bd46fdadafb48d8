"""Run by the distributed tests in real processes (torchrun, Ray workers): a test task with graded rewards
and the entry points those processes start from.

    python tests/dist_helper.py grad MODEL PROMPTS RUN OUT.pt   # one step's gradient, under torchrun
    python tests/dist_helper.py cli ARGS...                     # `sparrow ARGS` with the test task known
"""

from __future__ import annotations

import os
import sys

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


def step_gradient(model: str, prompts: str, run: str, world=None) -> dict:
    """The LoRA gradient of step 0 of a fresh run (rollout, recompute, correction, loss), and its stats."""
    from sparrow.stages.model.loading import load_model
    from sparrow.stages.train import TrainConfig, Trainer, load_prompts

    loaded = load_model(model)
    rows = load_prompts(prompts, loaded.tokenizer)
    trainer = Trainer(TrainConfig(model=model, **GRAD_CONFIG), loaded, rows, run, world=world)
    exp = trainer.experience(0)
    trainer.model.train()
    stats = trainer._gradients(exp["flat"], exp["advantages"], exp["old"], exp["correction"])
    grads = {k: p.grad.detach().clone() for k, p in trainer.model.named_parameters() if p.requires_grad}
    return {"grads": grads, "stats": stats, "tokens": [c.token_ids for c in exp["flat"]],
            "rewards": exp["rewards"].tolist()}


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
