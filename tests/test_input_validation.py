"""Bad input is one sentence and a non-zero exit before any work, and nothing on disk is lost or left
half-written: each test runs the CLI as a user does and checks the exit code, the sentence and what is
left on disk."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_kind, read_artifact, write_artifact

from cli_checks import error_line, passed_the_checks
from tiny_models import tiny_chat_llama, tiny_qwen3

runner = CliRunner()
TINY_LLAMA_CONTEXT = 2048  # the tiny-llama preset's max_position_embeddings


def token_prompts(path: Path, ids: list[str] = ("p0", "p1"), lengths: list[int] | None = None) -> Path:
    """Prompts with token ids inside tiny-llama's vocabulary (no tokenizer needed)."""
    lengths = lengths or [20] * len(ids)
    rows = [{"prompt_id": pid, "task": "basic_arithmetic", "prompt": "" if n == 0 else None,
             "prompt_token_ids": list(range(5, 5 + n)), "answer": "3", "metadata": None}
            for pid, n in zip(ids, lengths)]
    return write_artifact(rows, path, "prompts")


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("rollouts")
    out = folder / "r.parquet"
    result = runner.invoke(app, ["rollout", "--model", "tiny-llama", "--prompts",
                                 str(token_prompts(folder / "p.parquet")), "--max-new-tokens", "2",
                                 "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> str:
    return tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat"))


def rollout_args(prompts: Path, out: Path, *extra: str) -> list[str]:
    return ["rollout", "--model", "tiny-llama", "--prompts", str(prompts), "--max-new-tokens", "2",
            "-o", str(out), *extra]


def train_args(model: str, prompts: Path, run: Path, *extra: str) -> list[str]:
    return ["train", "--model", model, "--prompts", str(prompts), "--steps", "1", "--prompts-per-step", "1",
            "--samples", "2", "--max-new-tokens", "2", "-o", str(run), *extra]


# ---------------------------------------------------------------- numbers


@pytest.mark.parametrize("command,flag,value", [
    ("rollout", "--temperature", "nan"), ("rollout", "--temperature", "inf"), ("rollout", "--top-p", "nan"),
    ("train", "--temperature", "inf"), ("train", "--temperature", "nan"), ("train", "--lr", "inf"),
    ("train", "--kl-coef", "nan"), ("profile", "--quantile", "nan"),
])
def test_a_float_that_is_not_finite_is_one_sentence(tmp_path, no_work, command, flag, value):
    prompts, out = token_prompts(tmp_path / "p.parquet"), tmp_path / "out"
    args = (rollout_args(prompts, out) if command == "rollout" else
            train_args("tiny-llama", prompts, out) if command == "train" else
            ["profile", "--model", "tiny-llama", "--prompts", str(prompts), "-o", str(out)])
    result = runner.invoke(app, [*args, flag, value])
    assert result.exit_code == 2
    assert error_line(result) == f"error: {flag} must be a finite number, got {value}"
    assert not out.exists()


@pytest.mark.parametrize("command", ["rollout", "train"])
def test_a_budget_beyond_the_context_is_one_sentence(tmp_path, no_work, command):
    prompts, out = token_prompts(tmp_path / "p.parquet"), tmp_path / "out"
    args = rollout_args(prompts, out) if command == "rollout" else train_args("tiny-llama", prompts, out)
    result = runner.invoke(app, [*args, "--budget", "1000000000000"])
    assert result.exit_code == 2
    assert error_line(result).startswith(f"error: --budget 1000000000000 exceeds the context of tiny-llama "
                                         f"({TINY_LLAMA_CONTEXT} tokens)")
    assert not out.exists()  # no run directory, no empty metrics.jsonl


def test_profile_budgets_beyond_the_context_are_refused_before_scoring(tmp_path, rollouts, no_work):
    out = tmp_path / "m.parquet"
    result = runner.invoke(app, ["profile", "--model", "tiny-llama", "--rollouts", str(rollouts),
                                 "--budgets", "48,1000000000000", "-o", str(out)])
    assert result.exit_code == 2
    assert error_line(result).startswith("error: --budgets 1000000000000 exceeds the context of tiny-llama")
    assert not out.exists()


@pytest.mark.parametrize("flag,value,expected", [
    ("--quantile", "1.5", "error: --quantile: the tail quantile must be in (0, 1), got 1.5"),
    ("--threshold", "2", "error: --threshold: the threshold must be in (0, 1), got 2"),
])
def test_profile_checks_its_summary_flags_before_any_work(tmp_path, rollouts, no_work, flag, value, expected):
    out = tmp_path / "m.parquet"
    result = runner.invoke(app, ["profile", "--model", "tiny-llama", "--rollouts", str(rollouts), flag, value,
                                 "-o", str(out)])
    assert result.exit_code == 2 and error_line(result) == expected
    assert not out.exists()


@pytest.mark.parametrize("extra,expected", [
    (["--temperature", "-1"], "error: --temperature must be >= 0, got -1.0"),
    (["--lora-rank", "0"], "error: --lora-rank must be at least 1, got 0; for full fine-tuning pass --full"),
    (["--samples", "1"], "error: --samples must be at least 2, got 1: GRPO's advantage is a sample's reward "
                         "against its group's, so a group of one sample learns nothing"),
    (["--samples", "0"], "error: --samples must be at least 2, got 0: GRPO's advantage is a sample's reward "
                         "against its group's, so a group of one sample learns nothing"),
    (["--temperature", "0"], "error: --temperature must be above 0, got 0: greedy samples of a prompt are "
                             "all the same, so no group has a reward spread for GRPO's advantage to learn "
                             "from"),
    (["--prompts-per-step", "5"], "error: --prompts-per-step 5 is more than the 2 prompts of {prompts}; a "
                                  "step would roll out a prompt more than once, so give at most 2"),
])
def test_train_refuses_settings_that_cannot_train(tmp_path, no_work, extra, expected):
    run, prompts = tmp_path / "run", token_prompts(tmp_path / "p.parquet")
    result = runner.invoke(app, [*train_args("tiny-llama", prompts, run), *extra])
    assert result.exit_code == 2 and error_line(result) == expected.format(prompts=prompts)
    assert not run.exists()


def sampling_stage_args(command: str, prompts: Path, out: Path) -> list[str]:
    """A run of one of the stages that sample (rollout, profile, train, distill) on tiny-llama."""
    return {"rollout": rollout_args(prompts, out),
            "profile": ["profile", "--model", "tiny-llama", "--prompts", str(prompts), "-o", str(out)],
            "train": train_args("tiny-llama", prompts, out),
            "distill": ["distill", "--model", "tiny-llama", "--prompts", str(prompts), "--budget", "48",
                        "-o", str(out)]}[command]


@pytest.mark.parametrize("command", ["rollout", "profile", "train", "distill"])
def test_a_negative_seed_is_one_sentence_before_any_work(tmp_path, no_work, command):
    prompts, out = token_prompts(tmp_path / "p.parquet"), tmp_path / "out"
    args = sampling_stage_args(command, prompts, out)
    result = runner.invoke(app, [*args, "--seed", "-5"])
    assert result.exit_code == 2 and error_line(result) == "error: --seed must be >= 0, got -5"
    assert not out.exists()


@pytest.mark.parametrize("command", ["rollout", "profile", "train", "distill"])
def test_a_temperature_too_small_to_divide_by_is_one_sentence_before_any_work(tmp_path, no_work, command):
    # below the engine's floor of 1e-6, logits / T can overflow float32 (NaN logprobs); 0 is greedy
    prompts, out = token_prompts(tmp_path / "p.parquet"), tmp_path / "out"
    args = sampling_stage_args(command, prompts, out)
    result = runner.invoke(app, [*args, "--temperature", "1e-8"])
    expected = ("error: --temperature must be at least 1e-06, got 1e-08" if command == "train" else
                "error: --temperature must be 0 (greedy) or at least 1e-06, got 1e-08")
    assert result.exit_code == 2 and error_line(result) == expected
    assert not out.exists()


@pytest.mark.parametrize("command", ["rollout", "train"])
def test_speculation_without_a_sparse_drafter_is_refused(tmp_path, no_work, command):
    prompts, out = token_prompts(tmp_path / "p.parquet"), tmp_path / "out"
    args = rollout_args(prompts, out) if command == "rollout" else train_args("tiny-llama", prompts, out)
    for extra in ([], ["--dense"]):
        result = runner.invoke(app, [*args, *extra, "--speculate", "3"])
        assert result.exit_code == 2
        assert error_line(result) == ("error: --speculate drafts with block top-k attention (--budget or "
                                      "--schedule), not with dense attention; give --budget or --schedule")
    assert not out.exists()


def _schedule(path: Path, budgets: list[int | None], **meta) -> Path:
    """A two-bin schedule artifact (bins of 512 tokens) with these budgets and extra metadata."""
    return write_artifact({"bin": [0, 1], "bin_start": [0, 512], "bin_end": [512, None], "budget": budgets,
                           "tail": [None, None], "predicted_step_seconds": [None, None]}, path, "schedule",
                          metadata={"page_size": 16, **meta})


@pytest.mark.parametrize("command", ["rollout", "train"])
def test_speculation_with_a_schedule_dense_in_every_bin_is_refused(tmp_path, no_work, command):
    """A dense draft is the verification's own work: all cost and no gain, as --dense --speculate is."""
    prompts, out = token_prompts(tmp_path / "p.parquet"), tmp_path / "out"
    schedule = _schedule(tmp_path / "s.parquet", [None, None])  # a null budget is a dense bin
    args = rollout_args(prompts, out) if command == "rollout" else train_args("tiny-llama", prompts, out)
    result = runner.invoke(app, [*args, "--schedule", str(schedule), "--speculate", "2"])
    assert result.exit_code == 2
    assert error_line(result) == (f"error: --schedule {schedule} is dense in every bin, so --speculate would "
                                  "draft with the dense model itself; give a sparse schedule or --budget, or "
                                  "drop --speculate")
    assert not out.exists()


def test_speculation_with_a_sparse_actor_adapter_is_refused(tmp_path, no_work):
    """A DistillSparse adapter adapts the sparse actor only; merged, it would verify too, and the samples
    would not be the dense model's."""
    prompts, out = token_prompts(tmp_path / "p.parquet"), tmp_path / "out.parquet"
    adapter = tmp_path / "actor"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "sparrow_distill.json").write_text("{}")
    result = runner.invoke(app, rollout_args(prompts, out, "--budget", "48", "--speculate", "2",
                                             "--adapter", str(adapter)))
    assert result.exit_code == 2 and "--speculate verifies with the dense model" in error_line(result)
    assert str(adapter) in error_line(result) and not out.exists()


def test_a_draft_schedule_without_speculate_is_warned_about(tmp_path):
    """plan-schedule --speculate's drafts were planned with no tail threshold: as a lossy schedule they run,
    with one warning that says what to add."""
    prompts, out = token_prompts(tmp_path / "p.parquet"), tmp_path / "out.parquet"
    schedule = _schedule(tmp_path / "drafts.parquet", [64, 64], speculate=3)
    result = runner.invoke(app, rollout_args(prompts, out, "--schedule", str(schedule)))
    assert result.exit_code == 0, result.output
    assert f"--schedule {schedule} holds draft budgets for --speculate 3" in " ".join(result.stderr.split())
    result = runner.invoke(app, rollout_args(prompts, tmp_path / "spec.parquet", "--schedule", str(schedule),
                                             "--speculate", "3"))
    assert result.exit_code == 0 and "draft budgets" not in result.stderr


def test_speculation_with_a_schedule_dense_in_some_bins_is_warned_about(tmp_path):
    prompts, out = token_prompts(tmp_path / "p.parquet"), tmp_path / "out.parquet"
    schedule = _schedule(tmp_path / "s.parquet", [64, None])
    result = runner.invoke(app, rollout_args(prompts, out, "--schedule", str(schedule), "--speculate", "2"))
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert f"--schedule {schedule} is dense in bin 1, where --speculate drafts with the dense model" in said


def test_speculation_with_workers_is_refused_before_ray_is_looked_for(tmp_path, no_work):
    prompts, out = token_prompts(tmp_path / "p.parquet"), tmp_path / "out"
    result = runner.invoke(app, train_args("tiny-llama", prompts, out, "--budget", "48", "--speculate", "2",
                                           "--workers", "2"))
    assert result.exit_code == 2
    assert error_line(result) == "error: --speculate runs in this process's engine; drop --workers"
    assert not out.exists()


def test_profile_refuses_a_budget_given_twice(tmp_path, no_work):
    out = tmp_path / "m.parquet"
    result = runner.invoke(app, ["profile", "--model", "tiny-llama", "--prompts",
                                 str(token_prompts(tmp_path / "p.parquet")), "--budgets", "64,128,64",
                                 "-o", str(out)])
    assert result.exit_code == 2
    assert error_line(result) == "error: --budgets lists 64 more than once; give each budget once"
    assert not out.exists()


def test_more_samples_than_memory_can_hold_are_refused(tmp_path, no_work):
    out = tmp_path / "r.parquet"
    result = runner.invoke(app, rollout_args(token_prompts(tmp_path / "p.parquet"), out,
                                             "--samples", "1000000000"))
    assert result.exit_code == 2
    line = error_line(result)
    assert line.startswith("error: 2,000,000,000 samples (--samples 1000000000 for 2 prompts) need at least "
                           f"{2 * 10**9 * 4096 // 2**30:,} GiB of memory")
    assert not out.exists()


def test_samples_whose_tokens_and_first_draws_cannot_fit_are_refused(tmp_path, no_work, monkeypatch):
    import sparrow.cli.options as options

    monkeypatch.setattr(options, "host_memory", lambda: 64 * 2**30)
    out, samples = tmp_path / "r.parquet", 1_000_000
    args = rollout_args(token_prompts(tmp_path / "p.parquet"), out, "--samples", str(samples))
    result = runner.invoke(app, [*args, "--model", "smollm2-135m"])
    assert result.exit_code == 2
    prompt, sampled = samples * 2 * 20, samples * 2 * 2  # 2 prompts of 20 tokens, --max-new-tokens 2
    tokens = prompt + sampled
    # a token id of 4 bytes, a sampled token of 16 (id, logprob, budget, KV length), an fp32 score a word
    need = (prompt * 4 + sampled * 16 + samples * 49152 * 4) / 2**30
    assert error_line(result) == (
        f"error: --samples {samples} for 2 prompts with --max-new-tokens 2 need at least {need:,.0f} GiB of "
        f"memory (their {tokens:,} tokens, and 49,152 first-token scores per sample, one per vocabulary "
        "entry), more than this machine's 64 GiB; roll out fewer samples per call, or fewer prompts "
        "(--max-prompts, or several prompt files)")
    assert not out.exists()


def test_more_prompts_than_memory_can_hold_are_refused(tmp_path, monkeypatch):
    import sparrow.cli.prompts as prompts_cli

    def refuse(*a, **k):
        raise AssertionError("prompts were generated before the refusal")

    monkeypatch.setattr(prompts_cli, "make_prompts", refuse)
    out = tmp_path / "p.parquet"
    result = runner.invoke(app, ["prompts", "--task", "chain_sum", "--n", "100000000", "-o", str(out)])
    assert result.exit_code == 2
    assert error_line(result).startswith("error: 100,000,000 prompts (--n) need at least 381 GiB of memory")
    assert not out.exists()


# ---------------------------------------------------------------- models


def test_checkpoints_that_cannot_be_read_are_one_sentence(tmp_path, no_work):
    prompts = token_prompts(tmp_path / "p.parquet")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 512, "n_embd": 64}')
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(os.urandom(4096))
    truncated = tmp_path / "truncated"
    tiny_qwen3(truncated)
    weights = truncated / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    cases = {gpt2: f"error: {gpt2 / 'config.json'}: model_type 'gpt2' is not supported",
             garbage: f"error: {garbage} cannot be read as a GGUF model",
             truncated: f"error: {weights} is not a complete safetensors file"}
    for model, expected in cases.items():
        out = tmp_path / "r.parquet"
        result = runner.invoke(app, ["rollout", "--model", str(model), "--prompts", str(prompts), "-o",
                                     str(out)])
        assert result.exit_code == 2, result.output
        assert error_line(result).startswith(expected)
        assert not out.exists()


