"""What `sparrow train`'s per-step numbers mean, checked against their definitions: reward_std is TRL's
(GRPOTrainer: the std of the step's rewards, ddof 1), mean_budget averages the sparse tokens only (as
`sparrow rollout` does, in float64; null for a dense run), and alpha's top-20 lower bound is 1 for a token
produced densely (its sampler is the learner). The TRL integration says both the same way."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_train import VOWELS, tiny_llama, vowel_token_prompts  # noqa: F401 - tiny_llama is a fixture
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import read_artifact, write_artifact
from sparrow.stages.core.sparsity import as_policy
from sparrow.stages.core.token_budgets import (
    dense_alpha_is_one,
    mean_sparse_budget,
    produced_densely,
    token_positions,
)
from sparrow.stages.engine import Engine, EngineConfig, SamplingParams
from sparrow.stages.integrations.trl import SparseRollout
from sparrow.stages.model.loading import load_model
from sparrow.stages.tasks import TASKS
from sparrow.stages.train.experience import Scores
from sparrow.stages.train.metrics import reward_std

runner = CliRunner()


def test_reward_std_is_trl_s_batch_std_with_bessel_s_correction():
    rewards = np.array([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # two groups of four
    # by hand: mean 0.25, squared deviations 2 x 0.5625 + 6 x 0.0625 = 1.5, over n - 1 = 7
    assert reward_std(rewards) == pytest.approx(math.sqrt(1.5 / 7))
    # TRL's GRPOTrainer: self._metrics[mode]["reward_std"].append(rewards.std().item())
    assert reward_std(rewards) == pytest.approx(torch.tensor(rewards.ravel()).std().item())


def test_mean_budget_averages_the_sparse_tokens_only():
    assert mean_sparse_budget(torch.tensor([0, 64, 64, 0, 128], dtype=torch.int32)) == pytest.approx(256 / 3)
    assert mean_sparse_budget(np.array([0, 48, 64, 64])) == 176 / 3  # float64, as the rollout summary's
    assert mean_sparse_budget(torch.tensor([0, 0, 0], dtype=torch.int32)) is None
    assert mean_sparse_budget(np.zeros(0)) is None


def test_trl_mean_budget_is_over_sparse_tokens_and_absent_when_dense():
    me = SimpleNamespace(quantile=0.05, bin_width=512)
    alpha, positions, log_ratio = torch.tensor([1.0, 0.9, 0.8]), torch.tensor([10, 11, 12]), torch.zeros(3)
    out = SparseRollout.metrics(me, alpha, positions, log_ratio, torch.tensor([0.0, 48.0, 48.0]), None)
    assert out["sparrow/mean_budget"] == pytest.approx(48.0)
    out = SparseRollout.metrics(me, alpha, positions, log_ratio, torch.zeros(3), None)
    assert "sparrow/mean_budget" not in out
    alpha, positions, log_ratio = torch.ones(4), torch.arange(4), torch.zeros(4)
    out = SparseRollout.metrics(me, alpha, positions, log_ratio, torch.tensor([0.0, 48.0, 64.0, 64.0]), None)
    assert out["sparrow/mean_budget"] == 176 / 3  # the same number `sparrow rollout` reports, not float32's


def test_a_densely_produced_token_s_alpha_bound_is_one():
    bound, budgets = torch.tensor([[0.25, 0.5, 0.75]]), torch.tensor([[0, 48, 0]], dtype=torch.int32)
    positions = torch.tensor([[100, 101, 102]])  # past the budget: only budget 0 is dense here
    assert dense_alpha_is_one(bound, budgets, positions).tolist() == [[1.0, 0.5, 1.0]]
    zeros = torch.zeros(1, 3)
    scores = Scores(logp=zeros, entropy=zeros, mask=torch.ones(1, 3, dtype=torch.bool), logp_rollout=zeros,
                    budgets=budgets, positions=positions, alpha_lb=bound, ref=None)
    assert scores.acceptance().tolist() == [[1.0, 0.5, 1.0]]


def test_a_token_whose_cache_fits_within_its_budget_was_produced_densely():
    # budget 48 = 3 pages: a cache of 48 tokens is 3 pages, all kept (DESIGN: at most B/16 pages is dense);
    # 49 tokens are 4 pages, one of which the block top-k rule may drop
    bound = torch.tensor([[0.25, 0.5, 0.75, 0.625]])
    budgets = torch.full((1, 4), 48, dtype=torch.int32)
    positions = torch.tensor([[46, 47, 48, 49]])
    assert produced_densely(budgets, positions).tolist() == [[True, True, True, False]]
    assert dense_alpha_is_one(bound, budgets, positions).tolist() == [[1.0, 1.0, 1.0, 0.625]]
    assert token_positions([3, 5], 2).tolist() == [[3, 4], [5, 6]]


def test_the_engine_samples_densely_while_the_cache_fits_within_the_budget():
    # the rule above against the engine itself: at budget 48, every token produced at a cache length of at
    # most 48 carries the dense run's logprob of the same token; the first one past it, not (random weights:
    # the attention is spread, so dropping a page moves the logprob)
    loaded = load_model("tiny-llama", random_weights=True)
    prompt = [list(range(1, 31))]  # 30 tokens: positions 30, 31, ... for the new tokens
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=3, ignore_eos=True)
    runs = {}
    for budget in (None, 48):
        with Engine(loaded.model, as_policy(budget), EngineConfig(dense_layers=())) as engine:
            runs[budget] = engine.generate(prompt, params)[0][0]
    sparse, dense = runs[48], runs[None]
    positions = token_positions([30], 30)[0]
    assert sparse.token_ids[:19] == dense.token_ids[:19]  # positions 30..48: the same distribution
    fits = positions <= 48
    assert fits.sum() == 19
    np.testing.assert_allclose(sparse.logprobs[:19], dense.logprobs[:19], atol=1e-5)
    assert produced_densely(np.asarray(sparse.budgets), positions).tolist() == fits.tolist()
    if sparse.token_ids[19] == dense.token_ids[19]:  # position 49: four pages, one dropped
        assert abs(sparse.logprobs[19] - dense.logprobs[19]) > 1e-4


@pytest.fixture(scope="module")
def prompts(tiny_llama, tmp_path_factory):  # noqa: F811 - the imported fixture
    patch = pytest.MonkeyPatch()
    patch.setitem(TASKS, "vowels", VOWELS)
    tok = load_model(tiny_llama[0]).tokenizer
    path = tmp_path_factory.mktemp("defs") / "prompts.parquet"
    yield write_artifact(vowel_token_prompts(tok, 2, 4), path, "prompts")
    patch.undo()


def _train(model: str, prompts, run, *extra: str) -> tuple[dict, list[dict]]:
    r = runner.invoke(app, ["train", "--model", model, "--prompts", str(prompts), "--steps", "1",
                            "--prompts-per-step", "2", "--samples", "2", "--max-new-tokens", "6",
                            "--lora-rank", "2", "--threads", "1", "-o", str(run), *extra])
    assert r.exit_code == 0, r.output
    (row,) = read_artifact(run / "metrics.parquet", "metrics").to_pylist()
    return row, read_artifact(run / "mismatch" / "step=00001.parquet", "train_mismatch").to_pylist()


def test_a_dense_run_has_alpha_lb_one_and_no_mean_budget(tiny_llama, prompts, tmp_path):  # noqa: F811
    row, tokens = _train(tiny_llama[0], prompts, tmp_path / "dense", "--dense")
    assert all(t["budget"] == 0 and t["alpha_top20_lb"] == 1.0 for t in tokens)
    assert row["alpha_lb_p5"] == 1.0 and row["alpha_lb_mean"] == 1.0 and row["mean_budget"] is None


def test_a_sparse_run_logs_the_mean_of_its_sparse_budgets(tiny_llama, prompts, tmp_path):  # noqa: F811
    row, tokens = _train(tiny_llama[0], prompts, tmp_path / "b48", "--budget", "48")
    sparse = [t["budget"] for t in tokens if t["budget"] > 0]
    assert sparse and len(sparse) < len(tokens)  # each sample's first token comes from the dense prefill
    assert row["mean_budget"] == pytest.approx(np.mean(sparse))
    assert all(t["alpha_top20_lb"] == 1.0 for t in tokens if t["budget"] == 0)
