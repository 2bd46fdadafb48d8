"""The trackers get the initial eval at step 0 (as TRL's eval_on_start logs its eval), under the periodic
evals' names, once, a resumed run included; and the per-bin tails reach tensorboard as one scalar per
position bin. A stand-in SummaryWriter records what tensorboard is handed (what TensorBoard's own reader
shows is tests/test_tensorboard_events.py); the expectations are read back with pyarrow from what the run
wrote."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pyarrow.parquet as pq
import pytest
from test_train import tiny_llama, vowel_token_prompts  # noqa: F401 - tiny_llama is a fixture
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import write_artifact
from sparrow.stages.model.loading import load_model
from sparrow.stages.tasks import TASKS
from sparrow.stages.train import tracking
from sparrow.stages.train.detectors import InitialEval
from sparrow.stages.train.tracking import Trackers, tracked_history

runner = CliRunner()


class Writer:
    """torch.utils.tensorboard.SummaryWriter's calls, recorded in `Writer.calls` across writers."""

    calls: list[tuple] = []

    def __init__(self, log_dir, purge_step=None):
        Writer.calls.append(("open", purge_step))

    def add_text(self, tag, text, *a):
        Writer.calls.append(("text", tag))

    def add_scalar(self, key, value, global_step):
        Writer.calls.append((key, value, global_step))

    def flush(self):
        pass

    def close(self):
        pass


@pytest.fixture()
def writer(monkeypatch):
    Writer.calls = []
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    monkeypatch.delitem(tracking.NEEDS, "tensorboard")  # the stand-in needs no package
    return Writer


@pytest.fixture()
def train(tiny_llama, tmp_path, monkeypatch):  # noqa: F811 - the imported fixture
    """`sparrow train` of the vowels task on two prompts of about 100 tokens (budget 48 is sparse there),
    held out as well, position bins of 2 tokens."""
    from test_train import VOWELS

    monkeypatch.setitem(TASKS, "vowels", VOWELS)
    tok = load_model(tiny_llama[0]).tokenizer
    prompts = str(write_artifact(vowel_token_prompts(tok, 2, 12), tmp_path / "p.parquet", "prompts"))

    def run(*extra: str):
        r = runner.invoke(app, ["train", "--model", tiny_llama[0], "--prompts", prompts, "--eval-prompts",
                                prompts, "--prompts-per-step", "2", "--samples", "2", "--max-new-tokens", "4",
                                "--lora-rank", "2", "--budget", "48", "--bin-width", "2", "--threads", "1",
                                "-o", str(tmp_path / "run"), *extra])
        assert r.exit_code == 0, r.output
        return tmp_path / "run"
    return run


def metadata(run) -> dict:
    return json.loads(pq.read_metadata(run / "metrics.parquet").metadata[b"sparrow.meta"])


