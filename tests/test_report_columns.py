"""`sparrow report` reads of an artifact only what a figure draws: the rollouts figure's numbers (lengths,
EOS stops, rewards, the sparse tokens' budgets) equal a hand computation over the rows, also across the
parts of a `--workers` output; a `rewards` artifact is drawn (rewards and statuses); and a profile's tail is
DuckDB's over the artifact's files alone, so a file name that spells SQL stays a name."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import read_artifact, write_artifact
from sparrow.stages.report import build_report
from sparrow.stages.report.tables import reward_stats, rollout_stats

ROWS = [  # (token_ids, budgets, finish_reason, reward)
    ([1, 2, 3], [0, 64, 64], "stop", 1.0),
    ([4], [128], "length", None),
    ([5, 6, 7, 8, 9], [0, 0, 0, 0, 0], "length", float("nan")),
    ([], [], "stop", 0.25),
    ([1, 1], [256, 0], "stop", -1.0),
]


def rollouts(path: Path, rows=ROWS) -> Path:
    return write_artifact([{"prompt_id": f"p{i}", "sample": 0, "prompt_token_ids": [9, 9], "token_ids": t,
                            "text": "x", "logprobs": [-0.5] * len(t), "budgets": b, "finish_reason": f,
                            "reward": r} for i, (t, b, f, r) in enumerate(rows)], path, "rollouts")


def test_rollout_numbers_equal_a_hand_count(tmp_path):
    stats = rollout_stats(rollouts(tmp_path / "r.parquet"))
    assert stats.lengths.tolist() == [3, 1, 5, 0, 2]
    assert stats.stops.tolist() == [True, False, False, True, True]
    assert np.array_equal(stats.rewards, [1.0, np.nan, 0.25, -1.0], equal_nan=True)  # the missing one out
    sparse = [b for _, budgets, _, _ in ROWS for b in budgets if b]  # 64, 64, 128, 256
    assert (stats.sparse_budget_sum, stats.sparse_tokens) == (sum(sparse), len(sparse)) == (512, 4)


def test_the_parts_of_a_workers_output_are_read_as_one(tmp_path):
    folder = tmp_path / "rollouts"
    folder.mkdir()
    rollouts(folder / "part-0.parquet", ROWS[:2])
    rollouts(folder / "part-1.parquet", ROWS[2:])
    parts = rollout_stats(folder)  # the hand count of test_rollout_numbers_equal_a_hand_count
    assert parts.lengths.tolist() == [3, 1, 5, 0, 2]
    assert parts.stops.tolist() == [True, False, False, True, True]
    assert np.array_equal(parts.rewards, [1.0, np.nan, 0.25, -1.0], equal_nan=True)


def test_the_rollouts_caption_gives_the_hand_counted_numbers(tmp_path):
    run = tmp_path / "run"
    rollouts(run / "rollouts.parquet")
    _, figures = build_report(run)
    caption = next(f.caption for f in figures if f.file == "rollouts.png")
    assert caption.startswith("From rollouts.parquet: 5 samples, sampler unknown (mean budget of sparse "
                              f"tokens {512 / 4:.0f}), {3 / 5:.0%} stopped at EOS.")
    assert "Rewards range from -1 to 1, beyond [0, 1]. 1 reward is NaN or infinite" in caption


def test_two_seeds_of_one_prompt_set_are_told_apart_by_their_captions(tmp_path):
    run = tmp_path / "run"
    for name, meta in (("greedy.parquet", {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}),
                       ("s7.parquet", {"temperature": 0.7, "top_p": 0.95, "top_k": 20, "seed": 7})):
        rows = rollouts(tmp_path / "plain.parquet")
        write_artifact(read_artifact(rows), run / name, "rollouts", metadata=meta)
    _, figures = build_report(run)
    captions = {f.file: f.caption for f in figures if f.file.startswith("rollouts")}
    assert len(captions) == 2
    said = sorted(re.search(r"; sampled (.*?)\.(?: |$)", c)[1] for c in captions.values())
    assert said == ["greedy, seed 0", "temperature 0.7, top-p 0.95, top-k 20, seed 7"]


def rewards(path: Path, values: list[float], statuses: list[str | None]) -> Path:
    n = len(values)
    return write_artifact({"prompt_id": [f"p{i}" for i in range(n)], "sample": [0] * n, "task": ["code"] * n,
                           "reward": values, "status": statuses, "tests_passed": [None] * n,
                           "tests_total": [None] * n, "reward_extra": [None] * n}, path, "rewards")


def test_a_rewards_artifact_is_drawn_with_its_statuses(tmp_path):
    run = tmp_path / "run"
    values = [1.0, 0.0, 0.1, 1.0, 0.0, 0.0]
    statuses = ["passed", "failed", "error", "passed", "timeout", "failed"]
    rewards(run / "rewards.parquet", values, statuses)
    stats = reward_stats(run / "rewards.parquet")
    assert stats.rewards.tolist() == values
    assert dict(stats.statuses) == Counter(statuses)
    assert [n for _, n in stats.statuses] == sorted(Counter(statuses).values(), reverse=True)
    result = CliRunner().invoke(app, ["report", "--run", str(run)])
    assert result.exit_code == 0, result.output
    assert (run / "report" / "rewards.png").is_file()
    assert "rewards.png: Rewards: per completion and by status (rewards.parquet) (6 points)" in result.stderr


def mismatch(path: Path, alphas: list[float]) -> Path:
    rows = [{"prompt_id": "p", "sample": 0, "position": 10 + k, "bin": 0, "budget": 64, "token_id": 1,
             "alpha": a, "logp_dense": -1.0, "logp_sparse": -1.0, "log_ratio": 0.0, "k1": 0.0, "k2": 0.0,
             "k3": 0.0, "entropy_dense": 1.0} for k, a in enumerate(alphas)]
    return write_artifact(rows, path, "mismatch", metadata={"bin_width": 512})


def test_a_file_name_that_spells_sql_stays_a_name(tmp_path, monkeypatch):
    """A profile in a folder named to close the path's literal and run a COPY: drawn from its own rows (its
    tail is numpy's), and nothing is written."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    alphas = [0.2, 0.5, 0.9, 0.95, 0.99]
    mismatch(run / "a.parquet", [0.1] * 5)
    evil = run / "x') GROUP BY ALL; COPY (SELECT 42 AS x) TO 'pwned.csv'; SELECT * FROM read_parquet(('a"
    evil.mkdir()
    mismatch(evil / "part.parquet", alphas)
    before = sorted(p.name for p in tmp_path.iterdir())
    _, figures = build_report(run, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "out"])  # no pwned.csv
    tails = {f.file: f for f in figures if f.file.startswith("tail")}
    assert len(tails) == 2 and all(f.points == 1 for f in tails.values())
    from sparrow.stages.report.tables import sql_rows

    got = sql_rows([evil / "part.parquet"], lambda scan: f"SELECT quantile_cont(alpha, 0.05) FROM {scan}")
    assert np.isclose(got[0][0], np.quantile(np.array(alphas, np.float32), 0.05))
