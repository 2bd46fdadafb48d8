"""Prompts too long for a run (verl's data.max_prompt_length, data.truncation, data.filter_overlong_prompts;
TRL's max_prompt_length) on `rollout`, `profile` and `train`: refused, cut or left out. The independent
expectations are slices written out here by verl's definition of each cut, and runs over files holding
only the prompts kept (or the prompts already cut); the model is a tiny random Llama (a 512-token context)
with SmolLM2's tokenizer.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import SCHEMAS, artifact_metadata, read_artifact, write_artifact
from sparrow.stages.core.prompt_length import PromptLength

from cli_checks import error_line

runner = CliRunner()
LENGTHS = (300, 60, 90, 200, 40)  # prompt tokens of rows 0-4: rows 0 and 3 are over 150


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dist_helper import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-prompt-length"))[0]


def _rows(lengths=LENGTHS) -> list[dict]:
    """Prompts of a task with a scorer whose token ids are a run of distinct ids, `n` of them in a row."""
    return [{"prompt_id": f"p{i}", "task": "basic_arithmetic", "prompt": f"prompt {i}",
             "prompt_token_ids": [100 + (7 * i + k) % 900 for k in range(n)], "answer": "2", "metadata": None}
            for i, n in enumerate(lengths)]


def _write(rows, path):
    return str(write_artifact(rows, path, "prompts"))


def _rollout(tiny, prompts, out, *extra):
    """One prompt's 2 samples a step: a step holds the same rows whatever else the file has."""
    return runner.invoke(app, ["rollout", "--model", tiny, "--prompts", str(prompts), "--samples", "2",
                               "--max-new-tokens", "6", "--max-num-seqs", "2", "--threads", "1",
                               "-o", str(out), *extra])


def _plain(table: pa.Table) -> pa.Table:
    return SCHEMAS["rollouts"].conform(table, "rollouts", fill_missing=True).replace_schema_metadata(None)


@pytest.mark.parametrize("truncation,kept", [
    ("left", list(range(6, 10))), ("right", [0, 1, 2, 3]), ("middle", [0, 1, 8, 9]),
])
def test_each_cut_keeps_the_tokens_verl_keeps(truncation, kept):
    ids = list(range(10))
    assert PromptLength(4, truncation).cut(ids) == kept
    assert PromptLength(5, "middle").cut(ids) == [0, 1, 7, 8, 9]  # verl: the first n // 2, the last the rest
    assert PromptLength(20, truncation).cut(ids) == ids


def test_left_out_prompts_leave_the_others_samples_as_the_whole_file_gives_them(tiny, tmp_path):
    whole, kept = tmp_path / "whole.parquet", tmp_path / "kept.parquet"
    prompts = _write(_rows(), tmp_path / "prompts.parquet")
    assert _rollout(tiny, prompts, whole).exit_code == 0
    r = _rollout(tiny, prompts, kept, "--max-prompt-length", "150", "--filter-overlong-prompts")
    assert r.exit_code == 0, r.output
    assert "2 prompt(s) longer than 150 tokens (--max-prompt-length 150) left out" in r.stderr
    want = _plain(read_artifact(whole, "rollouts"))
    want = want.filter(pa.compute.is_in(want.column("prompt_id"), pa.array(["p1", "p2", "p4"])))
    assert _plain(read_artifact(kept, "rollouts")).equals(want)
    meta = artifact_metadata(kept)
    recorded = (meta["max_prompt_length"], meta["filter_overlong_prompts"], meta["filtered_prompts"])
    assert recorded == (150, True, 2)


def test_without_a_length_the_filter_leaves_out_what_the_context_cannot_hold(tiny, tmp_path):
    prompts = _write(_rows((60, 509, 40)), tmp_path / "prompts.parquet")
    out = tmp_path / "r.parquet"
    r = _rollout(tiny, prompts, out, "--filter-overlong-prompts")
    assert r.exit_code == 0, r.output
    assert "(the model's context of 512 less --max-new-tokens 6)" in r.stderr
    assert sorted(set(read_artifact(out, "rollouts").column("prompt_id").to_pylist())) == ["p0", "p2"]


@pytest.mark.parametrize("truncation", ["left", "middle"])
def test_cut_prompts_are_sampled_as_a_file_of_the_cut_prompts_is(tiny, tmp_path, truncation):
    rows = _rows()
    cut = [dict(r) for r in rows]
    for r in cut:
        ids = r["prompt_token_ids"]
        if len(ids) > 150:  # verl's cut, written out: the last 150, or the first 75 and the last 75
            r["prompt_token_ids"] = ids[-150:] if truncation == "left" else ids[:75] + ids[-75:]
    out, expected = tmp_path / "r.parquet", tmp_path / "expected.parquet"
    r = _rollout(tiny, _write(rows, tmp_path / "prompts.parquet"), out, "--max-prompt-length", "150",
                 "--truncation", truncation)
    assert r.exit_code == 0, r.output
    assert "2 prompt(s) longer than --max-prompt-length 150 cut to it" in r.stderr
    assert _rollout(tiny, _write(cut, tmp_path / "cut.parquet"), expected).exit_code == 0
    assert _plain(read_artifact(out, "rollouts")).equals(_plain(read_artifact(expected, "rollouts")))
    assert artifact_metadata(out)["truncated_prompts"] == 2


