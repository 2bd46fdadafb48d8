"""profile --rollouts of compressed rollouts replays their own window and buffer (a conflicting flag is one
sentence) and says which budgets evicted nothing; train's rollout_corr/rollout_is_* are verl's quantities
(before truncation or masking), the bounded weights' under names of their own and IcePop's masked share
under verl's name; rollouts record what scored them, show the scoring's progress and seconds, and their
csv/tsv summary loses nothing."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_kv_cli import _prompts
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact

from cli_checks import error_line
from tiny_models import tiny_chat_llama

runner = CliRunner()


# ----------------------------------------------------------------- profile --rollouts of compressed rollouts


@pytest.fixture(scope="module")
def compressed(tmp_path_factory) -> Path:
    """Rollouts of tiny-llama sampled with snapkv:20, window 4, buffer 8 (30-token prompts, 40 tokens)."""
    tmp = tmp_path_factory.mktemp("kv")
    rollouts = tmp / "r.parquet"
    r = runner.invoke(app, ["rollout", "--model", "tiny-llama", "--prompts", str(_prompts(tmp / "p.parquet")),
                            "--samples", "2", "--max-new-tokens", "40", "--ignore-eos", "--kv-compression",
                            "snapkv", "--kv-budget", "20", "--kv-window", "4", "--kv-buffer", "8", "-o",
                            str(rollouts)])
    assert r.exit_code == 0, r.output
    return rollouts


def test_profile_of_compressed_rollouts_replays_their_window_and_buffer(compressed, tmp_path):
    """Without --kv-window/--kv-buffer the budgets take the rollouts' own (window 4, buffer 8): at their
    budget the replay gives back the logprobs they were sampled with; a budget whose cache never reaches
    budget + buffer scores the dense cache and is named in a warning."""
    mismatch = tmp_path / "m.parquet"
    r = runner.invoke(app, ["profile", "--model", "tiny-llama", "--rollouts", str(compressed),
                            "--kv-compression", "snapkv", "--budgets", "20,100", "--bin-width", "16",
                            "-o", str(mismatch)])
    assert r.exit_code == 0, r.output
    assert json.loads(artifact_metadata(mismatch)["kv_policies"]) == [
        "snapkv:20,window=4,buffer=8,sink=4", "snapkv:100,window=4,buffer=8,sink=4"]
    scored = read_artifact(mismatch, "mismatch")
    budget = np.asarray(scored.column("budget"))
    sampled = np.concatenate([row["logprobs"] for row in read_artifact(compressed, "rollouts").to_pylist()])
    own = np.asarray(scored.column("logp_sparse"))[budget == 20]
    assert np.abs(own - sampled).max() <= 1e-4
    # 30 + 40 tokens never reach 100 + 8: budget 100 reads the whole cache, and the warning says so
    dense, sparse = (np.asarray(scored.column(c))[budget == 100] for c in ("logp_dense", "logp_sparse"))
    assert np.abs(dense - sparse).max() <= 1e-5
    warned = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "--budgets 100 under --kv-compression snapkv evicted nothing" in warned[0]
    assert "100 + 8 = 108" in warned[0]


@pytest.mark.parametrize("flag,value,own", [("--kv-buffer", "16", "8"), ("--kv-window", "8", "4")])
def test_profile_refuses_a_window_or_buffer_other_than_the_rollouts(compressed, tmp_path, monkeypatch, flag,
                                                                    value, own):
    import sparrow.stages.model.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    out = tmp_path / "m.parquet"
    r = runner.invoke(app, ["profile", "--model", "tiny-llama", "--rollouts", str(compressed),
                            "--kv-compression", "snapkv", flag, value, "--budgets", "20", "-o", str(out)])
    line = error_line(r)
    assert r.exit_code == 2 and not out.exists()
    assert f"{flag} {value} differs from the {flag[5:]} ({own} tokens) of the eviction that sampled " \
           f"--rollouts {compressed} (snapkv:20,window=4,buffer=8,sink=4" in line


def test_a_compressed_rollout_that_never_compressed_says_so(tmp_path):
    """30-token prompts and 4 new tokens never fill budget + buffer (20 + 128): no compaction, a warning."""
    out = tmp_path / "r.parquet"
    prompts = _prompts(tmp_path / "p.parquet")
    r = runner.invoke(app, ["rollout", "--model", "tiny-llama", "--prompts", str(prompts), "--max-new-tokens",
                            "4", "--kv-compression", "snapkv", "--kv-budget", "20", "-o", str(out),
                            "-f", "json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["compactions"] == 0
    warned = [line for line in r.stderr.splitlines() if line.startswith("warning: --kv-compression")]
    assert len(warned) == 1
    assert "--kv-compression snapkv --kv-budget 20: no sample's cache reached budget + buffer (20 + 128 = " \
        "148 tokens)" in warned[0]


# ------------------------------------------------------------- rollout_corr/rollout_is_*: verl's quantities

SAFETY = 20.0


def _batch():
    torch.manual_seed(3)
    lr = torch.randn(5, 6, dtype=torch.float64) * 0.9
    mask = torch.ones(5, 6, dtype=torch.bool)
    mask[1, 4:] = False
    mask[3, 2:] = False
    return lr, mask


def _verl(lr: torch.Tensor, mask: torch.Tensor, level: str, upper: float, lower: float | None) -> dict:
    """verl's compute_is_metrics, written out over Python lists: the ratios before any bound, per token
    (each token carrying its sequence's ratio under sequence IS); std and ESS of them clamped to
    [lower or 1/upper, upper]."""
    rows = [[float(x) for x, k in zip(r, m) if k] for r, m in zip(lr.tolist(), mask.tolist())]
    clamp = lambda x: min(max(x, -SAFETY), SAFETY)
    if level == "token":
        ratios = [math.exp(clamp(x)) for row in rows for x in row]
        high, low = max(ratios), min(ratios)
    else:
        sums = [sum(row) for row in rows if row]
        ratios = [math.exp(clamp(sum(row))) for row in rows for _ in row]
        high, low = math.exp(min(max(sums), SAFETY)), math.exp(min(sums))
    lo = lower if lower is not None else 1 / upper
    c = [min(max(w, lo), upper) for w in ratios]
    mean_c = sum(c) / len(c)
    return {"rollout_is_mean": sum(ratios) / len(ratios), "rollout_is_max": high, "rollout_is_min": low,
            "rollout_is_std": math.sqrt(max(sum(x * x for x in c) / len(c) - mean_c ** 2, 0)),
            "rollout_is_eff_sample_size": 1 / (sum((x / mean_c) ** 2 for x in c) / len(c))}


@pytest.mark.parametrize("preset,level,mode,upper,lower", [
    ("tis", "token", "truncate", 2.0, None), ("icepop", "token", "mask", 5.0, 0.5),
    (None, "sequence", "truncate", 2.0, None), (None, "sequence", "mask", 1.5, None)])
def test_rollout_is_metrics_are_verls_before_truncation_or_masking(preset, level, mode, upper, lower):
    from sparrow.stages.train import corrections as rc

    lr, mask = _batch()
    rules = rc.preset(preset) if preset else rc.Rules(is_level=level, is_upper=upper, is_mode=mode)
    corr = rc.apply(rules, lr, mask)
    got = rc.metrics(corr, lr, lr * 0 - 1, lr * 0 - 1 - lr, mask, rules)
    for name, want in _verl(lr, mask, level, upper, lower).items():
        assert got["rollout_corr/" + name] == pytest.approx(want, rel=1e-9), name
    # the weights the loss reads, under names of their own: truncated at the cap, or zeroed outside
    rows = [[float(x) for x, k in zip(r, m) if k] for r, m in zip(lr.tolist(), mask.tolist())]
    logs = [x for row in rows for x in row] if level == "token" else [sum(row) for row in rows if row]
    ratios = [math.exp(x) for x in logs]
    inside = [(lower or 0.0) <= w <= upper for w in ratios]
    bounded = [min(w, upper) for w in ratios] if mode == "truncate" else \
        [w if ok else 0.0 for w, ok in zip(ratios, inside)]
    assert got["rollout_corr/is_bounded_max"] == pytest.approx(max(bounded), rel=1e-9)
    assert got["rollout_corr/is_bounded_min"] == pytest.approx(min(bounded), rel=1e-9)
    assert got["rollout_corr/is_bounded_mean"] == pytest.approx(sum(bounded) / len(bounded), rel=1e-9)
    if mode == "mask":  # verl's name for the share the mask zeroes, counted over tokens
        per_token = [w for row in rows for w in [math.exp(x if level == "token" else sum(row)) for x in row]]
        zeroed = [not ((lower or 0.0) <= w <= upper) for w in per_token]
        assert got["rollout_corr/rollout_is_masked_fraction"] == pytest.approx(sum(zeroed) / len(zeroed))
        assert 0 < sum(zeroed) < len(zeroed)
    else:
        assert "rollout_corr/rollout_is_masked_fraction" not in got


def test_tis_max_is_the_ratio_not_the_cap():
    """A ratio above the TIS cap: verl's rollout_is_max is that ratio; the bounded max is the cap."""
    from sparrow.stages.train import corrections as rc

    lr = torch.tensor([[math.log(3.0), 0.0, math.log(0.2)]], dtype=torch.float64)
    mask = torch.ones_like(lr, dtype=torch.bool)
    rules = rc.preset("tis")
    got = rc.metrics(rc.apply(rules, lr, mask), lr, lr * 0, -lr, mask, rules)
    assert got["rollout_corr/rollout_is_max"] == pytest.approx(3.0)
    assert got["rollout_corr/rollout_is_min"] == pytest.approx(0.2)
    assert got["rollout_corr/is_bounded_max"] == pytest.approx(2.0)
    assert got["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)


def test_every_correction_metric_is_a_column_of_the_metrics_schema():
    """A step's row is written against the metrics schema, so each rollout_corr/ name must be a column."""
    from sparrow.schemas.artifacts import TRAIN_CORRECTION_METRICS
    from sparrow.stages.train import corrections as rc

    lr, mask = _batch()
    names = set()
    for preset in rc.PRESETS:
        rules = rc.preset(preset)
        adv = torch.zeros(lr.shape[0], dtype=torch.float64)
        corr = rc.apply(rules, lr, mask, advantages=adv, alpha=torch.ones_like(lr),
                        generator=torch.Generator().manual_seed(0))
        names |= set(rc.metrics(corr, lr, lr * 0 - 1, lr * 0 - 1 - lr, mask, rules))
    assert names - set(TRAIN_CORRECTION_METRICS) == set()


# ------------------------------------------------------------- rollout: reward provenance, scoring, csv/tsv


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> str:
    return tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat"))


REWARD_FN = '''import time
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.2)
    return 1 / 3 + 1e-9
'''


def test_rollout_records_its_reward_and_shows_the_scoring(tiny_chat, tmp_path):
    """--reward-fn's spec and the file's sha256, and --raw-prompts, are in the metadata; the scoring shows
    its progress on stderr and its seconds in the summary; the csv summary is the metadata's, whole."""
    fn = tmp_path / "slow.py"
    fn.write_text(REWARD_FN)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                               for i in range(2)))
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, ["rollout", "--model", tiny_chat, "--prompts", str(prompts), "--reward-fn",
                            f"{fn}:compute_score", "--raw-prompts", "--samples", "2", "--max-new-tokens", "4",
                            "-o", str(out), "-f", "csv"])
    assert r.exit_code == 0, r.output
    meta = artifact_metadata(out)
    assert meta["reward_fn"] == f"{fn}:compute_score" and meta["reward"] is None
    assert meta["reward_fn_sha256"] == hashlib.sha256(REWARD_FN.encode()).hexdigest()
    assert meta["raw_prompts"] is True
    lines = [line for line in r.stderr.splitlines() if line.startswith("scoring rewards (samples)")]
    assert lines[0].startswith("scoring rewards (samples): 0/4") and "4/4" in lines[-1]
    summary = meta["summary"]
    assert summary["reward_seconds"] >= 4 * 0.2
    row = next(csv.DictReader(io.StringIO(r.stdout)))
    assert float(row["reward_mean"]) == 1 / 3 + 1e-9 == summary["reward_mean"]
    assert float(row["reward_seconds"]) == summary["reward_seconds"]


