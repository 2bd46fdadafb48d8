"""plan-schedule on hand-made profiles of known token counts: an eviction profile whose bins are all
thinner than --min-tokens is refused in the block top-k plan's sentence (neither plans from thin bins),
a thin bin beside a trusted one is named in a note and left unjudged; and lengths beyond the model's
context are refused naming where each came from (the profile's means, or the flags given), and so is a
budget beyond it (a rollout would refuse the schedule)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import write_artifact

runner = CliRunner()
MODEL = "smollm2-135m"  # context 8192
WIDTH = 100
PROMPT = 84  # bin 0 holds the scored positions 84-99 (16 tokens), bin 1 positions 100-140 (41 tokens)
GENERATED = 57


def _row(position: int, budget: int, alpha: float) -> dict:
    return {"prompt_id": "p", "sample": 0, "position": position, "bin": position // WIDTH, "budget": budget,
            "token_id": 1, "alpha": alpha, "logp_dense": -1.0, "logp_sparse": -1.0, "log_ratio": 0.0,
            "k1": 0.0, "k2": 0.0, "k3": 0.0, "entropy_dense": 1.0}


def _profile(path: Path, eviction: bool, prompt: int = PROMPT, generated: int = GENERATED,
             budgets: tuple[int, int] = (48, 96)) -> dict:
    """One trajectory scored at budgets 48 and 96 (or `budgets`): bin 0's alphas are 0.1 (a tail no
    threshold passes), bin 1's 0.6-1.0 at 48 and 0.8-1.0 at 96 -> {budget: bin 1's alphas, as stored
    (float32)}."""
    rng = np.random.default_rng(0)
    rows, later = [], {}
    for budget, low in zip(budgets, (0.6, 0.8)):
        alphas = rng.uniform(low, 1.0, generated).astype(np.float32)
        alphas[[p // WIDTH == 0 for p in range(prompt, prompt + generated)]] = 0.1
        later[budget] = np.array([a for p, a in zip(range(prompt, prompt + generated), alphas)
                                  if p // WIDTH == 1], dtype=np.float64)
        rows += [_row(p, budget, float(a)) for p, a in zip(range(prompt, prompt + generated), alphas)]
    meta = {"model": MODEL, "bin_width": WIDTH}
    if eviction:
        meta |= {"kv_compression": "snapkv", "budgets": "[48, 96]",
                 "kv_policies": json.dumps([f"snapkv:{b},window=8,buffer=16,sink=4" for b in (48, 96)])}
    write_artifact(rows, path, "mismatch", metadata=meta)
    return later


def _plan(profile: Path, *args: str):
    return runner.invoke(app, ["plan-schedule", "--model", MODEL, "--profile", str(profile),
                               "--threshold", "0.5", *args])


def _error(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code != 0 and len(lines) == 1, result.output
    return lines[0]


@pytest.mark.parametrize("min_tokens", ["50", "1000"])
def test_an_eviction_profile_of_thin_bins_is_refused_as_a_top_k_one_is(tmp_path, min_tokens):
    """No bin has --min-tokens tokens (the most in one is bin 1's 41): both planners refuse, in one
    sentence naming --min-tokens and the counts, with nothing printed on stdout."""
    _profile(tmp_path / "kv.parquet", eviction=True)
    _profile(tmp_path / "topk.parquet", eviction=False)
    expected = (f"no bin has the --min-tokens {min_tokens} tokens a tail needs (the most in one bin is 41); "
                "profile more samples or longer generations, or lower --min-tokens")
    for name in ("kv.parquet", "topk.parquet"):
        r = _plan(tmp_path / name, "--min-tokens", min_tokens)
        assert _error(r) == f"error: {tmp_path / name}: {expected}"
        assert r.stdout == ""


def test_a_thin_bin_beside_a_trusted_one_is_named_and_not_judged(tmp_path):
    """With --min-tokens 20 bin 1 (41 tokens) is trusted and bin 0 (16) is not: each budget's tail is
    numpy's 5th percentile of its bin 1 alphas alone, so budget 48 holds although bin 0's alpha is 0.1."""
    later = _profile(tmp_path / "kv.parquet", eviction=True)
    r = _plan(tmp_path / "kv.parquet", "--min-tokens", "20", "-f", "json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    rows = {row["kv_budget"]: row for row in doc["budgets"]}
    for budget, alphas in later.items():
        assert len(alphas) == 41 and rows[budget]["weakest_bin"] == 1
        assert rows[budget]["tail"] == pytest.approx(np.percentile(alphas, 5), rel=1e-9)
        assert rows[budget]["tokens"] == GENERATED
    assert doc["kv_budget"] == 48
    assert ("note: bin 0 (0-100, 16 tokens): fewer tokens than --min-tokens (20), so its tail is not judged"
            in r.stderr)


def test_a_profile_longer_than_the_context_is_refused_naming_its_means(tmp_path):
    """A trajectory of an 8,000-token prompt and 300 generated tokens (8,300 > 8,192): the sentence says
    the lengths are the profile's means, and names no flag the user did not give."""
    path = tmp_path / "long.parquet"
    _profile(path, eviction=False, prompt=8000, generated=300)
    line = _error(_plan(path, "--min-tokens", "1"))
    assert line == ("error: the profile's trajectories (a mean prompt of 8000 + a mean of 300 generated "
                    "tokens, over 1) exceed the model's context of 8192; give --prompt-len and --gen-len "
                    "that fit it")
    line = _error(_plan(path, "--min-tokens", "1", "--gen-len", "9000"))
    assert line.startswith("error: the profile's mean prompt of 8000 tokens (over its 1 trajectories) + "
                           "--gen-len 9000 exceeds the model's context of 8192")
    line = _error(_plan(path, "--min-tokens", "1", "--prompt-len", "100", "--gen-len", "9000"))
    assert line.startswith("error: --prompt-len 100 + --gen-len 9000 exceeds the model's context of 8192")


def test_a_profiled_budget_beyond_the_context_is_refused_before_a_schedule_is_written(tmp_path):
    """A hand-edited profile scored at 8,208 tokens, beyond smollm2-135m's 8,192: the plan would schedule
    a budget that `sparrow rollout --schedule` refuses, so plan-schedule refuses the profile first."""
    path = tmp_path / "edited.parquet"
    _profile(path, eviction=False, budgets=(48, 8208))
    r = _plan(path, "--min-tokens", "1", "--threshold", "0.99", "-o", str(tmp_path / "schedule.parquet"))
    assert _error(r) == (f"error: {path} holds budget 8208, beyond the model's context of 8192 tokens, which "
                         "a rollout refuses (a budget that covers the whole context is dense attention); "
                         "profile again with --budgets within the context, or drop its rows")
    assert not (tmp_path / "schedule.parquet").exists()