def test_a_model_without_a_tokenizer_is_warned_of(tmp_path):
    out = tmp_path / "r.parquet"
    result = runner.invoke(app, rollout_args(token_prompts(tmp_path / "p.parquet"), out))
    assert result.exit_code == 0, result.output
    assert ("warning: --model tiny-llama has no tokenizer, so the samples have no text and their task's "
            "scorer cannot reward them") in result.stderr
    assert read_artifact(out, "rollouts").column("reward").to_pylist() == [None, None]


# ---------------------------------------------------------------- prompt files


def test_duplicate_prompt_ids_are_refused_naming_the_file_and_the_id(tmp_path, no_work):
    prompts, out = token_prompts(tmp_path / "p.parquet", ids=["a", "b", "a"]), tmp_path / "r.parquet"
    result = runner.invoke(app, rollout_args(prompts, out))
    assert result.exit_code == 2
    assert error_line(result) == f"error: {prompts}: prompt_id 'a' appears in rows 0 and 2 (counting from " \
                                 "0); each prompt needs its own id"
    assert not out.exists()


def test_an_empty_prompt_is_refused_naming_the_file_and_the_row(tmp_path, no_work):
    prompts, out = token_prompts(tmp_path / "p.parquet", lengths=[20, 0]), tmp_path / "r.parquet"
    result = runner.invoke(app, rollout_args(prompts, out))
    assert result.exit_code == 2
    assert error_line(result) == f"error: {prompts}: prompt 'p1', row 1 (counting from 0), is empty: it " \
                                 "has no token ids and no text"
    assert not out.exists()