def test_rollout_records_a_named_reward(tiny_chat, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2 + 2?", "answer": "4"}) + "\n")
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, ["rollout", "--model", tiny_chat, "--prompts", str(prompts), "--reward", "math",
                            "--max-new-tokens", "2", "-o", str(out), "-f", "json"])
    assert r.exit_code == 0, r.output
    meta = artifact_metadata(out)
    assert (meta["reward"], meta["reward_fn"], meta["reward_fn_sha256"], meta["raw_prompts"]) == \
        ("math", None, "", False)


@pytest.mark.parametrize("fmt", ["tsv", "csv"])
def test_rollout_text_summary_writes_nulls_as_nulls(tmp_path, fmt):
    """No scorer (tiny-llama has no tokenizer, so no text to reward) and no decode step (no KV saved):
    those fields are the format's null, not words; a dense run's mean budget is the word dense."""
    out = tmp_path / "r.parquet"
    prompts = _prompts(tmp_path / "p.parquet")
    r = runner.invoke(app, ["rollout", "--model", "tiny-llama", "--prompts", str(prompts), "--max-new-tokens",
                            "1", "-o", str(out), "-f", fmt])
    assert r.exit_code == 0, r.output
    header, values = r.stdout.splitlines()[:2]
    sep, null = ("\t", "\\N") if fmt == "tsv" else (",", "")
    row = dict(zip(header.split(sep), values.split(sep)))
    summary = artifact_metadata(out)["summary"]
    assert summary["reward_mean"] is None and summary["kv_saved"] is None
    assert summary["reward_seconds"] is None
    assert row["reward_mean"] == row["kv_saved"] == row["reward_seconds"] == null
    assert row["mean_budget"] == "dense"
    assert float(row["seconds"]) == summary["seconds"]
    assert float(row["tokens_per_s"]) == summary["tokens_per_s"]