def jsonl(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def step0_expected(meta: dict) -> dict:
    """The step-0 line by hand from the metadata: the periodic evals' names, the greedy gap as a periodic
    eval row computes it, the sampled rewards and their gap."""
    return {"step": 0, "eval_accuracy": meta["initial_eval_accuracy"],
            "eval_accuracy_sparse": meta["initial_eval_accuracy_sparse"],
            "sampler_gap": meta["initial_eval_accuracy"] - meta["initial_eval_accuracy_sparse"],
            "eval_reward": meta["initial_eval_reward"],
            "eval_reward_sparse": meta["initial_eval_reward_sparse"],
            "initial_sampler_gap": meta["initial_sampler_gap"]}


def scalars_at(calls, step: int) -> dict[str, float]:
    return {c[0]: c[1] for c in calls if len(c) == 3 and c[2] == step}


def test_a_run_logs_its_initial_eval_at_step_0_and_each_position_bins_tail(train, writer):
    run = train("--steps", "1", "--report-to", "jsonl,tensorboard")
    meta = metadata(run)
    expected = step0_expected(meta)
    lines = jsonl(run)
    assert [line["step"] for line in lines] == [0, 1]
    assert lines[0] == pytest.approx(expected)
    assert scalars_at(writer.calls, 0) == pytest.approx({k: v for k, v in expected.items() if k != "step"})
    assert writer.calls[:2] == [("open", 0), ("text", "config")]

    # step 1's per-bin tails: bin k holds the positions 2k and 2k + 1 (the mismatch log's `bin`)
    tokens = pq.read_table(run / "mismatch" / "step=00001.parquet").to_pydict()
    position = np.array(tokens["position"])
    bins = sorted(set((position // 2).tolist()))
    assert len(bins) >= 2 and bins[0] > 0  # some bins past the first, the first empty (long prompts)
    logged = {k: v for k, v in scalars_at(writer.calls, 1).items() if k.startswith("alpha_lb_p5_by_bin/")}
    assert sorted(logged) == [f"alpha_lb_p5_by_bin/bin_{b:03d}" for b in bins]  # the empty bins left out
    parquet = pq.read_table(run / "metrics.parquet").column("alpha_lb_p5_by_bin").to_pylist()[0]
    assert [parquet[b] for b in bins] == pytest.approx([logged[f"alpha_lb_p5_by_bin/bin_{b:03d}"]
                                                        for b in bins], rel=1e-6)
    lb = np.array(tokens["alpha_top20_lb"])
    assert [logged[f"alpha_lb_p5_by_bin/bin_{b:03d}"] for b in bins] == pytest.approx(
        [np.quantile(lb[position // 2 == b], 0.05) for b in bins], rel=1e-5)


def test_a_resume_gives_step_0_to_a_tracker_that_lacks_it_and_logs_it_once(train, writer):
    run = train("--steps", "1", "--report-to", "none")
    assert not (run / "metrics.jsonl").exists() and writer.calls == []
    run = train("--steps", "2", "--resume", "--report-to", "jsonl,tensorboard")
    expected = step0_expected(metadata(run))
    assert [line["step"] for line in jsonl(run)] == [0, 1, 2] and jsonl(run)[0] == pytest.approx(expected)
    # every earlier event purged from step 0 on, the config and each step written once
    assert writer.calls[:2] == [("open", 0), ("text", "config")]
    assert sorted({c[2] for c in writer.calls if len(c) == 3}) == [0, 1, 2]
    assert [c for c in writer.calls if c[0] == "eval_accuracy" and c[2] == 0] == [
        ("eval_accuracy", expected["eval_accuracy"], 0)]
    Writer.calls = []
    run = train("--steps", "3", "--resume", "--report-to", "jsonl,tensorboard")
    assert [line["step"] for line in jsonl(run)] == [0, 1, 2, 3]
    assert jsonl(run)[0] == pytest.approx(expected)
    assert [c[2] for c in writer.calls if c[0] == "eval_reward"] == [0]


def test_tracked_history_and_the_bins_by_hand(tmp_path, writer):
    """A dense run's step 0 has no sparse fields; null bins are skipped; the jsonl keeps its lines and adds
    step 0 once; tensorboard purges from step 0 and writes every step again."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
    history = [{"step": 1, "reward_mean": 0.5, "alpha_lb_p5_by_bin": [None, 0.25, None, 0.5],
                "alpha_p5_by_bin": [0.75] + [None] * 10 + [0.125]}]
    trackers = Trackers(("jsonl", "tensorboard"), tmp_path, start_step=1,
                        history=tracked_history(history, InitialEval(0.5, None, 0.25, None)))
    trackers.close()
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 0, "eval_accuracy": 0.5, "eval_reward": 0.25, "initial_sampler_gap": 0.0},
        {"step": 1, "reward_mean": 0.5}]
    assert writer.calls == [
        ("open", 0), ("text", "config"),
        ("eval_accuracy", 0.5, 0), ("eval_reward", 0.25, 0), ("initial_sampler_gap", 0.0, 0),
        ("reward_mean", 0.5, 1),
        ("alpha_lb_p5_by_bin/bin_001", 0.25, 1), ("alpha_lb_p5_by_bin/bin_003", 0.5, 1),
        ("alpha_p5_by_bin/bin_000", 0.75, 1), ("alpha_p5_by_bin/bin_011", 0.125, 1)]
    assert tracked_history(history, None) == history