def test_an_error_in_stdin_names_stdin_not_a_private_copy(tmp_path, no_work):
    lines = "".join(f'{{"prompt_id": "a", "task": "basic_arithmetic", "prompt_token_ids": [5, 6, 7], '
                    f'"answer": "{i}"}}\n' for i in range(2))
    out = tmp_path / "r.parquet"
    result = runner.invoke(app, rollout_args(Path("-"), out), input=lines)
    assert result.exit_code == 2
    assert error_line(result) == "error: - (stdin): prompt_id 'a' appears in rows 0 and 1 (counting from " \
                                 "0); each prompt needs its own id"


def test_an_empty_prompts_path_is_refused_as_empty(tmp_path, no_work, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the working directory, which an empty path would otherwise name
    result = runner.invoke(app, ["rollout", "--model", "tiny-llama", "--prompts", "", "-o", "r.parquet"])
    assert result.exit_code == 2
    assert error_line(result) == "error: --prompts is an empty path; give a file (- = stdin)"
    assert files_under(tmp_path) == []


@pytest.mark.parametrize("args, wanted", [
    (["rollout", "--model", "tiny-llama", "--prompts", "p.parquet"], "a file path such as out.parquet"),
    (["reward", "--prompts", "p.parquet", "--completions", "c.parquet"], "a file path such as out.parquet"),
    (["prompts", "--task", "kv_lookup", "--n", "1"], "a file path such as out.parquet"),
    (["fit-cost", "--hardware", "h100"], "a file path such as out.parquet"),
    (["sql", "SELECT 1"], "a file path such as out.parquet"),
    (["report", "."], "a folder"),
    (["distill", "--rollouts", "r.parquet", "--budget", "64"], "an adapter directory"),
])
def test_an_empty_output_path_is_refused_as_empty(tmp_path, no_work, monkeypatch, args, wanted):
    """-o '' would be the working directory: every stage refuses it as an empty path, before any work."""
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, [*args, "-o", ""])
    assert result.exit_code == 2
    assert error_line(result).startswith(f"error: -o is an empty path; give {wanted}")
    assert files_under(tmp_path) == []