def test_the_rewards_artifact_records_its_reward_function(tmp_path):
    import hashlib

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_id": "a", "prompt": "What is 2 + 2?", "answer": "4"}) + "\n")
    completions = tmp_path / "c.jsonl"
    completions.write_text(json.dumps({"prompt_id": "a", "sample": 0, "text": "4"}) + "\n")
    fns = tmp_path / "fns.py"
    fns.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                   "    return 1.0\n")
    out = tmp_path / "rw.parquet"
    r = runner.invoke(app, ["reward", "--prompts", str(prompts), "--completions", str(completions),
                            "--reward-fn", f"{fns}:compute_score", "-o", str(out)])
    assert r.exit_code == 0, r.output
    meta = artifact_metadata(out)
    assert (meta["reward"], meta["reward_fn"]) == (None, f"{fns}:compute_score")
    assert meta["reward_fn_sha256"] == hashlib.sha256(fns.read_bytes()).hexdigest()


def test_reward_names_the_mean_reward_as_rollout_and_train_do(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_id": "a", "prompt": "What is 2 + 2?", "answer": "4"}) + "\n")
    completions = tmp_path / "c.jsonl"
    completions.write_text("".join(json.dumps({"prompt_id": "a", "sample": i, "text": t}) + "\n"
                                   for i, t in enumerate(["\\boxed{4}", "\\boxed{5}"])))
    out = tmp_path / "rw.parquet"
    r = runner.invoke(app, ["reward", "--prompts", str(prompts), "--completions", str(completions),
                            "--reward", "math", "-o", str(out), "-f", "json"])
    assert r.exit_code == 0, r.output
    assert artifact_metadata(out)["reward_mean"] == 0.5
    assert json.loads(r.stdout)[0]["reward_mean"] == 0.5
