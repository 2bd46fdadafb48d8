"""KV compression on the command line (issue 28): rollout, profile, train and plan-schedule as a user runs
them. Bad input is one sentence and a non-zero exit before any weights load (load_model fails the test
if called); a compressed rollout records its policy and retained lengths and reports the KV tokens it
held against dense; profiling its own rollouts with the same policy gives back the logprobs it sampled
with (the replay invariant through the CLI); a GRPO run with --kv-compression logs its tokens at the KV
budget and writes no block top-k schedule, which calibrate-threshold refuses; plan-schedule plans an
eviction profile as one KV budget, the cheapest whose tail holds in every bin."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact, write_artifact

from cli_checks import error_line
from tiny_models import tiny_chat_llama

runner = CliRunner()


def _prompts(path: Path, n: int = 2, length: int = 30) -> Path:
    rng = np.random.default_rng(0)
    rows = [{"prompt_id": f"p{i}", "task": "basic_arithmetic", "prompt": None,
             "prompt_token_ids": rng.integers(3, 500, length).tolist(), "answer": "5", "metadata": None}
            for i in range(n)]
    return write_artifact(rows, path, "prompts")


ROLLOUT_REFUSALS = [
    (["--kv-compression", "h2o", "--kv-budget", "64"],
     "--kv-compression must be one of snapkv, rkv, got 'h2o'"),
    (["--kv-compression", "snapkv"],
     "--kv-compression snapkv needs --kv-budget (the tokens a compressed cache keeps)"),
    (["--kv-compression", "snapkv", "--kv-budget", "12"],
     "--kv-compression snapkv --kv-budget 12: the budget must exceed the sink plus the window (4 + 8 = 12 "
     "tokens), which are always kept, so that the rule keeps some tokens by score"),
    (["--kv-compression", "rkv", "--kv-budget", "2000"],
     "--kv-compression rkv --kv-budget 2000: budget + buffer (2000 + 128 = 2128 tokens) exceeds the model's "
     "context of 2048, so its cache would never be compressed"),
    (["--kv-compression", "rkv", "--kv-budget", "64", "--budget", "64"],
     "--kv-compression and --budget were given together: eviction and block top-k selection do not "
     "combine; pick one"),
    (["--kv-budget", "64"], "--kv-budget applies only with --kv-compression snapkv or rkv"),
    (["--kv-compression", "snapkv", "--kv-budget", "20", "--kv-window", "0"],
     "the window and the buffer must be at least 1"),
]


@pytest.mark.parametrize("args,message", ROLLOUT_REFUSALS)
@pytest.mark.parametrize("command", ["rollout", "train"])
def test_bad_compression_flags_are_one_sentence_before_any_weights(tmp_path, no_work, command, args, message):
    prompts = _prompts(tmp_path / "p.parquet")
    out = tmp_path / "out"
    r = runner.invoke(app, [command, "--model", "tiny-llama", "--prompts", str(prompts), *args, "-o",
                            str(out)])
    assert message in error_line(r)
    assert not out.exists()


@pytest.mark.parametrize("args,message", [
    (["--kv-compression", "snapkv", "--budgets", "10"],
     "--budgets 10 under --kv-compression snapkv: the budget must exceed the sink plus the window"),
    (["--kv-compression", "rkv", "--budgets", "64,1990"],
     "--budgets 1990 under --kv-compression rkv for tiny-llama: budget + buffer (1990 + 128 = 2118 tokens) "
     "exceeds the model's context of 2048"),
    (["--sampler", "rkv:12"], "--sampler rkv:12: the budget must exceed the sink plus the window"),
    (["--kv-window", "4"], "--kv-window applies only with --kv-compression snapkv or rkv"),
    (["--kv-compression", "lru"], "--kv-compression must be one of snapkv, rkv, got 'lru'"),
])
def test_profile_refuses_bad_compression_flags_before_any_weights(tmp_path, no_work, args, message):
    prompts = _prompts(tmp_path / "p.parquet")
    out = tmp_path / "m.parquet"
    r = runner.invoke(app, ["profile", "--model", "tiny-llama", "--prompts", str(prompts), *args, "-o",
                            str(out)])
    assert message in error_line(r)
    assert not out.exists()


def _eviction_profile(path: Path, policy: str = "snapkv", seed: int = 0) -> tuple[Path, dict]:
    """A mismatch profile of three KV budgets over three 100-token bins with alpha drawn so that the
    budgets' tails differ -> (path, {budget: (alpha, position)})."""
    rng = np.random.default_rng(seed)
    rows, data = [], {}
    for budget, scale in ((64, 0.3), (128, 0.08), (256, 0.02)):
        pos = rng.integers(40, 340, 900)
        alpha = np.clip(1 - rng.exponential(scale * (1 + pos / 300)), 0, 1).astype(np.float32)  # as stored
        data[budget] = (alpha, pos)
        rows += [{"prompt_id": "p", "sample": 0, "position": int(p), "bin": int(p // 100), "budget": budget,
                  "token_id": 1, "alpha": float(a), "logp_dense": -1.0, "logp_sparse": -1.0, "log_ratio": 0.0,
                  "k1": 0.0, "k2": 0.0, "k3": 0.0, "entropy_dense": 1.0} for p, a in zip(pos, alpha)]
    specs = [f"{policy}:{b},window=8,buffer=32,sink=4" for b in data]
    meta = {"bin_width": 100, "model": "tiny-llama", "kv_compression": policy,
            "budgets": json.dumps(list(data)), "kv_policies": json.dumps(specs)}
    write_artifact(rows, path, "mismatch", metadata=meta)
    return path, data


def test_plan_schedule_plans_the_cheapest_eviction_budget_whose_tail_holds(tmp_path):
    """From an eviction profile the plan is one KV budget: the smallest profiled one whose 5th percentile
    of alpha holds in every 100-token bin, against numpy's percentile per bin (a brute force of the rule),
    printed as the flags rollout and train take."""
    profile, data = _eviction_profile(tmp_path / "m.parquet")
    tails = {b: min(np.percentile(a[pos // 100 == k].astype(np.float64), 5) for k in np.unique(pos // 100))
             for b, (a, pos) in data.items()}
    threshold = (tails[128] + tails[64]) / 2  # 64 fails, 128 holds
    assert tails[64] < threshold <= tails[128] <= tails[256]
    for extra in ([], ["--kv-compression", "snapkv"]):
        r = runner.invoke(app, ["plan-schedule", "--model", "tiny-llama", "--profile", str(profile),
                                "--threshold", str(threshold), "--format", "json", *extra])
        assert r.exit_code == 0, r.output
        doc = json.loads(r.stdout)
        table = {row["kv_budget"]: row for row in doc["budgets"]}
        assert doc["kv_budget"] == 128 and doc["flags"].startswith("--kv-compression snapkv --kv-budget 128")
        for b in data:
            assert abs(table[b]["tail"] - tails[b]) < 1e-9 and table[b]["holds"] == (tails[b] >= threshold)
        assert "plan: --kv-compression snapkv --kv-budget 128 --kv-window 8 --kv-buffer 32" in r.stderr
    r = runner.invoke(app, ["plan-schedule", "--model", "tiny-llama", "--profile", str(profile),
                            "--threshold", str(tails[256] + 0.01)])
    assert r.exit_code == 0 and "no profiled snapkv budget keeps the tail" in r.output


def test_a_kv_budget_that_never_evicted_is_not_planned(tmp_path):
    """One 20-token trajectory after a 40-token prompt: snapkv:16 (window 8, buffer 32) first compresses
    after 8 fed tokens, snapkv:256 never (its cache would need 288 tokens), so its alpha of 1 is the dense
    cache's and it must not be the plan even though its tail is the best."""
    path = tmp_path / "m.parquet"
    rows = [{"prompt_id": "p", "sample": 0, "position": pos, "bin": pos // 100, "budget": budget,
             "token_id": 1, "alpha": 0.2 if budget == 16 else 1.0, "logp_dense": -1.0, "logp_sparse": -1.0,
             "log_ratio": 0.0, "k1": 0.0, "k2": 0.0, "k3": 0.0, "entropy_dense": 1.0}
            for budget in (16, 256) for pos in range(40, 60)]
    specs = [f"snapkv:{b},window=8,buffer=32,sink=4" for b in (16, 256)]
    write_artifact(rows, path, "mismatch", metadata={
        "bin_width": 100, "model": "tiny-llama", "kv_compression": "snapkv", "budgets": json.dumps([16, 256]),
        "kv_policies": json.dumps(specs)})
    r = runner.invoke(app, ["plan-schedule", "--model", "tiny-llama", "--profile", str(path), "--threshold",
                            "0.5", "--min-tokens", "1", "--format", "json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    table = {row["kv_budget"]: row for row in doc["budgets"]}
    assert doc["kv_budget"] is None and table[256]["holds"] and not table[256]["evicted"]
    assert table[16]["evicted"] and not table[16]["holds"]
    assert "KV budget 256 never compressed a profiled sequence" in r.stderr


@pytest.mark.parametrize("args, message", [
    (["-o", "plan.parquet"], "-o does not apply to an eviction plan"),
    (["--gen-len", "4096"], "--gen-len does not apply to an eviction plan"),
    (["--batch", "8"], "--max-num-seqs does not apply to an eviction plan"),
    (["--kv-compression", "rkv"], "--kv-compression rkv: --profile"),
    (["--kv-compression", "h2o"], "--kv-compression must be one of"),
])
def test_plan_schedule_refuses_what_an_eviction_plan_cannot_do(tmp_path, args, message):
    profile, _ = _eviction_profile(tmp_path / "m.parquet")
    line = error_line(runner.invoke(app, ["plan-schedule", "--model", "tiny-llama", "--profile", str(profile),
                                          *args]))
    assert message in line and not (tmp_path / "plan.parquet").exists()
    line = error_line(runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", "--kv-compression",
                                          "snapkv"]))
    assert "plans from a --profile measured with `sparrow profile --kv-compression snapkv" in line


def test_compressed_rollouts_profile_back_to_their_own_logprobs(tmp_path):
    """rollout --kv-compression writes kv_policy and kv_lens and reports KV tokens held against dense;
    profile --rollouts with the same policy scores every token by replaying the eviction: at the
    sampler's own budget it gives back the sampled logprobs; plan-schedule plans a KV budget from it."""
    prompts = _prompts(tmp_path / "p.parquet")
    rollouts = tmp_path / "r.parquet"
    kv = ["--kv-window", "4", "--kv-buffer", "8"]
    r = runner.invoke(app, ["rollout", "--model", "tiny-llama", "--prompts", str(prompts), "--samples", "2",
                            "--max-new-tokens", "40", "--ignore-eos", "--kv-compression", "snapkv",
                            "--kv-budget", "20", *kv, "-o", str(rollouts), "--format", "json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["kv_policy"] == "snapkv:20,window=4,buffer=8,sink=4"
    assert summary["compactions"] > 0 and 0 < summary["kv_saved"] < 1
    assert summary["kv_tokens_peak"] == 4 * 31 < summary["dense_kv_tokens_peak"]  # the first step: prompt + 1
    table = read_artifact(rollouts, "rollouts").to_pylist()
    for row in table:
        assert row["kv_policy"] == summary["kv_policy"] and max(row["kv_lens"]) == 30 + 1  # the prompt + 1
        assert row["kv_lens"][-1] <= 28 and row["budgets"][1:] == [20] * 39
    mismatch = tmp_path / "m.parquet"
    r = runner.invoke(app, ["profile", "--model", "tiny-llama", "--rollouts", str(rollouts),
                            "--kv-compression", "snapkv", *kv, "--budgets", "20,24", "--bin-width", "16",
                            "-o", str(mismatch)])
    assert r.exit_code == 0, r.output
    scored = read_artifact(mismatch, "mismatch")
    meta = artifact_metadata(mismatch)
    assert meta["kv_compression"] == "snapkv" and meta["sampler"] == summary["kv_policy"]
    assert json.loads(meta["kv_policies"]) == ["snapkv:20,window=4,buffer=8,sink=4",
                                               "snapkv:24,window=4,buffer=8,sink=4"]
    own = scored.filter(np.asarray(scored.column("budget")) == 20)
    sampled = np.concatenate([row["logprobs"] for row in table])
    assert np.abs(np.asarray(own.column("logp_sparse")) - sampled).max() <= 1e-4
    r = runner.invoke(app, ["plan-schedule", "--model", "tiny-llama", "--profile", str(mismatch),
                            "--bin-width", "16", "--min-tokens", "1", "--format", "json"])
    assert r.exit_code == 0, r.output
    assert {row["kv_budget"] for row in json.loads(r.stdout)["budgets"]} == {20, 24}


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> str:
    """A tiny random Llama checkpoint with SmolLM2's tokenizer: trainable."""
    return tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat"))


def test_train_with_compression_logs_the_kv_budget_and_no_schedule(tiny_chat, tmp_path):
    run = tmp_path / "run"
    prompts = _prompts(tmp_path / "p.parquet")
    args = ["train", "--model", tiny_chat, "--prompts", str(prompts), "--prompts-per-step", "1",
            "--samples", "2", "--max-new-tokens", "24", "--ignore-eos", "--lora-rank", "2", "--steps", "2",
            "--eval-every", "100", "--kv-compression", "rkv", "--kv-budget", "16", "--kv-window", "2",
            "--kv-buffer", "6", "-o", str(run)]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    config = json.loads(artifact_metadata(run / "metrics.parquet")["config"])
    assert config["sparsity"] == "rkv:16,window=2,buffer=6,sink=4"
    logged = read_artifact(run / "mismatch" / "step=00001.parquet", "train_mismatch")
    budgets = np.asarray(logged.column("budget"))
    assert set(budgets[np.asarray(logged.column("position")) > 30].tolist()) == {16}
    # log r_t of the correction, as datasets.md and verl name it: the learner's logprob minus the rollout's
    dense, rollout = (np.asarray(logged.column(c), dtype=np.float64) for c in ("logp_dense", "logp_rollout"))
    log_r = dense - rollout
    assert np.abs(log_r).max() > 1e-2  # the evicted cache changed the sampler's logprobs
    np.testing.assert_allclose(np.asarray(logged.column("log_ratio")), log_r, atol=1e-5)
    np.testing.assert_allclose(np.asarray(logged.column("k3")), np.expm1(log_r) - log_r, atol=1e-5)
    assert not (run / "schedule.parquet").exists()
    profile = write_artifact({"prompt_id": ["p0"], "sample": [0], "position": [31], "bin": [0],
                              "budget": [64], "token_id": [5], "alpha": [0.9], "logp_dense": [-1.0],
                              "logp_sparse": [-1.1], "log_ratio": [0.1], "k1": [-0.1], "k2": [0.005],
                              "k3": [0.005], "entropy_dense": [2.0]}, tmp_path / "m.parquet", "mismatch")
    line = error_line(runner.invoke(app, ["calibrate-threshold", "--profile", str(profile), "--runs",
                                          str(run), "-o", str(tmp_path / "t.parquet")]))
    assert "rolled out with KV compression (rkv:16,window=2,buffer=6,sink=4)" in line
    r = runner.invoke(app, args[:-2] + ["--distill-sparse", "-o", str(tmp_path / "run2")])
    assert "--distill-sparse trains a block top-k sparse actor" in error_line(r)


@pytest.mark.parametrize("command", ["rollout", "train"])
def test_the_spec_form_given_to_the_flag_is_refused_with_the_flags_that_say_it(tmp_path, no_work, command):
    """--kv-compression takes the kind alone, as its help says; the spec form (profile's --sampler's) is
    refused with the flags that say the same."""
    prompts, out = _prompts(tmp_path / "p.parquet"), tmp_path / "out"
    r = runner.invoke(app, [command, "--model", "tiny-llama", "--prompts", str(prompts), "--kv-compression",
                            "snapkv:64", "-o", str(out)])
    assert error_line(r) == ("error: --kv-compression must be one of snapkv, rkv, got 'snapkv:64'; the flags "
                             "give the spec snapkv:64 as --kv-compression snapkv --kv-budget 64")
    assert not out.exists()
    shown = runner.invoke(app, [command, "--help"], env={"COLUMNS": "500"}).stdout
    help_text = " ".join(shown.replace("│", " ").split())  # the help's table, its cells' lines joined
    assert "The same as the spec" not in help_text
    assert ("The flag takes the kind alone, snapkv or rkv (case-insensitive), and --kv-budget its B"
            in help_text)