def test_rollout_warns_of_a_task_without_a_scorer_and_still_samples(tmp_path):
    from sparrow.stages.tasks import TASKS

    prompts, out = tmp_path / "p.parquet", tmp_path / "r.parquet"
    write_artifact([{"prompt_id": f"p{i}", "task": "nosuchtask", "prompt": None,
                     "prompt_token_ids": list(range(5, 25)), "answer": "3", "metadata": None}
                    for i in range(2)], prompts, "prompts")
    result = runner.invoke(app, rollout_args(prompts, out))
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: {prompts}: task 'nosuchtask' (2 prompts) has no scorer, so their samples "
                        f"get no reward (known tasks: {', '.join(TASKS)})"]
    assert read_artifact(out, "rollouts").num_rows == 2


def test_train_warns_when_eval_prompts_are_also_training_prompts(tmp_path, tiny_chat, no_work):
    prompts = token_prompts(tmp_path / "p.parquet")
    held_out = token_prompts(tmp_path / "e.parquet", ids=["e0", "e1"], lengths=[20, 21])  # e0 is p0's ids
    result = runner.invoke(app, [*train_args(tiny_chat, prompts, tmp_path / "run"), "--eval-prompts",
                                 str(held_out)])
    assert isinstance(result.exception, AssertionError)  # warned before the model loads
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: 1 of the 2 --eval-prompts ({held_out}) are also in --prompts ({prompts}), "
                        "by their text, so the eval accuracy is not held out"]


def test_profile_warns_that_random_weights_replace_a_models_own(tmp_path, no_work):
    prompts, out = token_prompts(tmp_path / "p.parquet"), tmp_path / "m.parquet"
    args = ["profile", "--prompts", str(prompts), "--budgets", "64", "--random-weights", "-o", str(out)]
    warned = runner.invoke(app, [*args, "--model", "smollm2-135m"])
    assert isinstance(warned.exception, AssertionError)  # warned before the model loads
    assert [line for line in warned.stderr.splitlines() if line.startswith("warning:")] == [
        "warning: --random-weights replaces the weights of smollm2-135m with random ones, so this profile "
        "times the scoring and measures its memory, but its mismatch is not the model's: plan no schedule "
        "from it; the flag is for shapes-only presets such as qwen3-4b"]
    random_anyway = runner.invoke(app, [*args, "--model", "tiny-llama"])  # a preset without weights
    assert isinstance(random_anyway.exception, AssertionError) and "warning:" not in random_anyway.stderr


# ---------------------------------------------------------------- output paths


def test_a_dangling_symlink_creates_no_folders(tmp_path, no_work):
    link = tmp_path / "out.parquet"
    link.symlink_to(tmp_path / "missing" / "sub" / "r.parquet")
    result = runner.invoke(app, rollout_args(token_prompts(tmp_path / "p.parquet"), link))
    assert result.exit_code != 0
    folder = tmp_path / "missing" / "sub"
    assert error_line(result) == (f"error: {link} is a symlink to {folder / 'r.parquet'}, whose folder "
                                  f"{folder} does not exist; a symlink is written through, so create that "
                                  "folder or give another path")
    assert link.is_symlink() and not (tmp_path / "missing").exists()


