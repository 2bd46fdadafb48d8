"""`sparrow train` under torchrun (gloo, 2 real processes) against the single process on the same batch.

The torchrun tests are slow (real processes, each importing torch and loading the model): run them with
`.venv/bin/python -m pytest -q -m slow tests/test_distributed.py`."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from sparrow.schemas import read_artifact, write_artifact
from sparrow.stages.model.loading import embedded_checkpoint, load_model
from sparrow.stages.tasks import TASKS
from sparrow.stages.train.distributed import World

sys.path.insert(0, str(Path(__file__).parent))
from dist_helper import register_vowels, step_gradient  # noqa: E402

HELPER = Path(__file__).parent / "dist_helper.py"
TIMING = {"run_id", "seconds", "rollout_seconds", "scoring_seconds", "update_seconds", "tokens_per_second"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and a prompts file of the graded `vowels` task."""
    register_vowels()
    tok = transformers.AutoTokenizer.from_pretrained(embedded_checkpoint())
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    rows = []
    for i in range(6):
        text = f"Write the number {i * 37}. " * 12  # about 100 tokens: budget 48 is sparse here
        rows.append({"prompt_id": f"vowels-{i}", "task": "vowels", "prompt": text,
                     "prompt_token_ids": tok(text).input_ids, "answer": str(i * 37), "metadata": None})
    prompts = write_artifact(rows, path / "prompts.parquet", "prompts")
    yield str(path), str(prompts)
    TASKS.pop("vowels", None)


def torchrun(n: int, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           str(HELPER), *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_shards_cover_every_item_once():
    for n in range(0, 9):
        for size in (1, 2, 3, 4):
            parts = [list(range(n))[World(r, size).shard(n)] for r in range(size)]
            assert sum(parts, []) == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.slow  # two torchrun launches of 2 processes each: about a minute on 2 shared cores
def test_ddp_gradient_equals_the_single_process_gradient(tiny, tmp_path):
    """3 prompts x 3 samples over 2 ranks (2 + 1 prompts to roll out, 5 + 4 sequences to score and
    differentiate in micro-batches of 2): the summed gradient is the single process's within 1e-6."""
    model, prompts = tiny
    torchrun(2, "grad", model, prompts, str(tmp_path / "run2"), str(tmp_path / "g.pt"))
    two = torch.load(tmp_path / "g.pt", weights_only=False)
    one = step_gradient(model, prompts, str(tmp_path / "run1"))
    assert two["world"] == 2
    assert two["tokens"] == one["tokens"] and two["rewards"] == one["rewards"]
    assert len(set(map(tuple, one["rewards"]))) > 1  # graded rewards: non-zero advantages
    assert one["grads"].keys() == two["grads"].keys() and one["grads"]
    assert max(float(g.abs().max()) for g in one["grads"].values()) > 1e-4
    for k, g in one["grads"].items():
        assert float((two["grads"][k] - g).abs().max()) < 1e-6, k
    for k, v in one["stats"].items():
        assert math.isclose(two["stats"][k], v, rel_tol=1e-5, abs_tol=1e-7), k


def _metrics(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING}
            for r in read_artifact(run / "metrics.parquet", "metrics").to_pylist()]


def _assert_same_run(a: Path, b: Path) -> None:
    """The same steps, rewards and sampled tokens; float metrics and weights up to summation order."""
    ma, mb = _metrics(a), _metrics(b)
    assert [r["step"] for r in ma] == [r["step"] for r in mb]
    for ra, rb in zip(ma, mb):
        for k, v in ra.items():
            if isinstance(v, float) and not (k == "reward_mean" or k == "accuracy"):
                assert math.isclose(rb[k], v, rel_tol=1e-4, abs_tol=1e-6), (ra["step"], k, v, rb[k])
            else:
                assert rb[k] == v, (ra["step"], k)
    wa = torch.load(a / "checkpoint" / "state.pt", weights_only=False)["weights"]
    wb = torch.load(b / "checkpoint" / "state.pt", weights_only=False)["weights"]
    assert wa.keys() == wb.keys()
    for k in wa:
        assert float((wa[k] - wb[k]).abs().max()) < 1e-5, k


@pytest.mark.slow  # 2 torchrun launches and 4 single-process runs: about 3 minutes on 2 shared cores
def test_checkpoints_resume_under_another_world_size(tiny, tmp_path):
    from sparrow.cli.app import app

    model, prompts = tiny
    args = ["train", "--model", model, "--prompts", prompts, "--prompts-per-step", "2", "--samples", "2",
            "--max-new-tokens", "6", "--lora-rank", "2", "--lr", "5e-2", "--budget", "48",
            "--checkpoint-every", "1"]
    cli = CliRunner()
    # the reference: one process, 2 steps, then resumed to 3 (bit-exact, test_train.py)
    r = cli.invoke(app, [*args, "--steps", "2", "-o", str(tmp_path / "one")])
    assert r.exit_code == 0, r.output
    shutil.copytree(tmp_path / "one", tmp_path / "one-then-two")
    r = cli.invoke(app, [*args, "--steps", "3", "--resume", "-o", str(tmp_path / "one")])
    assert r.exit_code == 0, r.output
    # 2 ranks for 2 steps, resumed by one process
    torchrun(2, "cli", *args, "--steps", "2", "-o", str(tmp_path / "two-then-one"))
    assert len(_metrics(tmp_path / "two-then-one")) == 2
    r = cli.invoke(app, [*args, "--steps", "3", "--resume", "-o", str(tmp_path / "two-then-one")])
    assert r.exit_code == 0, r.output
    _assert_same_run(tmp_path / "one", tmp_path / "two-then-one")
    # one process for 2 steps, resumed by 2 ranks
    torchrun(2, "cli", *args, "--steps", "3", "--resume", "-o", str(tmp_path / "one-then-two"))
    _assert_same_run(tmp_path / "one", tmp_path / "one-then-two")
    assert (tmp_path / "one-then-two" / "adapter" / "adapter_config.json").exists()
    steps = sorted(p.name for p in (tmp_path / "one-then-two" / "mismatch").iterdir())
    assert steps == ["step=00000.parquet", "step=00001.parquet", "step=00002.parquet"]


def test_a_batch_smaller_than_the_world_is_refused(tiny, tmp_path):
    from sparrow.stages.train import TrainConfig, Trainer, load_prompts

    model, prompts = tiny
    loaded = load_model(model)
    cfg = TrainConfig(model=model, prompts_per_step=1, samples=2)
    with pytest.raises(ValueError, match=r"must be at least the world size \(4\)"):
        Trainer(cfg, loaded, load_prompts(prompts, loaded.tokenizer), tmp_path / "run", world=World(0, 4))
