"""The flags around --speculate, --kv-compression and --correction say what they do: --dense beside
--kv-compression is named as itself, --correction takes any case, a draft schedule run with another K than
it was planned for says whose speedup was predicted, a K no cycle can reach is capped with a note, a budget
that covers every cache is refused under --speculate as a dense schedule is, a correction under --speculate
is noted as a no-op, and a rollout's progress gives the time left."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.progress import Progress
from typer.testing import CliRunner

import sparrow.cli.rollout as rollout_cli
import sparrow.cli.train as train_cli
from sparrow.cli.app import app
from sparrow.schemas import write_artifact

from cli_checks import error_line, passed_the_checks

runner = CliRunner()


def token_prompts(path: Path, lengths: list[int]) -> Path:
    """Prompts of these lengths in token ids inside tiny-llama's vocabulary (no tokenizer needed)."""
    rows = [{"prompt_id": f"p{i}", "task": "basic_arithmetic", "prompt": None,
             "prompt_token_ids": list(range(5, 5 + n)), "answer": "3", "metadata": None}
            for i, n in enumerate(lengths)]
    return write_artifact(rows, path, "prompts")


def draft_schedule(path: Path, **meta) -> Path:
    return write_artifact({"bin": [0, 1], "bin_start": [0, 512], "bin_end": [512, None], "budget": [64, 64],
                           "tail": [None, None], "predicted_step_seconds": [None, None]}, path, "schedule",
                          metadata={"page_size": 16, **meta})


def rollout(tmp_path: Path, lengths: list[int], *extra: str):
    prompts = token_prompts(tmp_path / "p.parquet", lengths)
    return runner.invoke(app, ["rollout", "--model", "tiny-llama", "--prompts", str(prompts),
                               "-o", str(tmp_path / "out.parquet"), *extra])


def said(result) -> str:
    return " ".join(result.stderr.split())


# ---------------------------------------------------------------- --kv-compression with --dense

def test_dense_beside_kv_compression_is_named_as_dense_not_block_top_k(tmp_path, no_work):
    result = rollout(tmp_path, [20], "--kv-compression", "snapkv", "--kv-budget", "128", "--dense")
    line = error_line(result)
    assert "--kv-compression and --dense were given together" in line
    assert "block top-k" not in line
    line = error_line(rollout(tmp_path, [20], "--kv-compression", "snapkv", "--kv-budget", "128",
                              "--budget", "64"))
    assert "--kv-compression and --budget were given together" in line and "block top-k" in line


# ---------------------------------------------------------------- train: what reaches the run

@pytest.fixture()
def train_run(monkeypatch, tmp_path):
    """`sparrow train` up to the run itself: the configuration it would train (and what it said)."""
    seen = {}

    def run(cfg, inputs, opts, fmt):
        seen["cfg"] = cfg

    monkeypatch.setattr(train_cli, "_run", run)
    prompts = token_prompts(tmp_path / "train.parquet", [60, 60])

    def invoke(*extra: str):
        result = runner.invoke(app, ["train", "--model", "tiny-llama", "--prompts", str(prompts),
                                     "--steps", "1", "--prompts-per-step", "1", "--samples", "2",
                                     "--max-new-tokens", "8", "-o", str(tmp_path / "run"), *extra])
        assert result.exit_code == 0, result.output
        return seen["cfg"], said(result)

    return invoke


@pytest.mark.parametrize("given", ["TIS", "Tis", "tis"])
def test_correction_takes_any_case_and_keeps_the_lower_case_name(train_run, given):
    cfg, _ = train_run("--correction", given, "--rollout-is", "TOKEN", "--rollout-is-mode", "Mask")
    assert cfg.correction == "tis"
    assert cfg.loss["rollout_is"] == "token" and cfg.loss["rollout_is_mode"] == "mask"


def test_train_notes_that_a_correction_has_nothing_to_correct_under_speculate(train_run):
    _, stderr = train_run("--budget", "48", "--speculate", "2")  # the default correction, tis
    assert "note: --speculate 2 rolls out the dense policy's exact samples" in stderr
    assert "(--correction tis) has nothing to correct" in stderr
    _, stderr = train_run("--budget", "48", "--speculate", "2", "--correction", "none")
    assert "nothing to correct" not in stderr
    _, stderr = train_run("--budget", "48")  # lossy sampling: the correction is the point
    assert "nothing to correct" not in stderr


def test_train_caps_a_speculate_beyond_max_new_tokens(train_run):
    cfg, stderr = train_run("--budget", "48", "--speculate", "100000", "--correction", "none")
    assert cfg.speculate == 6  # 8 new tokens: the first from the prefill, one per cycle verified
    assert "note: --speculate 100000 is capped at 6" in stderr
    cfg, stderr = train_run("--budget", "48", "--speculate", "6", "--correction", "none")
    assert cfg.speculate == 6 and "capped" not in stderr


# ---------------------------------------------------------------- rollout --speculate