def test_a_symlink_loop_is_refused_and_left_as_it_was(tmp_path, no_work):
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    a.symlink_to(b)
    b.symlink_to(a)
    result = runner.invoke(app, rollout_args(token_prompts(tmp_path / "p.parquet"), a))
    assert result.exit_code != 0
    assert error_line(result).startswith(f"error: {a} is a symlink that loops back on itself")
    assert a.is_symlink() and b.is_symlink() and os.readlink(a) == str(b)


def test_train_refuses_a_directory_of_other_files_without_force(tmp_path, no_work):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    result = runner.invoke(app, train_args("tiny-llama", token_prompts(tmp_path / "p.parquet"), mine))
    assert result.exit_code == 2
    assert error_line(result) == (f"error: {mine} holds files that are not a training run's (such as "
                                  "notes.txt); pass --force to start a run among them (they are kept), or "
                                  "choose another --output-dir")
    assert files_under(mine) == ["notes.txt"] and (mine / "notes.txt").read_text() == "mine"


def test_train_keeps_a_planned_schedule_in_a_directory_that_holds_no_run(tmp_path, no_work):
    from sparrow.stages.core.schedule import Schedule
    from sparrow.stages.train.config import TrainConfig
    from sparrow.stages.train.metrics import write_schedule
    from sparrow.stages.train.run_dir import check_run_dir

    folder = tmp_path / "mine"
    planned = folder / "schedule.parquet"
    write_artifact({"bin": [0], "bin_start": [0], "bin_end": [None], "budget": [64], "tail": [0.9],
                    "predicted_step_seconds": [None]}, planned, "schedule",
                   metadata={"model": "tiny-llama", "page_size": 16, "threshold": 0.5})
    before = planned.read_bytes()
    result = runner.invoke(app, train_args("tiny-llama", token_prompts(folder / "p.parquet"), folder))
    assert result.exit_code == 2
    assert error_line(result) == (f"error: {planned} is a schedule that no training run wrote, and a run in "
                                  f"{folder} writes its own schedule.parquet there; pass --force to replace "
                                  "it, or choose another run directory (-o)")
    assert planned.read_bytes() == before and files_under(folder) == ["p.parquet", "schedule.parquet"]
    write_schedule(folder, Schedule.constant(0), "dense")  # a run's own (one that stopped before a step)
    check_run_dir(folder, TrainConfig(model="tiny-llama"), resume=False)


def test_train_refuses_to_replace_a_metrics_jsonl_it_did_not_write(tmp_path):
    """metrics.jsonl is a common name for a log of one's own: a run replaces only its own, or with
    --force."""
    from sparrow.stages.train.config import TrainConfig
    from sparrow.stages.train.run_dir import check_run_dir

    folder = tmp_path / "mine"
    folder.mkdir()
    log = folder / "metrics.jsonl"
    log.write_text("my own log\n")
    result = runner.invoke(app, train_args("tiny-llama", token_prompts(tmp_path / "p.parquet"), folder))
    assert result.exit_code == 2
    assert error_line(result) == (f"error: {log} exists and is not a training run's metrics log (a JSON line "
                                  "per step), and the run would replace it; pass --force to replace it, or "
                                  "choose another run directory (-o)")
    assert log.read_text() == "my own log\n"
    check_run_dir(folder, TrainConfig(model="tiny-llama"), resume=False, force=True)
    log.write_text('{"run_id": "mine", "step": 0, "reward_mean": null}\n')  # a run's own
    check_run_dir(folder, TrainConfig(model="tiny-llama"), resume=False)


# ---------------------------------------------------------------- SIGTERM


@pytest.fixture()
def sigterm_fails_the_test():
    """Where SIGTERM were not handled by the command, it would kill pytest: fail the test instead."""

    def unhandled(signum, frame):
        raise AssertionError("SIGTERM reached the test's own handler: the command did not handle it")

    previous = signal.signal(signal.SIGTERM, unhandled)
    yield
    signal.signal(signal.SIGTERM, previous)


