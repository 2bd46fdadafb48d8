"""`sparrow train` under torchrun (gloo, 2 real processes) against the single process on the same batch.

The torchrun tests start real processes; the DDP gradient test runs with `make test`, the resume across
world sizes (about 3 minutes) with `make test-slow`."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sparrow.stages.model.loading import load_model
from sparrow.stages.tasks import TASKS
from sparrow.stages.train.distributed import World

sys.path.insert(0, str(Path(__file__).parent))
from dist_helper import (  # noqa: E402, I001
    assert_same_run, make_tiny, metrics_without_timing, register_vowels, step_gradient)

HELPER = Path(__file__).parent / "dist_helper.py"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and a prompts file of the graded `vowels` task."""
    register_vowels()
    yield make_tiny(tmp_path_factory.mktemp("tiny-llama"))
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


# not slow: the one test of torch.distributed that CI runs (two torchrun launches of 2 processes each)
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
    assert len(metrics_without_timing(tmp_path / "two-then-one")) == 2
    r = cli.invoke(app, [*args, "--steps", "3", "--resume", "-o", str(tmp_path / "two-then-one")])
    assert r.exit_code == 0, r.output
    assert_same_run(tmp_path / "one", tmp_path / "two-then-one")
    # one process for 2 steps, resumed by 2 ranks
    torchrun(2, "cli", *args, "--steps", "3", "--resume", "-o", str(tmp_path / "one-then-two"))
    assert_same_run(tmp_path / "one", tmp_path / "one-then-two")
    assert (tmp_path / "one-then-two" / "adapter" / "adapter_config.json").exists()
    steps = sorted(p.name for p in (tmp_path / "one-then-two" / "mismatch").iterdir())
    assert steps == ["step=00001.parquet", "step=00002.parquet", "step=00003.parquet"]  # steps count from 1


def test_a_batch_smaller_than_the_world_is_refused(tiny, tmp_path):
    from sparrow.stages.train import RunOptions, TrainConfig, Trainer, load_prompts

    model, prompts = tiny
    loaded = load_model(model)
    cfg = TrainConfig(model=model, prompts_per_step=1, samples=2)
    with pytest.raises(ValueError, match=r"must be at least the world size \(4\)"):
        Trainer(cfg, loaded, load_prompts(prompts, loaded.tokenizer), tmp_path / "run",
                options=RunOptions(world=World(0, 4)))
