"""Rollout modes that do not combine are refused in one sentence before any work, naming the run or the
flags: a `train --speculate` run given to calibrate-threshold (its samples are the dense policy's, so its
stability says nothing about its sparsity's tail), a sparse actor (sparrow distill's, trained for block
top-k) under eviction on rollout and profile, and `train --speculate` with `--oversample` (every
speculative sample is dense, so the selection by sparse acceptance has nothing to rank). `sparrow report`
captions an eviction profile's tail by how eviction is planned: one KV budget, never one per bin."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import write_artifact
from sparrow.stages.model.adapter import add_lora, save_adapter
from sparrow.stages.model.loading import load_model

from cli_checks import error_line, passed_the_checks

runner = CliRunner()
MODEL = "tiny-llama"


def token_prompts(path: Path, lengths: list[int]) -> Path:
    rows = [{"prompt_id": f"p{i}", "task": "basic_arithmetic", "prompt": None,
             "prompt_token_ids": list(range(5, 5 + n)), "answer": "3", "metadata": None}
            for i, n in enumerate(lengths)]
    return write_artifact(rows, path, "prompts")


@pytest.fixture(scope="module")
def actor(tmp_path_factory) -> Path:
    """A sparse actor's adapter of tiny-llama: a peft LoRA with the sparrow_distill.json distill writes."""
    torch.manual_seed(0)
    loaded = load_model(MODEL)
    out = save_adapter(loaded.model, add_lora(loaded.model, 2, 4.0), tmp_path_factory.mktemp("actor") / "a",
                       MODEL)
    (out / "sparrow_distill.json").write_text("{}")
    return out


# ---------------------------------------------------------------- calibrate-threshold and --speculate


def _mismatch(path: Path) -> Path:
    rng = np.random.default_rng(0)
    n, rows = 200, []
    for budget in (64, 128):
        alpha = np.clip(1 - rng.exponential(0.05, n) * 64 / budget, 0, 1)
        rows += [{"prompt_id": f"p{i % 5}", "sample": 0, "position": 10 + i, "bin": 0, "budget": budget,
                  "token_id": 1, "alpha": float(a), "logp_dense": -1.0, "logp_sparse": -1.0,
                  "log_ratio": 0.0, "k1": 0.0, "k2": 0.0, "k3": 0.0, "entropy_dense": 1.0}
                 for i, a in enumerate(alpha)]
    return write_artifact(rows, path, "mismatch", metadata={"bin_width": 512})


def _run(tmp_path: Path, name: str, speculate: int) -> Path:
    run = tmp_path / name
    config = {"model": "m", "seed": 0, "sparsity": "budget:64", "correction": "none", "steps": 8,
              "speculate": speculate}
    steps = np.arange(8)
    write_artifact({"run_id": ["r"] * 8, "step": steps, "reward_mean": 0.2 + 0.01 * steps,
                    "grad_norm": np.ones(8), "mismatch_kl": np.zeros(8), "entropy": np.ones(8)},
                   run / "metrics.parquet", "metrics", metadata={"config": json.dumps(config)})
    write_artifact({"bin": [0], "bin_start": [0], "bin_end": [None], "budget": [64], "tail": [None],
                    "predicted_step_seconds": [None]}, run / "schedule.parquet", "schedule")
    return run


def test_calibrate_threshold_refuses_a_speculative_run(tmp_path):
    profile = _mismatch(tmp_path / "prof.parquet")
    plain, spec = _run(tmp_path, "plain", 0), _run(tmp_path, "spec", 2)
    out = tmp_path / "thr.parquet"
    line = error_line(runner.invoke(app, ["calibrate-threshold", "--profile", str(profile), "--runs",
                                          str(plain), "--runs", str(spec), "-o", str(out)]))
    assert f"{spec}: the run rolled out with --speculate 2" in line
    assert "which speculative runs do not inform" in line and not out.exists()
    kept = runner.invoke(app, ["calibrate-threshold", "--profile", str(profile), "--runs", str(plain),
                               "-o", str(out)])
    assert kept.exit_code == 0, kept.output