def terminate_self(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    raise AssertionError("SIGTERM did not stop the command")


def test_sigterm_is_an_interrupt_that_writes_nothing(tmp_path, monkeypatch, sigterm_fails_the_test):
    import sparrow.stages.model.loading as loading

    monkeypatch.setattr(loading, "load_model", terminate_self)
    out = tmp_path / "r.parquet"
    result = runner.invoke(app, rollout_args(token_prompts(tmp_path / "p.parquet"), out))
    assert result.exit_code == 143
    # a rollout to a file journals its finished prompts: none had finished, so neither journal nor file
    assert result.stderr.strip().splitlines()[-1] == (
        "terminated; no prompt had been journaled yet, so nothing was kept")
    assert files_under(tmp_path) == ["p.parquet"]


def test_sigterm_during_training_keeps_a_resumable_run_and_no_empty_file(tiny_chat, tmp_path, monkeypatch,
                                                                          sigterm_fails_the_test):
    from sparrow.stages.train.trainer import Trainer

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_id": "a", "task": "basic_arithmetic", "prompt": "1 + 2 =", "answer": "3"}\n')
    monkeypatch.setattr(Trainer, "experience", terminate_self)
    run = tmp_path / "run"
    result = runner.invoke(app, train_args(tiny_chat, prompts, run, "--steps", "3"))
    assert result.exit_code == 143, result.output
    assert result.stderr.strip().splitlines()[-1] == (
        f"terminated; {run}/checkpoint holds the 0 complete steps of 3; add --resume to the same command to "
        "continue")
    assert not (run / "metrics.jsonl").exists()
    assert [f for f in files_under(run) if (run / f).is_file() and (run / f).stat().st_size == 0] == []
    assert artifact_kind(run / "schedule.parquet") == "schedule"


def test_train_refuses_samples_a_step_cannot_hold_before_writing(tmp_path, no_work, monkeypatch):
    import sparrow.cli.options as options

    monkeypatch.setattr(options, "host_memory", lambda: 64 * 2**30)
    run, samples = tmp_path / "run", 1_000_000
    prompts = token_prompts(tmp_path / "p.parquet", lengths=[20, 30])
    result = runner.invoke(app, [*train_args("smollm2-135m", prompts, run), "--samples", str(samples)])
    assert result.exit_code == 2
    prompt, sampled = samples * 20, samples * 2  # a step's one prompt (the shortest), --max-new-tokens 2
    need = (prompt * 4 + sampled * 16 + samples * 49152 * 4) / 2**30
    assert error_line(result) == (
        f"error: --samples {samples} for 1 prompt with --max-new-tokens 2 need at least {need:,.0f} GiB of "
        f"memory (their {prompt + sampled:,} tokens, and 49,152 first-token scores per sample, one per "
        "vocabulary entry), more than this machine's 64 GiB; train with fewer --samples (or --oversample) or "
        "--prompts-per-step")
    assert not run.exists()


def test_an_empty_train_output_is_refused_as_empty(tmp_path, no_work, monkeypatch):
    prompts = token_prompts(tmp_path / "p.parquet")
    monkeypatch.chdir(tmp_path)  # the working directory, which an empty path would otherwise name
    result = runner.invoke(app, [*train_args("tiny-llama", prompts, Path("x"))[:-1], ""])
    assert result.exit_code == 2
    assert error_line(result) == "error: -o is an empty path; give a run directory"
    assert files_under(tmp_path) == ["p.parquet"]


# ---------------------------------------------------------------- the rest of a demanding user's inputs


def _float_options() -> list[tuple[str, str]]:
    """(command, option) for every float option of every command, read off the CLI itself."""
    import typer.main

    group = typer.main.get_command(app)
    found = []
    for name, command in sorted(group.commands.items()):
        for param in command.params:
            if getattr(param, "opts", None) and param.bare_type() == "float":
                found.append((name, param.opts[0]))
    return found


@pytest.mark.parametrize("command,flag", _float_options())
def test_every_float_option_refuses_nan_as_it_is_read(no_work, command, flag):
    result = runner.invoke(app, [command, flag, "nan"])
    assert result.exit_code == 2, result.output
    assert error_line(result).startswith(f"error: {flag} must be ")
    assert "nan" in error_line(result)


@pytest.mark.parametrize("value", ["inf", "1e30", "-1"])
def test_sql_timeout_beyond_what_a_timer_takes_is_one_sentence(tmp_path, value):
    result = runner.invoke(app, ["sql", "SELECT 1", "--run", str(tmp_path), "--timeout", value])
    assert result.exit_code == 2, result.output
    assert error_line(result).startswith("error: --timeout must be ")
    assert "Traceback" not in result.output


def test_threads_beyond_the_cpus_is_one_sentence_before_work(tmp_path, no_work):
    prompts, out = token_prompts(tmp_path / "p.parquet"), tmp_path / "r.parquet"
    cpus = os.cpu_count()
    for args in (rollout_args(prompts, out, "--threads", "100000"),
                 ["fit-cost", "--model", "tiny-llama", "--threads", "100000", "-o", str(out)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert error_line(result) == (f"error: --threads 100000 is more than this machine's {cpus} CPUs; "
                                      f"give at most {cpus}")
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--batches", "--contexts", "--budgets"])
def test_fit_cost_refuses_an_empty_grid_list(tmp_path, no_work, flag):
    out = tmp_path / "c.parquet"
    result = runner.invoke(app, ["fit-cost", "--model", "tiny-llama", flag, "", "-o", str(out)])
    assert result.exit_code == 2
    assert error_line(result).startswith(f"error: {flag} is empty; it takes comma-separated ")
    assert not out.exists()


def test_plan_schedule_refuses_an_empty_sweep():
    result = runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", "--sweep", ""])
    assert result.exit_code == 2
    assert error_line(result) == ("error: --sweep is empty; it takes comma-separated thresholds "
                                  "(for example 0.5,0.6,0.7)")


def test_calibrate_bootstrap_is_bounded(tmp_path):
    out = tmp_path / "t.parquet"
    result = runner.invoke(app, ["calibrate-threshold", "--profile", str(tmp_path / "m.parquet"),
                                 "--bootstrap", "1000000000", "-o", str(out)])
    assert result.exit_code == 2
    assert error_line(result) == ("error: --bootstrap must be from 1 to 100,000 (draws of the profile's "
                                  "prompts), got 1000000000")


def test_a_value_given_to_a_switch_is_named_as_such(tmp_path):
    out = tmp_path / "c.parquet"
    result = runner.invoke(app, ["fit-cost", "--hardware", "h100", "--speculate", "4", "-o", str(out)])
    assert result.exit_code == 2
    assert error_line(result) == ("error: got unexpected extra argument(s) (4): --speculate takes no value "
                                  "on sparrow fit-cost, it is a switch (try 'sparrow fit-cost -h')")
    assert not out.exists()


def test_prompts_jsonl_with_half_a_surrogate_pair_is_one_sentence(tmp_path, no_work):
    prompts, out = tmp_path / "p.jsonl", tmp_path / "r.parquet"
    prompts.write_text('{"prompt_id": "p0", "task": "passkey", "prompt": "a\\ud800b", "answer": "1"}\n')
    result = runner.invoke(app, rollout_args(prompts, out))
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert error_line(result) == (f"error: {prompts} line 1 cannot be read: a string holds the escape "
                                  "\\ud800, half of a UTF-16 surrogate pair without its other half, which is "
                                  "not text")
    assert not out.exists()


def test_dev_null_as_input_says_it_holds_nothing(tmp_path, no_work):
    out = tmp_path / "r.parquet"
    result = runner.invoke(app, rollout_args(Path("/dev/null"), out))
    assert result.exit_code == 2
    assert error_line(result) == ("error: --prompts /dev/null: nothing was read (it holds nothing; give a "
                                  "Parquet or JSONL file)")


def test_profile_budgets_naming_dense_say_why_not(tmp_path, no_work):
    out = tmp_path / "m.parquet"
    result = runner.invoke(app, ["profile", "--model", "tiny-llama", "--prompts",
                                 str(token_prompts(tmp_path / "p.parquet")), "--budgets", "dense,64", "-o",
                                 str(out)])
    assert result.exit_code == 2
    assert error_line(result) == ("error: --budgets lists dense, which every budget is scored against "
                                  "(alpha 1 by definition); give the block top-k budgets to score, such as "
                                  "256,512")
    assert not out.exists()


def test_distill_refuses_to_write_over_the_adapter_it_continues(tmp_path, no_work):
    adapter = tmp_path / "ad"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    result = runner.invoke(app, ["distill", "--model", "tiny-llama", "--prompts",
                                 str(token_prompts(tmp_path / "p.parquet")), "--budget", "48",
                                 "--init-adapter", str(adapter), "-o", str(adapter)])
    assert result.exit_code == 2
    assert error_line(result) == (f"error: -o {adapter} is the --init-adapter this command reads; choose "
                                  "another path")
    assert [p.name for p in adapter.iterdir()] == ["adapter_config.json"]


@pytest.mark.parametrize("command", ["rollout", "train"])
def test_a_seed_beyond_64_bits_is_one_sentence(tmp_path, no_work, command):
    prompts, out = token_prompts(tmp_path / "p.parquet"), tmp_path / "out"
    args = rollout_args(prompts, out) if command == "rollout" else train_args("tiny-llama", prompts, out)
    result = runner.invoke(app, [*args, "--seed", str(2**64)])
    assert result.exit_code == 2
    assert error_line(result) == f"error: --seed must be at most 2**63 - 1, got {2**64}"
    assert not out.exists()


@pytest.mark.parametrize("key,value,words", [
    ("num_hidden_layers", "two", 'num_hidden_layers must be a positive whole number, got "two"'),
    ("num_hidden_layers", 2.0, "num_hidden_layers must be a positive whole number, got 2.0"),
    ("num_attention_heads", None, "num_attention_heads must be a positive whole number, got null"),
    ("rms_norm_eps", "x", 'rms_norm_eps must be a positive number, got "x"'),
    ("rope_scaling", "yarn", 'rope_scaling must be an object (or null), got "yarn"'),
    ("eos_token_id", "x", 'eos_token_id must be a token id or a list of them, got "x"'),
])
def test_a_config_field_of_the_wrong_type_is_named(tmp_path, tiny_chat, no_work, key, value, words):
    import json
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_chat, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, key: value}))
    for args in (["plan-schedule", "--model", str(model)],
                 rollout_args(token_prompts(tmp_path / "p.parquet"), tmp_path / "r.parquet")[:-4]):
        args = [a if a != "tiny-llama" else str(model) for a in args]
        result = runner.invoke(app, [*args, "-o", str(tmp_path / "r.parquet")])
        assert result.exit_code == 2, result.output
        assert error_line(result) == f"error: {model}/config.json: {words}"


