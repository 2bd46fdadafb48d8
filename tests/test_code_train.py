"""The trainer scores a step's samples through the pool of sandboxes and logs `reward_seconds`.

A test task whose reward runs, in the real sandbox, a program built from the sample (`f` returns the
sample's length mod 2, and the test wants 1): the trainer's rewards must equal that rule applied here to
the decoded samples, and `metrics.parquet` must hold the step's reward seconds.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_train import tiny_llama  # noqa: F401 - a fixture

from sparrow.schemas import read_artifact, write_artifact
from sparrow.stages.model.loading import load_model
from sparrow.stages.tasks import TASKS, Task
from sparrow.stages.tasks import sandbox as sb
from sparrow.stages.tasks.code import default_sandbox, run_tests
from sparrow.stages.train import TrainConfig, Trainer, load_prompts

pytestmark = pytest.mark.skipif(sb.sandbox_problem(sb.bwrap_binary()) is not None, reason="no sandbox here")


def _parity_score(completion: str, answer: str, metadata) -> float:
    program = f"def f():\n    return {len(completion) % 2}\n"
    return run_tests(program, "f", [[]], [1], default_sandbox(), format_weight=0.0).reward


PARITY = Task("parity", "code", "test task: odd-length samples", lambda *a, **k: iter(()), _parity_score,
              runs_code=True)


def test_trainer_rewards_come_from_the_sandbox_pool(tmp_path, monkeypatch, tiny_llama):  # noqa: F811
    monkeypatch.setitem(TASKS, "parity", PARITY)
    monkeypatch.setenv("SPARROW_REWARD_WORKERS", "3")
    loaded = load_model(tiny_llama[0])
    tok = loaded.tokenizer
    rows = [{"prompt_id": f"p-{i}", "task": "parity", "prompt": f"Say something {i}.",
             "prompt_token_ids": tok(f"Say something {i}.").input_ids, "answer": "1", "metadata": None}
            for i in range(4)]
    prompts = write_artifact(rows, tmp_path / "prompts.parquet", "prompts")
    cfg = TrainConfig(model=tiny_llama[0], steps=1, prompts_per_step=2, samples=3, max_new_tokens=7,
                      lora_rank=4, micro_batch=4, checkpoint_every=1, eval_every=1)
    trainer = Trainer(cfg, loaded, load_prompts(prompts, tok), tmp_path / "run")
    exp = trainer.experience(0)
    texts = [tok.decode(c.token_ids, skip_special_tokens=True) for c in exp.completions]
    expected = np.array([len(t) % 2 for t in texts], dtype=float).reshape(2, 3)
    assert np.array_equal(exp.rewards, expected)
    assert exp.reward_seconds > 0

    trainer = Trainer(cfg, load_model(tiny_llama[0]), load_prompts(prompts, tok), tmp_path / "run2")
    trainer.run()
    metrics = read_artifact(tmp_path / "run2" / "metrics.parquet", "metrics").to_pylist()
    assert len(metrics) == 1 and metrics[0]["reward_seconds"] > 0
