"""`-o` naming one of the command's own inputs (the same path, a symlink to it, or a directory replaced
whole that holds it) is refused in one sentence before any work, with or without --force, and the input
is left byte for byte as it was."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import write_artifact

from cli_checks import error_line

runner = CliRunner()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def mismatch(path: Path) -> Path:
    rng = np.random.default_rng(0)
    rows = [{"prompt_id": "p", "sample": 0, "position": int(p), "bin": int(p) // 512, "budget": b,
             "token_id": 1, "alpha": float(1 - rng.exponential(0.01)), "logp_dense": -1.0,
             "logp_sparse": -1.0, "log_ratio": 0.0, "k1": 0.0, "k2": 0.0, "k3": 0.0, "entropy_dense": 1.0}
            for b in (64, 128) for p in range(1000, 1100)]
    return write_artifact(rows, path, "mismatch", metadata={"bin_width": 512, "model": "smollm2-135m"})


def token_prompts(path: Path) -> Path:
    rows = [{"prompt_id": f"p{i}", "task": "basic_arithmetic", "prompt": None,
             "prompt_token_ids": list(range(5 + i, 30)), "answer": "3", "metadata": None} for i in range(2)]
    return write_artifact(rows, path, "prompts")


@pytest.fixture()
def no_work(monkeypatch):
    """Fails the test if a command plans or loads a model: the refusal must come first."""
    import sparrow.stages.model.loading as loading
    import sparrow.stages.plan as plan

    def refuse(*a, **k):
        raise AssertionError("work started before the refusal")

    monkeypatch.setattr(loading, "load_model", refuse)
    monkeypatch.setattr(plan, "plan_schedule", refuse)


@pytest.mark.parametrize("force", [[], ["--force"]])
@pytest.mark.parametrize("through_link", [False, True])
def test_plan_schedule_never_replaces_its_profile(tmp_path, force, through_link, no_work):
    profile = mismatch(tmp_path / "m.parquet")
    before = digest(profile)
    out = profile
    if through_link:
        out = tmp_path / "link.parquet"
        out.symlink_to(profile)
    line = error_line(runner.invoke(app, ["plan-schedule", "--model", "smollm2-135m", "--profile",
                                          str(profile), "--threshold", "0.2", "-o", str(out), *force]))
    assert line == f"error: -o {out} is the --profile this command reads; choose another path"
    assert digest(profile) == before


def test_plan_schedule_writes_beside_its_profile(tmp_path):
    profile = mismatch(tmp_path / "m.parquet")
    r = runner.invoke(app, ["plan-schedule", "--model", "smollm2-135m", "--profile", str(profile),
                            "--threshold", "0.2", "-o", str(tmp_path / "s.parquet")])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_profile_never_replaces_its_prompts(tmp_path, force, no_work):
    prompts = token_prompts(tmp_path / "p.parquet")
    before = digest(prompts)
    line = error_line(runner.invoke(app, ["profile", "--model", "tiny-llama", "--prompts", str(prompts),
                                          "-o", str(prompts), *force]))
    assert line == f"error: -o {prompts} is the --prompts this command reads; choose another path"
    assert digest(prompts) == before


def test_rollout_never_replaces_its_schedule(tmp_path, no_work):
    prompts = token_prompts(tmp_path / "p.parquet")
    schedule = write_artifact({"bin": [0], "bin_start": [0], "bin_end": [None], "budget": [64], "tail": [0.9],
                               "predicted_step_seconds": [None]}, tmp_path / "s.parquet", "schedule",
                              {"page_size": 16})
    before = digest(schedule)
    line = error_line(runner.invoke(app, ["rollout", "--model", "tiny-llama", "--prompts", str(prompts),
                                          "--schedule", str(schedule), "-o", str(schedule), "--force"]))
    assert line == f"error: -o {schedule} is the --schedule this command reads; choose another path"
    assert digest(schedule) == before


def test_a_parts_directory_holding_an_input_is_not_replaced(tmp_path):
    """A directory output (--workers' parts) is replaced whole, so one that holds an input is refused."""
    from sparrow.schemas import ArtifactError, check_output

    parts = tmp_path / "parts"
    parts.mkdir()
    prompts = token_prompts(parts / "p.parquet")
    with pytest.raises(ArtifactError, match="holds .*p.parquet, the --prompts this command reads"):
        check_output(parts, "rollouts", force=True, parts=True, inputs={"--prompts": prompts})
    check_output(tmp_path / "other", "rollouts", force=True, parts=True, inputs={"--prompts": prompts})


def test_calibrate_never_replaces_a_runs_schedule(tmp_path, no_work):
    profile = mismatch(tmp_path / "m.parquet")
    run = tmp_path / "run"
    run.mkdir()
    schedule = write_artifact({"bin": [0], "bin_start": [0], "bin_end": [None], "budget": [64], "tail": [0.9],
                               "predicted_step_seconds": [None]}, run / "schedule.parquet", "schedule",
                              {"page_size": 16})
    before = digest(schedule)
    line = error_line(runner.invoke(app, ["calibrate-threshold", "--profile", str(profile), "--runs",
                                          str(run), "-o", str(schedule), "--force"]))
    assert line == f"error: -o {schedule} is a file of the --runs this command reads; choose another path"
    assert digest(schedule) == before


def test_reward_never_replaces_its_completions(tmp_path):
    prompts = token_prompts(tmp_path / "p.parquet")
    completions = tmp_path / "c.parquet"
    pq.write_table(pa.table({"prompt_id": ["p0"], "text": ["3"]}), completions)  # another sampler's
    before = digest(completions)
    args = ["reward", "--prompts", str(prompts), "--completions", str(completions)]
    line = error_line(runner.invoke(app, [*args, "-o", str(completions), "--force"]))
    assert "is the --completions this command reads" in line
    assert digest(completions) == before


def test_sql_never_replaces_an_artifact_of_the_run_it_reads_but_replaces_a_query_result(tmp_path):
    prompts = token_prompts(tmp_path / "p.parquet")
    before = digest(prompts)
    query = ["sql", "--run", str(tmp_path), "SELECT count(*) AS n FROM prompts"]
    line = error_line(runner.invoke(app, [*query, "-o", str(prompts), "--force"]))
    assert "-o" in line and "--run" in line
    assert digest(prompts) == before
    result_file = tmp_path / "q.parquet"
    for _ in range(2):  # an earlier query result in the run is replaced, as before
        r = runner.invoke(app, [*query, "-o", str(result_file)])
        assert r.exit_code == 0, r.output


def test_sql_never_replaces_another_tools_parquet_file_of_the_run(tmp_path):
    """A pandas- or DuckDB-written Parquet file in the run has a view of its own: the query reads it."""
    scores = tmp_path / "scores.parquet"
    pq.write_table(pa.table({"prompt_id": ["a"], "reward": [1.0]}), scores)
    before = digest(scores)
    line = error_line(runner.invoke(app, ["sql", "--run", str(tmp_path), "SELECT 1 AS a", "-o", str(scores),
                                          "--force"]))
    assert "is a file of the --run this command reads" in line
    assert digest(scores) == before