@pytest.mark.parametrize("name,text", [("tokenizer.json", "{bad"), ("chat_template.jinja", "{% if %}")])
def test_a_damaged_tokenizer_is_named(tmp_path, tiny_chat, no_work, name, text):
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_chat, model)
    (model / name).write_text(text)
    result = runner.invoke(app, ["prompts", "--task", "kv_lookup", "--n", "1", "--context-tokens", "512",
                                 "--model", str(model), "-o", str(tmp_path / "p.parquet")])
    assert result.exit_code != 0 and "Traceback" not in result.output
    line = error_line(result)
    assert line.startswith(f"error: {model}: its tokenizer does not read (") and "damaged" in line
    assert not (tmp_path / "p.parquet").exists()


def test_plan_schedule_refuses_an_empty_hardware_name():
    result = runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", "--hardware", ""])
    assert result.exit_code == 2
    assert error_line(result).startswith("error: unknown hardware ''; known hardware presets: h100")


def test_a_lora_rank_above_the_hidden_size_is_refused_before_work(tmp_path, no_work):
    from sparrow.stages.model.loading import resolve_config

    width = resolve_config("tiny-llama").hidden_size
    prompts, run = token_prompts(tmp_path / "p.parquet"), tmp_path / "run"
    result = runner.invoke(app, train_args("tiny-llama", prompts, run, "--lora-rank", str(width + 1)))
    assert result.exit_code == 2
    assert error_line(result).startswith(f"error: --lora-rank {width + 1} is more than tiny-llama's hidden "
                                         f"size ({width})")
    assert not run.exists()


@pytest.mark.parametrize("flag,value,words", [("--distill-lr-ratio", "0", "must be > 0, got 0"),
                                              ("--distill-kl-coef", "-1", "must be >= 0, got -1")])
def test_distill_sparse_options_name_their_own_flag(tmp_path, no_work, flag, value, words):
    prompts, run = token_prompts(tmp_path / "p.parquet"), tmp_path / "run"
    result = runner.invoke(app, train_args("tiny-llama", prompts, run, "--budget", "48", "--distill-sparse",
                                           flag, value))
    assert result.exit_code == 2
    assert error_line(result).endswith(f"{flag} {words}")