# ---------------------------------------------------------------- a sparse actor under eviction


def test_rollout_refuses_a_sparse_actor_under_kv_compression(tmp_path, actor, no_work):
    prompts, out = token_prompts(tmp_path / "p.parquet", [60]), tmp_path / "r.parquet"
    args = ["rollout", "--model", MODEL, "--prompts", str(prompts), "--max-new-tokens", "4", "-o", str(out)]
    line = error_line(runner.invoke(app, [*args, "--kv-compression", "snapkv", "--kv-budget", "64",
                                          "--adapter", str(actor)]))
    assert f"--adapter {actor} is a sparse actor" in line and "not for --kv-compression's eviction" in line
    assert not out.exists()
    assert passed_the_checks(runner.invoke(app, [*args, "--budget", "48", "--adapter", str(actor)]))


@pytest.mark.parametrize("flags,said", [
    (["--kv-compression", "snapkv", "--budgets", "64"], "not for --kv-compression's eviction"),
    (["--budgets", "48", "--sampler", "snapkv:64"], "not for the eviction of --sampler snapkv:64"),
], ids=["kv-compression", "eviction-sampler"])
def test_profile_refuses_a_sparse_actor_under_eviction(tmp_path, actor, no_work, flags, said):
    prompts, out = token_prompts(tmp_path / "p.parquet", [60]), tmp_path / "m.parquet"
    args = ["profile", "--model", MODEL, "--prompts", str(prompts), "--samples", "1", "--max-new-tokens", "4",
            "-o", str(out)]
    line = error_line(runner.invoke(app, [*args, *flags, "--adapter", str(actor)]))
    assert f"--adapter {actor} is a sparse actor" in line and said in line and not out.exists()
    assert passed_the_checks(runner.invoke(app, [*args, "--budgets", "48", "--adapter", str(actor)]))


# ---------------------------------------------------------------- train --speculate --oversample


def test_train_refuses_speculate_with_oversample(tmp_path, no_work):
    prompts, run = token_prompts(tmp_path / "p.parquet", [40, 40]), tmp_path / "run"
    args = ["train", "--model", MODEL, "--prompts", str(prompts), "--steps", "1", "--prompts-per-step", "1",
            "--samples", "2", "--max-new-tokens", "8", "--budget", "48", "--speculate", "2",
            "--correction", "none", "-o", str(run)]
    line = error_line(runner.invoke(app, [*args, "--oversample", "4"]))
    assert "--oversample" in line and "drop one of --speculate and --oversample" in line
    assert not run.exists()


# ---------------------------------------------------------------- report: an eviction profile's caption


def _profile(path: Path, **meta) -> Path:
    rows = [{"prompt_id": "p", "sample": 0, "position": 100 + k, "bin": 0, "budget": b, "token_id": 1,
             "alpha": 0.9, "logp_dense": -1.0, "logp_sparse": -1.0, "log_ratio": 0.0, "k1": 0.0, "k2": 0.0,
             "k3": 0.0, "entropy_dense": 1.0} for b in (64, 128) for k in range(60)]
    return write_artifact(rows, path, "mismatch", metadata={"bin_width": 512, **meta})


def _caption(page: str, figure: str) -> str:
    return " ".join(re.search(rf"<figure id='{re.escape(figure)}'>.*?<figcaption>(.*?)</figcaption>", page,
                              re.S)[1].split())


@pytest.mark.parametrize("evicting", [False, True], ids=["block-topk", "snapkv"])
def test_report_captions_an_eviction_profile_as_one_kv_budget(tmp_path, evicting):
    run = tmp_path / "run"
    _profile(run / "mismatch.parquet", **({"kv_compression": "snapkv"} if evicting else {}))
    result = runner.invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    caption = _caption((run / "report" / "index.html").read_text(), "tail.png")
    per_bin = "a budget whose tail stays above it in a bin may be scheduled there"
    assert (per_bin in caption) != evicting
    if evicting:
        assert "snapkv keeps one KV budget for the whole sequence" in caption
        assert "never one budget per bin" in caption