@pytest.mark.parametrize("extra,said", [
    (["--max-prompt-length", "150"], "error: PROMPTS: prompt 'p0' (300 tokens) is longer than "
     "--max-prompt-length 150; --truncation left|right|middle cuts such prompts"),
    (["--max-prompt-length", "10", "--filter-overlong-prompts"], "error: PROMPTS: every prompt is longer "
     "than 10 tokens (--max-prompt-length 10), so --filter-overlong-prompts leaves none to sample"),
    (["--truncation", "left"], "error: --truncation left cuts prompts to --max-prompt-length; give it too"),
    (["--max-prompt-length", "100", "--truncation", "both"], "error: --truncation must be one of error, "
     "left, right, middle, got 'both'"),
    (["--max-prompt-length", "0"], "error: --max-prompt-length must be at least 1, got 0"),
    (["--max-new-tokens", "100000", "--filter-overlong-prompts"], "error: --max-new-tokens 100000 leaves no "
     "room for a prompt in the model's context of CONTEXT tokens; give at most"),
])
def test_a_length_that_cannot_be_met_is_refused_in_one_sentence_before_any_work(tiny, tmp_path, extra, said):
    prompts, out = _write(_rows(), tmp_path / "prompts.parquet"), tmp_path / "r.parquet"
    from sparrow.stages.model.loading import resolve_config

    line = error_line(_rollout(tiny, prompts, out, *extra))
    context = resolve_config(tiny).max_position_embeddings
    assert line.startswith(said.replace("PROMPTS", prompts).replace("CONTEXT", str(context))), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.parquet"]


def test_profile_leaves_out_the_long_prompts_and_refuses_the_flags_on_given_rollouts(tiny, tmp_path):
    prompts, out = _write(_rows(), tmp_path / "prompts.parquet"), tmp_path / "m.parquet"
    base = ["profile", "--model", tiny, "--budgets", "48", "--samples", "1", "--max-new-tokens", "4",
            "--threads", "1"]
    r = runner.invoke(app, [*base, "--prompts", prompts, "--max-prompt-length", "150",
                            "--filter-overlong-prompts", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert sorted(set(read_artifact(out, "mismatch").column("prompt_id").to_pylist())) == ["p1", "p2", "p4"]
    assert artifact_metadata(out)["filtered_prompts"] == 2
    rollouts = tmp_path / "r.parquet"
    assert _rollout(tiny, prompts, rollouts).exit_code == 0
    line = error_line(runner.invoke(app, [*base, "--rollouts", str(rollouts), "--truncation", "left", "-o",
                                          str(tmp_path / "m2.parquet")]))
    assert "--truncation applies only when sampling from --prompts" in line


def test_train_records_the_lengths_and_a_resume_with_others_is_refused(tiny, tmp_path):
    prompts, run = _write(_rows(), tmp_path / "prompts.parquet"), tmp_path / "run"
    base = ["train", "--model", tiny, "--prompts", prompts, "--samples", "2", "--max-new-tokens", "4",
            "--max-prompt-length", "150", "--threads", "1", "--eval-every", "100"]
    line = error_line(runner.invoke(app, [*base, "--filter-overlong-prompts", "--steps", "1",
                                          "--prompts-per-step", "4", "-o", str(run)]))
    assert not run.exists()
    assert line == (f"error: --prompts-per-step 4 is more than the 3 prompts --filter-overlong-prompts keeps "
                    f"of {prompts}; a step would roll out a prompt more than once, so give at most 3")
    r = runner.invoke(app, [*base, "--filter-overlong-prompts", "--steps", "1", "--prompts-per-step", "3",
                            "-o", str(run)])
    assert r.exit_code == 0, r.output
    done = read_artifact(run / "completions" / "step=00001.parquet", "train_completions")
    assert sorted(set(done.column("prompt_id").to_pylist())) == ["p1", "p2", "p4"]
    line = error_line(runner.invoke(app, [*base, "--truncation", "left", "--steps", "2",
                                          "--prompts-per-step", "3", "--resume", "-o", str(run)]))
    assert "was trained with --truncation 'error', not 'left'" in line


def test_distill_leaves_out_the_long_prompts_and_records_it(tiny, tmp_path):
    prompts, out = _write(_rows(), tmp_path / "prompts.parquet"), tmp_path / "adapter"
    r = runner.invoke(app, ["distill", "--model", tiny, "--prompts", prompts, "--budget", "48",
                            "--steps", "1", "--samples", "2", "--max-new-tokens", "4", "--lora-rank", "2",
                            "--threads", "1",
                            "--max-prompt-length", "150", "--filter-overlong-prompts", "-o", str(out)])
    assert r.exit_code == 0, r.output
    before = read_artifact(out / "mismatch" / "before.parquet", "mismatch")
    assert set(before.column("prompt_id").to_pylist()) <= {"p1", "p2", "p4"}
    record = json.loads((out / "sparrow_distill.json").read_text())
    assert record["prompt_lengths"] == {prompts: {"max_prompt_length": 150, "filter_overlong_prompts": True,
                                                  "filtered_prompts": 2}}