@pytest.mark.parametrize("command", ["rollout", "train"])
def test_an_empty_model_is_named_as_empty(tmp_path, no_work, command):
    prompts, out = token_prompts(tmp_path / "p.parquet"), tmp_path / "out"
    args = rollout_args(prompts, out) if command == "rollout" else train_args("tiny-llama", prompts, out)
    args[args.index("tiny-llama")] = ""
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert error_line(result) == ("error: --model is empty; give a preset name (sparrow models), a "
                                  "checkpoint directory or a .gguf file")


def test_a_context_too_short_for_the_default_long_prompt_says_so(tmp_path, tiny_chat, no_work):
    import json
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_chat, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 600}))
    result = runner.invoke(app, ["prompts", "--task", "kv_lookup", "--n", "1", "--model", str(model), "-o",
                                 str(tmp_path / "p.parquet")])
    assert result.exit_code == 2
    assert error_line(result).startswith(f"error: {model}'s context of 600 tokens leaves no room for a "
                                         "long-context prompt of at least 512 tokens")


def test_an_adapter_or_a_run_checkpoint_given_as_the_model_says_what_it_is(tmp_path):
    adapter, run = tmp_path / "adapter", tmp_path / "run"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (run / "checkpoint").mkdir(parents=True)
    (run / "checkpoint" / "config.json").write_text('{"steps": 3}')
    (run / "metrics.jsonl").write_text("")
    result = runner.invoke(app, ["plan-schedule", "--model", str(adapter)])
    assert result.exit_code == 2
    assert error_line(result) == (f"error: {adapter} is a LoRA adapter (adapter_config.json), not a model: "
                                  "give its base model as --model and the adapter as --lora (--adapter)")
    result = runner.invoke(app, ["plan-schedule", "--model", str(run / "checkpoint")])
    assert result.exit_code == 2
    assert error_line(result).startswith(f"error: {run / 'checkpoint'} is a sparrow train run's checkpoint")
    assert f"--lora {run / 'adapter'}" in error_line(result)


def test_a_chat_template_with_transformers_own_tags_still_loads(tmp_path, tiny_chat):
    """The template is compiled as transformers compiles it: its {% generation %} tag (assistant masks) is
    no damage."""
    import shutil

    from sparrow.stages.model.loading import spec_tokenizer

    model = tmp_path / "m"
    shutil.copytree(tiny_chat, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
        "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}")
    tokenizer = spec_tokenizer(str(model))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "hiyo"


def test_distill_refuses_empty_eval_budgets_instead_of_falling_back(tmp_path, no_work):
    prompts, out = token_prompts(tmp_path / "p.parquet"), tmp_path / "d"
    result = runner.invoke(app, ["distill", "--model", "tiny-llama", "--prompts", str(prompts), "--budget",
                                 "48", "--eval-budgets", "", "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert error_line(result).startswith("error: --eval-budgets is empty; it takes comma-separated integers")
    assert not out.exists()


def test_a_second_input_file_or_reward_function_is_refused_not_dropped(tmp_path):
    """A second --prompts or --reward-fn reads as a wish for both, which click would drop silently; a
    setting or an output given again is an override (the last one counts), as in argparse's tools."""
    result = runner.invoke(app, ["train", "--prompts", "a.parquet", "--prompts", "b.parquet", "-o", "x"])
    assert result.exit_code == 2
    line = error_line(result)
    assert line.startswith("error: --prompts is given twice (--prompts a.parquet, then --prompts b.parquet), "
                           "but it takes one value; to use several datasets, join them into one file first")
    result = runner.invoke(app, ["reward", "--prompts", "p.jsonl", "--completions", "c.jsonl", "--reward-fn",
                                 "a.py:f", "--reward-fn=b.py:g", "-o", "r.parquet"])
    assert error_line(result).startswith("error: --reward-fn is given twice (--reward-fn a.py:f, then "
                                         "--reward-fn b.py:g), but it takes one value; Sparrow scores with")
    result = runner.invoke(app, ["reward", "--prompts", "p.jsonl", "--completions", "a.jsonl",
                                 "--completions=b.jsonl", "-o", "r.parquet"])
    assert error_line(result) == ("error: --completions is given twice (--completions a.jsonl, then "
                                  "--completions b.jsonl), but it takes one value (try 'sparrow reward -h')")
    result = runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", "--threshold", "0.5", "--threshold",
                                 "0.6"])
    assert result.exit_code == 0, result.output  # the override: the plan at 0.6
    assert "threshold 0.6 " in result.stderr


def test_sql_output_that_is_a_folder_is_named_as_every_command_names_it(tmp_path):
    folder = tmp_path / "adir"
    folder.mkdir()
    r = runner.invoke(app, ["sql", "SELECT 1", "--run", str(tmp_path), "-o", str(folder)])
    assert error_line(r) == (f"error: {folder} is a directory; give a file path such as "
                             f"{folder / 'out.parquet'}")


def test_a_budget_that_covers_every_samples_cache_is_said_to_be_dense(tmp_path, no_work):
    """Block top-k keeps every page of a cache no longer than its budget: the run is dense attention, which
    a note says before the model loads; a budget below the longest cache says nothing."""
    prompts = token_prompts(tmp_path / "p.parquet", lengths=[20, 100])
    for budget, said in ((128, True), (96, False)):
        result = runner.invoke(app, ["rollout", "--model", "tiny-llama", "--prompts", str(prompts),
                                     "--budget", str(budget), "--max-new-tokens", "4", "-o",
                                     str(tmp_path / "r.parquet")])
        assert passed_the_checks(result)
        assert (f"note: --budget {budget} covers every sample's cache (the longest prompt, 100 tokens, with "
                "--max-new-tokens 4 reaches at most 103 tokens), so block top-k keeps every page: this run's "
                "attention is dense" in " ".join(result.stderr.split())) == said
