"""In a log, a phase whose count moves only when a whole batch ends still says that it runs: teacher-forced
scoring in `profile` and `distill`, and distill's balance weights (a forward pass per taught budget before
any step), which is a phase of its own with a count. The work is slowed here so that a batch outlasts the
heartbeat; the expected lines are written out."""

from __future__ import annotations

import re
import time

import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import write_artifact

from tiny_models import tiny_qwen3

runner = CliRunner()
SCORING = "scoring (sequences)"
BALANCE = "balance weights, the starting objective per taught budget (budgets)"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scoring-progress")
    tiny_qwen3(tmp / "model")
    rows = [{"prompt_id": f"q{i}", "task": "kv_lookup", "prompt": None, "answer": "1", "metadata": None,
             "prompt_token_ids": [3 + (7 * i + j) % 290 for j in range(80)]} for i in range(2)]
    return {"model": str(tmp / "model"), "prompts": str(write_artifact(rows, tmp / "p.parquet", "prompts"))}


@pytest.fixture
def slow_scoring(monkeypatch):
    """Every teacher-forced scoring batch takes 0.6 s more; a log's heartbeat every 0.1 s."""
    import sparrow.cli.distill as distill_cli
    import sparrow.cli.profile as profile_cli
    import sparrow.stages.profile as profile_stage

    real = profile_stage.score_sequences

    def slow(*args, **kwargs):
        time.sleep(0.6)
        return real(*args, **kwargs)

    monkeypatch.setattr(profile_stage, "score_sequences", slow)
    monkeypatch.setattr(profile_cli, "PHASE_BEAT_SECONDS", 0.1)
    monkeypatch.setattr(distill_cli, "PHASE_BEAT_SECONDS", 0.1)


def _beats(lines: list[str], what: str) -> list[int]:
    pattern = re.compile(rf"^{re.escape(what)} \.\.\. \(\d+ s so far\)$")
    return [i for i, line in enumerate(lines) if pattern.match(line)]


def test_profile_scoring_says_it_runs_while_a_batch_scores(files, tmp_path, slow_scoring):
    r = runner.invoke(app, ["profile", "--model", files["model"], "--prompts", files["prompts"], "--budgets",
                            "48", "--samples", "1", "--max-new-tokens", "3",
                            "-o", str(tmp_path / "m.parquet")])
    assert r.exit_code == 0, r.output
    lines = r.stderr.splitlines()
    first = lines.index(f"{SCORING}: 0/2 (0 s)")
    last = next(i for i, line in enumerate(lines) if line.startswith(f"{SCORING}: 2/2 ("))
    beats = _beats(lines, SCORING)
    assert beats and all(first < i < last for i in beats), r.stderr


def test_distill_says_it_measures_the_balance_weights(files, tmp_path, slow_scoring, monkeypatch):
    from sparrow.stages.distill import Distiller

    real = Distiller.step_loss

    def slow(self, *args, **kwargs):
        time.sleep(0.4)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Distiller, "step_loss", slow)
    r = runner.invoke(app, ["distill", "--model", files["model"], "--prompts", files["prompts"], "--budget",
                            "48", "--train-budgets", "48,64", "--eval-budgets", "48", "--samples", "1",
                            "--max-new-tokens", "3", "--steps", "1", "--lora-rank", "2", "-o",
                            str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    lines = r.stderr.splitlines()
    order = [lines.index(line) for line in ("scoring before", "balance weights", f"{BALANCE}: 0/2 (0 s)",
                                            "distilling")]
    assert order == sorted(order), r.stderr
    done = next(i for i, line in enumerate(lines) if line.startswith(f"{BALANCE}: 2/2 ("))
    assert order[2] < done < order[3]
    assert any(order[2] < i < done for i in _beats(lines, BALANCE)), r.stderr
    scoring = _beats(lines, "scoring before (trajectories)")
    assert scoring and all(order[0] < i < order[1] for i in scoring), r.stderr