def test_rollout_caps_a_speculate_beyond_max_new_tokens(tmp_path, no_work):
    result = rollout(tmp_path, [70], "--budget", "64", "--speculate", "100000", "--max-new-tokens", "8")
    assert passed_the_checks(result), result.output
    assert "note: --speculate 100000 is capped at 6: with --max-new-tokens 8" in said(result)
    result = rollout(tmp_path, [70], "--budget", "64", "--speculate", "6", "--max-new-tokens", "8")
    assert passed_the_checks(result) and "capped" not in said(result)


def test_a_budget_covering_every_cache_is_refused_under_speculate(tmp_path, no_work):
    # 61 prompt tokens + 4 new: the fourth token's step reads 64 cached tokens, all within --budget 64
    line = error_line(rollout(tmp_path, [20, 61], "--budget", "64", "--speculate", "2",
                              "--max-new-tokens", "4"))
    assert "--budget 64 covers every sample's cache" in line and "at most 64 tokens" in line
    assert "--speculate would draft with the dense model itself" in line
    # the suggested budget is one a rollout takes (a multiple of 16 below 64, at least 48), not 63
    assert line.endswith("give a --budget of at most 48 (a multiple of 16), or drop --speculate")
    # one token more: its last step reads 65 tokens, 64 of them selected, so it drafts sparsely; the
    # 20-token prompt's whole cache is within the budget, which a warning says
    result = rollout(tmp_path, [20, 62], "--budget", "64", "--speculate", "2", "--max-new-tokens", "4")
    assert passed_the_checks(result), result.output
    assert ("warning: --budget 64 covers the whole cache of 1 of 2 prompts (up to 61 prompt tokens with "
            "--max-new-tokens 4), where --speculate drafts with the dense model itself") in said(result)
    result = rollout(tmp_path, [62, 70], "--budget", "64", "--speculate", "2", "--max-new-tokens", "4")
    assert passed_the_checks(result) and "covers the whole cache" not in said(result)
    result = rollout(tmp_path, [20, 61], "--budget", "64", "--max-new-tokens", "4")  # lossy: dense is fine
    assert passed_the_checks(result), result.output


def test_a_draft_schedule_run_with_another_k_says_whose_speedup_was_predicted(tmp_path, no_work):
    schedule = draft_schedule(tmp_path / "drafts.parquet", speculate=1, predicted_speedup=1.25)
    result = rollout(tmp_path, [20], "--schedule", str(schedule), "--speculate", "4", "--max-new-tokens", "8")
    assert passed_the_checks(result), result.output
    assert (f"note: --schedule {schedule} was planned for --speculate 1 (plan-schedule --speculate); its "
            "predicted speedup (1.250x) is for K = 1, not for K = 4") in said(result)
    result = rollout(tmp_path, [20], "--schedule", str(schedule), "--speculate", "1", "--max-new-tokens", "8")
    assert passed_the_checks(result) and "planned for" not in said(result)


# ---------------------------------------------------------------- the time left

@pytest.mark.parametrize("exact,word", [(False, "at most"), (True, "about")])
def test_rollout_progress_gives_the_time_left_at_the_token_rate(monkeypatch, exact, word):
    clock = iter([100.0, 110.0, 130.0])
    monkeypatch.setattr(rollout_cli.time, "perf_counter", lambda: next(clock))
    with Progress(disable=True) as progress:
        bars = rollout_cli._Bars(progress, "rollouts (samples)", total=4, rate=True, most_tokens=10,
                                 exact=exact)
        bars.advance(0, 0)  # the first step: the clock starts
        bars.advance(1, 20)  # 20 tokens in 10 s: 2 tok/s; 4 x 10 - 20 = 20 tokens at most remain -> 10 s
        assert progress.tasks[0].fields["rate"] == f"20 tokens, 2.0 tok/s, {word} 0:00:10 left"
        # 3 samples done, 36 tokens in 30 s: 1.2 tok/s; at most min(40 - 36, 1 x 10) = 4 tokens -> 3.3 s
        bars.advance(2, 16)
        assert progress.tasks[0].fields["rate"] == f"36 tokens, 1.2 tok/s, {word} 0:00:03 left"


def test_a_long_prompt_says_what_the_first_step_does_before_it(tmp_path, no_work, monkeypatch):
    """Progress shows after each engine step, and the first one prefills the prompts: a long one is said."""
    monkeypatch.setattr(rollout_cli, "LONG_PREFILL_NOTE", 40)
    r = rollout(tmp_path, [12, 41, 30], "--max-new-tokens", "4")
    assert "the first step prefills prompts of up to 41 tokens; progress follows it" in said(r)
    r = rollout(tmp_path, [12, 39], "--max-new-tokens", "4")
    assert "loading model" in said(r) and "prefills" not in said(r)


def test_a_cycle_with_no_room_to_draft_is_said_to_draft_nothing():
    from sparrow.cli.options import capped_speculate

    said: list[str] = []
    assert capped_speculate(3, 2, said.append) == 1  # one prefill token, one verified: no draft between
    assert said == [s for s in said if "drafts nothing" in s and "capped" not in s] and len(said) == 1
