"""Issue 26, what a new user met on the command line (items 6, 9, 10, 11, 14, 15, 17, 18, 19, 20): each
test runs the command as a user does (typer's CliRunner, or the installed `sparrow` in a subprocess) and
checks its exit code, its one sentence and what is left on disk."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
import typer
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.cli.console import console
from sparrow.schemas import read_artifact, write_artifact
from sparrow.stages.model.loading import embedded_checkpoint, load_model

from cli_checks import error_line
from tiny_models import tiny_chat_llama

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


def _token_prompts(path: Path, n: int = 2, length: int = 20, vocab: int = 500) -> Path:
    """Prompts with token ids only (a model without a tokenizer can roll them out)."""
    rng = np.random.default_rng(0)
    rows = [{"prompt_id": f"p{i}", "task": "basic_arithmetic", "prompt": None,
             "prompt_token_ids": rng.integers(3, vocab, length).tolist(), "answer": "5", "metadata": None}
            for i in range(n)]
    return write_artifact(rows, path, "prompts")


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> str:
    """A tiny random Llama checkpoint with SmolLM2's tokenizer (and chat template): trainable."""
    return tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat"))


# ---------------------------------------------------------------- item 6: --device


@pytest.mark.parametrize("device", ["tpu", "cuda"])
@pytest.mark.parametrize("command", ["profile", "rollout", "train", "fit-cost", "distill"])
def test_device_is_one_sentence_before_any_work(tmp_path, monkeypatch, command, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this test's machine has no CUDA
    prompts = _token_prompts(tmp_path / "p.parquet")
    out = tmp_path / "out"
    args = {"profile": ["--prompts", str(prompts)], "rollout": ["--prompts", str(prompts)],
            "train": ["--prompts", str(prompts)], "fit-cost": [],
            "distill": ["--prompts", str(prompts), "--budget", "64"]}[command]
    line = error_line(runner.invoke(app, [command, "--model", "tiny-llama", *args, "--device", device,
                                          "-o", str(out)]))
    assert f"--device {device} was given but no CUDA device is available" in line or (
        line.startswith("error: --device must be cpu or cuda") and line.endswith(f"got '{device}'"))
    assert not out.exists()


# ---------------------------------------------------------------- item 9: a model without a tokenizer


def test_train_refuses_a_model_without_a_tokenizer_and_leaves_nothing(tmp_path):
    run = tmp_path / "run"
    line = error_line(runner.invoke(app, [
        "train", "--model", "tiny-llama", "--prompts", str(_token_prompts(tmp_path / "p.parquet")),
        "--steps", "1", "--prompts-per-step", "1", "--samples", "2", "--max-new-tokens", "2",
        "-o", str(run)]))
    assert "--model tiny-llama has no tokenizer" in line and "scorer" in line
    assert not run.exists()  # no schedule.parquet, no metrics: the run directory was never made


# ---------------------------------------------------------------- item 10: --adapter


def test_an_adapter_config_that_is_not_json_is_named(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{\n")
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    out = tmp_path / "r.parquet"
    for command in (["rollout"], ["profile", "--budgets", "48"]):
        line = error_line(runner.invoke(app, [*command, "--model", "tiny-llama", "--prompts",
                                              str(_token_prompts(tmp_path / "p.parquet")), "--adapter",
                                              str(adapter), "-o", str(out)]))
        assert f"{adapter / 'adapter_config.json'} is not valid JSON" in line
    assert not out.exists()


def test_an_adapter_for_another_base_model_is_used_with_a_warning(tmp_path):
    from sparrow.stages.model.adapter import add_lora, save_adapter

    model = load_model("tiny-llama").model
    config = add_lora(model, 2, 4.0)
    adapter = save_adapter(model, config, tmp_path / "adapter", "Qwen/Qwen3-0.6B")  # the shapes fit
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, ["rollout", "--model", "tiny-llama", "--prompts",
                            str(_token_prompts(tmp_path / "p.parquet")), "--adapter", str(adapter),
                            "--max-new-tokens", "2", "-o", str(out)])
    assert r.exit_code == 0, r.output
    warning = " ".join(r.stderr.split())
    assert "warning:" in warning and "was trained on 'Qwen/Qwen3-0.6B'" in warning
    assert "not on --model tiny-llama" in warning and out.exists()


# ---------------------------------------------------------------- items 11 and 19: plan-schedule


def _mismatch(path: Path, positions: np.ndarray, samples: int = 4, model: str = "smollm2-135m",
              budgets=(64, 128)) -> Path:
    rng = np.random.default_rng(1)
    rows = []
    for s in range(samples):
        for b in budgets:
            for p in positions:
                a = float(np.clip(1 - rng.exponential(0.02 * 128 / b), 0, 1))
                rows.append({"prompt_id": "p", "sample": s, "position": int(p), "bin": int(p) // 512,
                             "budget": b, "token_id": 1, "alpha": a, "logp_dense": -1.0, "logp_sparse": -1.0,
                             "log_ratio": 0.0, "k1": 0.0, "k2": 0.0, "k3": 0.0, "entropy_dense": 1.0})
    return write_artifact(rows, path, "mismatch", metadata={"bin_width": 512, "model": model})


def test_plan_schedule_refuses_a_profile_of_another_model_unless_told(tmp_path):
    profile = _mismatch(tmp_path / "m.parquet", np.arange(1500, 1596))
    out = tmp_path / "s.parquet"
    line = error_line(runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", "--profile", str(profile),
                                          "-o", str(out)]))
    assert "measured on smollm2-135m" in line and "--allow-model-mismatch" in line
    assert not out.exists()
    r = runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", "--profile", str(profile),
                            "--allow-model-mismatch", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert out.exists()


def test_plan_schedule_says_the_profiled_prompt_length_and_why_a_bin_takes_its_budget(tmp_path):
    """1.5K-token prompts + 96 new tokens: the speedup line says so; bins 0 and 1 (no tokens, before the
    prompts end) take the first measured bin's budget, not a 'previous bin's'."""
    profile = _mismatch(tmp_path / "m.parquet", np.arange(1500, 1596))
    r = runner.invoke(app, ["plan-schedule", "--model", "smollm2-135m", "--profile", str(profile),
                            "--threshold", "0.5"])
    assert r.exit_code == 0, r.output
    err = " ".join(r.stderr.split())
    assert "96 generated tokens after a 1500-token prompt" in err
    assert ("bins 0 (0-512), 1 (512-1024): fewer tokens than --min-tokens (50), so they take the budget of "
            "bin 2" in err)
    assert "previous bin" not in err
    line = error_line(runner.invoke(app, ["plan-schedule", "--model", "smollm2-135m", "--profile",
                                          str(profile), "--min-tokens", "1000"]))
    assert "--min-tokens" in line and "lower --min-tokens" in line


# ---------------------------------------------------------------- item 18: one value per cell


def test_json_is_typed_and_the_text_formats_render_alike(tmp_path):
    models = json.loads(runner.invoke(app, ["models", "--format", "json"]).stdout)
    smol = next(m for m in models if m["preset"] == "smollm2-135m")
    assert isinstance(smol["params"], int) and 134e6 < smol["params"] < 136e6
    assert smol["tied"] is True and (smol["q_heads"], smol["kv_heads"]) == (9, 3)
    tsv = runner.invoke(app, ["models"]).stdout.splitlines()
    assert "134.5M" in tsv[[line.split("\t")[0] for line in tsv].index("smollm2-135m")]
    plan = json.loads(runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", "-f", "json"]
                                    ).stdout.splitlines()[0])
    assert isinstance(plan["schedule"][0]["tail"], float) and isinstance(plan["schedule"][0]["budget"], int)

    cost = ["fit-cost", "--model", "tiny-llama", "--device", "cpu", "--batches", "1,2",
            "--contexts", "64,128", "--budgets", "dense,48", "--repeats", "1", "--warmup", "0",
            "-o", str(tmp_path / "c.parquet")]
    header, *rows = runner.invoke(app, cost).stdout.splitlines()
    budgets = [dict(zip(header.split("\t"), row.split("\t")))["budget"] for row in rows]
    assert budgets == ["dense", "48"] * 4  # as the table shows it, never a blank cell
    as_json = json.loads(runner.invoke(app, [*cost, "--format", "json"]).stdout)
    assert [r["budget"] for r in as_json] == [None, 48] * 4 and isinstance(as_json[0]["measured_ms"], float)

    profile = ["profile", "--model", "tiny-llama", "--prompts", str(_token_prompts(tmp_path / "p.parquet")),
               "--budgets", "48", "--samples", "1", "--max-new-tokens", "3",
               "-o", str(tmp_path / "m.parquet")]
    header, *rows = runner.invoke(app, profile).stdout.splitlines()
    column = header.split("\t").index("above")
    assert rows and {row.split("\t")[column] for row in rows} <= {"yes", "no"}
    as_json = json.loads(runner.invoke(app, [*profile, "--format", "json"]).stdout)
    assert all(isinstance(r["above"], bool) and isinstance(r["tail_alpha"], float) for r in as_json)


# ---------------------------------------------------------------- item 19: smaller defects


def test_help_keeps_every_bracket_it_was_written_with():
    """Rich markup must not eat '[vllm]' (or any other bracketed text) from an option's help."""
    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        shown = " ".join(runner.invoke(app, [name, "--help"], env={"COLUMNS": "500"}).stdout.split())
        for param in command.params:
            for bracketed in re.findall(r"\\?\[[^\]]*\]", getattr(param, "help", None) or ""):
                assert bracketed.lstrip("\\") in shown, (name, param.name, bracketed)


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.strip() == f"sparrow {version('sparrow-rl')}"


def test_profile_budgets_error_names_the_flag(tmp_path):
    out = tmp_path / "m.parquet"
    line = error_line(runner.invoke(app, ["profile", "--prompts", str(_token_prompts(tmp_path / "p.parquet")),
                                          "--budgets", "64,100", "-o", str(out)]))
    assert line.startswith("error: --budgets: budget 100 is not a multiple of the page size 16")
    assert not out.exists()


def test_json_lines_are_read_by_their_content_whatever_the_suffix(tmp_path):
    rows = read_artifact(_token_prompts(tmp_path / "p.parquet"), "prompts").to_pylist()
    named_json = tmp_path / "prompts.json"
    named_json.write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n"
                                  for r in rows))
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, ["rollout", "--model", "tiny-llama", "--prompts", str(named_json),
                            "--max-new-tokens", "2", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert read_artifact(out, "rollouts")["prompt_token_ids"].to_pylist() == [r["prompt_token_ids"]
                                                                              for r in rows]
    line = error_line(runner.invoke(app, ["plan-schedule", "--model", "smollm2-135m", "--profile",
                                          str(named_json)]))
    assert f"{named_json} is JSON text (only prompts may be JSON lines)" in line


def _run_dir(path: Path, kl: float) -> Path:
    steps = 8
    write_artifact({"run_id": ["r"] * steps, "step": list(range(steps)), "reward_mean": [0.5] * steps,
                    "mismatch_kl": [kl] * steps, "collapse": [None] * steps}, path / "metrics.parquet",
                   "metrics")
    write_artifact({"bin": [0], "bin_start": [0], "bin_end": [None], "budget": [64], "tail": [None],
                    "predicted_step_seconds": [None]}, path / "schedule.parquet", "schedule")
    return path


def test_calibrate_names_runs_apart_and_mismatch_kl_only_warns(tmp_path):
    """Two runs in folders both named 'train' are shown by their paths; a run whose mismatch KL is high
    (0.3, six times the warning level) is labelled by what training did (stable) and warned about."""
    profile = _mismatch(tmp_path / "m.parquet", np.arange(0, 512))
    runs = [_run_dir(tmp_path / "a" / "train", 0.001), _run_dir(tmp_path / "b" / "train", 0.3)]
    r = runner.invoke(app, ["calibrate-threshold", "--profile", str(profile), "--runs", str(runs[0]),
                            "--runs", str(runs[1]), "-o", str(tmp_path / "t.parquet")])
    assert r.exit_code == 0, r.output
    header, *rows = r.stdout.splitlines()
    table = [dict(zip(header.split("\t"), row.split("\t"))) for row in rows]
    assert sorted(t["run"] for t in table) == [str(runs[0]), str(runs[1])]
    by_run = {t["run"]: t for t in table}
    assert by_run[str(runs[1])]["label"] == "stable" and by_run[str(runs[1])]["reasons"] == ""
    assert "mismatch KL reached 0.3" in by_run[str(runs[1])]["warnings"]
    assert by_run[str(runs[0])]["warnings"] == ""


def _train_args(model: str, prompts: Path, run: Path, *more: str) -> list[str]:
    return ["train", "--model", model, "--prompts", str(prompts), "--eval-prompts", str(prompts),
            "--prompts-per-step", "1", "--samples", "2", "--max-new-tokens", "4", "--lora-rank", "2",
            "--budget", "48", *more, "-o", str(run)]


def test_a_refused_resume_draws_no_progress_bar_first(tiny_chat, tmp_path, monkeypatch):
    monkeypatch.setattr(console, "_force_terminal", True)  # a terminal: the bar would show
    run = tmp_path / "run"
    run.mkdir()
    line = error_line(runner.invoke(app, _train_args(tiny_chat, _token_prompts(tmp_path / "p.parquet"), run,
                                                     "--steps", "1", "--resume")))
    assert "--resume" in line


def test_a_short_run_evaluates_at_its_last_step_and_logs_whole_lines(tiny_chat, tmp_path):
    """--steps 2 with the default --eval-every 5: the final eval is there; in a log (stderr not a
    terminal) every step is one whole line, no bar cut to 80 columns."""
    run = tmp_path / "run"
    r = runner.invoke(app, _train_args(tiny_chat, _token_prompts(tmp_path / "p.parquet"), run, "--steps", "2",
                                       "--format", "json"))
    assert r.exit_code == 0, r.output
    metrics = read_artifact(run / "metrics.parquet", "metrics").to_pylist()
    assert metrics[0]["eval_accuracy"] is None and metrics[-1]["eval_accuracy"] is not None
    summary = json.loads(r.stdout)
    assert summary["final_eval_accuracy"] == metrics[-1]["eval_accuracy"]
    steps = [line for line in r.stderr.splitlines() if line.startswith("train step ")]
    assert [s.split(":")[0] for s in steps] == ["train step 1/2", "train step 2/2"]
    assert all("alpha-lb p5" in s and s.rstrip().endswith(" s") for s in steps)
    assert "…" not in r.stderr and "━" not in r.stderr


def test_distill_logs_whole_lines_and_no_stale_bar(tmp_path):
    out = tmp_path / "adapter"
    r = runner.invoke(app, ["distill", "--model", "tiny-llama", "--prompts",
                            str(_token_prompts(tmp_path / "p.parquet", length=100)), "--budget", "48",
                            "--steps", "2", "--samples", "1", "--max-new-tokens", "4", "--lora-rank", "2",
                            "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "━" not in r.stderr and "…" not in r.stderr  # no bar's last frame, cut or stale
    lines = r.stderr.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("distilling step")] == [
        "distilling step 1/2", "distilling step 2/2"]


def test_rollout_profile_and_fit_cost_log_their_progress_in_whole_lines(tmp_path):
    """In a log, the long commands say how far they are as whole lines (the first update, then every few
    seconds, and the last), not nothing until they finish."""
    prompts = _token_prompts(tmp_path / "p.parquet")
    runs = {"rollouts (samples): 4/4": ["rollout", "--model", "tiny-llama", "--prompts", str(prompts),
                                        "--samples", "2", "--max-new-tokens", "4", "-o", str(tmp_path / "r")],
            "scoring": ["profile", "--model", "tiny-llama", "--prompts", str(prompts), "--samples", "1",
                        "--max-new-tokens", "4", "--budgets", "48", "-o", str(tmp_path / "m")],
            "timing the engine's decode step (points): 4/4": [
                "fit-cost", "--model", "tiny-llama", "--batches", "1,2", "--contexts", "64,128", "--budgets",
                "dense", "--repeats", "1", "--warmup", "0", "-o", str(tmp_path / "c")]}
    for want, args in runs.items():
        r = runner.invoke(app, args)
        assert r.exit_code == 0, r.output
        lines = r.stderr.splitlines()
        assert any(line.startswith(want) and line.rstrip().endswith(" s)") for line in lines), (want, lines)
        assert "━" not in r.stderr
    r = runner.invoke(app, ["fit-cost", "--model", "tiny-llama", "--batches", "1", "--contexts", "64",
                            "--budgets", "dense", "-o", str(tmp_path / "one")])
    assert r.exit_code == 2 and "needs at least two grid points" in error_line(r)
    assert not (tmp_path / "one").exists()


# ---------------------------------------------------------------- item 14: immediate stops are warned of


def test_samples_that_end_at_their_first_token_are_warned_of(tmp_path):
    """A model whose every sample is one EOS token (its logits are all equal, EOS is token 0, greedy
    takes the first): the rollout says so on stderr."""
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        hf.model.norm.weight.zero_()  # every logit 0
    hf.save_pretrained(tmp_path / "mute", safe_serialization=True)
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, ["rollout", "--model", str(tmp_path / "mute"), "--prompts",
                            str(_token_prompts(tmp_path / "p.parquet")), "--samples", "2",
                            "--temperature", "0", "--max-new-tokens", "4", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert all(len(t) == 1 for t in read_artifact(out, "rollouts")["token_ids"].to_pylist())
    assert "warning: 4 of 4 samples ended at their first token" in " ".join(r.stderr.split())


def test_train_and_distill_warn_when_their_samples_end_at_the_first_token(tmp_path):
    """A model that samples EOS at once even at temperature 1 (every residual stream's first dimension is
    large and positive, and only EOS's head row reads it): train and distill say so too."""
    tok = transformers.AutoTokenizer.from_pretrained(embedded_checkpoint())
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8,
                                   max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=0)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        hf.model.embed_tokens.weight[:, 0] = 1000.0
        hf.lm_head.weight.zero_()
        hf.lm_head.weight[0, 0] = 100.0
    hf.save_pretrained(tmp_path / "mute", safe_serialization=True)
    tok.save_pretrained(tmp_path / "mute")
    model, prompts = str(tmp_path / "mute"), _token_prompts(tmp_path / "p.parquet")
    r = runner.invoke(app, _train_args(model, prompts, tmp_path / "run", "--steps", "1"))
    assert r.exit_code == 0, r.output
    assert "warning: 2 of 2 samples ended at their first token" in " ".join(r.stderr.split())
    long_prompts = _token_prompts(tmp_path / "long.parquet", length=60)  # past budget 48
    r = runner.invoke(app, ["distill", "--model", model, "--prompts", str(long_prompts), "--budget", "48",
                            "--steps", "1", "--samples", "1", "--max-new-tokens", "4", "--lora-rank", "2",
                            "-o", str(tmp_path / "adapter")])
    stderr = " ".join(r.stderr.split())
    assert "warning: 2 of 2 samples ended at their first token" in stderr
    # a first token comes from the dense prefill: no position is read sparsely, so there is nothing to distill
    assert r.exit_code == 2 and "nothing to distill" in stderr and not (tmp_path / "adapter").exists()


# ---------------------------------------------------------------- item 20: a dependency's SyntaxWarnings


@pytest.mark.slow  # compiles reasoning-gym's dependencies from source
@pytest.mark.parametrize("task", ["chain_sum", "gsm_symbolic"])
def test_prompts_print_no_syntax_warnings_without_bytecode(tmp_path, task):
    """With no bytecode cache, Python compiles reasoning-gym's dependencies from source on every run."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(tmp_path / "no-pyc")}
    r = subprocess.run([str(ROOT / ".venv/bin/sparrow"), "prompts", "--task", task, "--n", "1",
                        "-o", str(tmp_path / "p.parquet")], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert "SyntaxWarning" not in r.stderr and "Warning" not in r.stderr


def test_the_cli_starts_without_torch():
    """`sparrow --help` and every command's parsing import no torch (nor the engine, nor torch._dynamo):
    those imports are most of a command's start-up, so a module-level import of them is a regression."""
    import sys

    heavy = ("torch", "transformers", "sparrow.stages.engine.engine")
    code = f"import sys; from sparrow.cli.app import app; print([m for m in {heavy} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------- what a run shows while and after it runs


def test_long_phases_say_so_from_their_start(tiny_chat, tmp_path):
    """Loading the model, and each sampling or scoring phase, show on stderr as they start (0 of N), not
    at the first finished batch: in profile, distill, train and rollout alike."""
    prompts = _token_prompts(tmp_path / "p.parquet", length=100)
    runs = {
        "profile": (["profile", "--model", "tiny-llama", "--prompts", str(prompts), "--samples", "1",
                     "--max-new-tokens", "4", "--budgets", "48", "-o", str(tmp_path / "m.parquet")],
                    ["sampling (samples): 0/", "scoring (sequences): 0/"]),
        "distill": (["distill", "--model", "tiny-llama", "--prompts", str(prompts), "--budget", "48",
                     "--steps", "1", "--samples", "1", "--max-new-tokens", "4", "--lora-rank", "2",
                     "-o", str(tmp_path / "adapter")],
                    ["scoring before (trajectories): 0/", "scoring after (trajectories): 0/"]),
        "train": (_train_args(tiny_chat, prompts, tmp_path / "run", "--steps", "1"),
                  ["initial eval of the --eval-prompts ...", "rollout of train step 1/1 ...",
                   "scoring of train step 1/1 ...", "train step 1/1: reward"]),
        "rollout": (["rollout", "--model", "tiny-llama", "--prompts", str(prompts), "--max-new-tokens", "4",
                     "-o", str(tmp_path / "r.parquet")], ["wrote 2 rollouts"])}
    for name, (args, phases) in runs.items():
        r = runner.invoke(app, args)
        assert r.exit_code == 0, (name, r.output)
        lines = r.stderr.splitlines()
        loading = [i for i, line in enumerate(lines) if line.startswith("loading model ")]
        seen = [next((i for i, line in enumerate(lines) if line.startswith(p)), None) for p in phases]
        assert len(loading) == 1 and None not in seen, (name, lines)
        assert [loading[0], *seen] == sorted([loading[0], *seen]), (name, lines)


def test_steps_are_numbered_as_the_data_numbers_them_and_no_learning_signal_is_warned_of(
        tiny_chat, tmp_path, monkeypatch):
    """Every reward 0 (a task that scores nothing): the log's step N is the data's step N (the rows after
    N updates, TRL's global_step), its eval is the row's, the report draws the initial eval at step 0,
    every step logs frac_reward_zero_std 1, and stderr warns that there is no learning signal."""
    from matplotlib.axes import Axes

    from sparrow.stages.tasks import TASKS, Task

    monkeypatch.setitem(TASKS, "nothing", Task("nothing", "math", "scores 0", lambda *a, **k: iter(()),
                                               lambda completion, answer, metadata: 0.0))
    rows = read_artifact(_token_prompts(tmp_path / "p.parquet", n=2), "prompts").to_pylist()
    prompts = write_artifact([{**r, "task": "nothing"} for r in rows], tmp_path / "zero.parquet", "prompts")
    run = tmp_path / "run"
    r = runner.invoke(app, _train_args(tiny_chat, prompts, run, "--steps", "2", "--eval-every", "1",
                                       "--prompts-per-step", "2"))
    assert r.exit_code == 0, r.output
    metrics = read_artifact(run / "metrics.parquet", "metrics").to_pylist()
    assert [m["step"] for m in metrics] == [1, 2]
    files = sorted(p.name for p in (run / "mismatch").iterdir())
    assert files == ["step=00001.parquet", "step=00002.parquet"]
    logged = {int(m[1]): float(m[2]) for m in re.finditer(r"train step (\d+)/2: .* eval ([\d.]+)", r.stderr)}
    assert logged == {m["step"]: round(m["eval_accuracy"], 2) for m in metrics}
    assert [m["frac_reward_zero_std"] for m in metrics] == [1.0, 1.0]
    err = " ".join(r.stderr.split())
    assert "warning: step 1: every group's samples got the same reward (frac_reward_zero_std 1)" in err
    assert ("warning: no learning signal: at each of the 2 steps every group's samples got the same reward"
            in err)

    drawn = []
    plot = Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda ax, *a, **k: drawn.append((ax, list(a[0])))
                        or plot(ax, *a, **k))
    assert runner.invoke(app, ["report", str(run)]).exit_code == 0
    assert [x for ax, x in drawn if ax.get_title() == "eval accuracy (greedy)"] == [[0, 1, 2], [0, 1, 2]]


# ---------------------------------------------------------------- one name per idea across the commands

# (command, the name, the older or other library's name it also takes, a value)
ALIASES = [
    ("rollout", "--max-num-seqs", "--max-batch", "3"),
    ("profile", "--max-num-seqs", "--batch-size", "3"),
    ("plan-schedule", "--max-num-seqs", "--batch", "3"),
    ("distill", "--trajectories-per-step", "--batch-size", "3"),
    ("train", "--output", "--output-dir", "elsewhere"),
    ("train", "--samples", "--num-generations", "3"),
    ("train", "--max-new-tokens", "--max-completion-length", "3"),
    ("rollout", "--max-new-tokens", "--max-response-length", "3"),
    ("train", "--lr", "--learning-rate", "0.5"),
    ("train", "--kl-coef", "--beta", "0.5"),
    ("distill", "--samples", "--num-generations", "3"),
    ("distill", "--max-new-tokens", "--max-completion-length", "3"),
    ("distill", "--lr", "--learning-rate", "0.5"),
    ("rollout", "--adapter", "--lora", "elsewhere"),
]


def _required(command: str, tmp_path: Path) -> list[str]:
    """The arguments a command cannot parse without (files that exist, an output)."""
    given = tmp_path / "given.parquet"
    given.touch()
    out = ["-o", str(tmp_path / "out")]
    return {"prompts": ["--task", "basic_arithmetic", *out], "sql": ["SELECT 1"],
            "calibrate-threshold": ["--profile", str(given), *out],
            "rollout": ["--prompts", str(given), *out],
            "reward": ["--prompts", str(given), "--completions", str(given), *out],
            "train": ["--prompts", str(given), *out], "report": [str(tmp_path)], "models": [],
            "plan-schedule": []}.get(command, out)


def _parsed(command: str, args: list[str]) -> dict:
    """The values a command's function would be called with, for `args` (click's parse, nothing run)."""
    click_command = typer.main.get_command(app).commands[command]
    with click_command.make_context(command, list(args)) as ctx:
        return dict(ctx.params)


def _help(command: str) -> str:
    r = runner.invoke(app, [command, "--help"], env={"COLUMNS": "500"})
    assert r.exit_code == 0, r.output
    return r.stdout


@pytest.mark.parametrize(("command", "name", "alias", "value"), ALIASES)
def test_every_old_name_is_listed_and_parsed_as_the_new_one(tmp_path, command, name, alias, value):
    shown = _help(command)
    assert re.search(rf"{name}\b", shown) and re.search(rf"{alias}\b", shown), (name, alias)
    if value == "elsewhere":
        value = str(tmp_path / "elsewhere")
    args = [a for a in _required(command, tmp_path) if not (name == "--output" and a.startswith("-o"))]
    if name == "--output":
        args = [a for a in args if a != str(tmp_path / "out")]
    by_name, by_alias = _parsed(command, [*args, name, value]), _parsed(command, [*args, alias, value])
    assert by_name == by_alias
    assert by_name != _parsed(command, args + (["-o", str(tmp_path / "out")] if name == "--output" else []))


@pytest.mark.parametrize(("command", "flag", "extra"), [
    ("rollout", "--max-batch", []), ("profile", "--batch-size", []),
    ("distill", "--batch-size", ["--budget", "64"])])
def test_an_old_name_is_refused_in_the_new_names_words(tmp_path, command, flag, extra):
    """The refusal of a bad value names the flag every command now uses for the idea, whichever was typed."""
    prompts = _token_prompts(tmp_path / "p.parquet")
    out = tmp_path / "out"
    new = {"--max-batch": "--max-num-seqs", "--batch-size": "--max-num-seqs"}[flag]
    if command == "distill":
        new = "--trajectories-per-step"
    lines = {error_line(runner.invoke(app, [command, "--model", "tiny-llama", "--prompts", str(prompts),
                                            *extra, given, "0", "-o", str(out)]))
             for given in (flag, new)}
    assert len(lines) == 1 and lines.pop().startswith(f"error: {new} must be at least 1")
    assert not out.exists()


def test_train_takes_its_run_directory_as_every_command_takes_its_output(tmp_path):
    """-o, --output and TRL's --output-dir are one option: a file where the run directory goes is refused
    in the same sentence under each spelling, and is left as it was."""
    taken = tmp_path / "taken"
    taken.write_text("not a run")
    prompts = _token_prompts(tmp_path / "p.parquet")
    lines = {error_line(runner.invoke(app, ["train", "--model", "tiny-llama", "--prompts", str(prompts),
                                            flag, str(taken)]))
             for flag in ("-o", "--output", "--output-dir")}
    assert len(lines) == 1 and lines.pop().startswith(f"error: {taken} is a file, but a")
    assert taken.read_text() == "not a run"


def test_profile_decodes_as_many_sequences_together_as_rollout_by_default(tmp_path):
    rollout, profile = (_parsed(c, _required(c, tmp_path)) for c in ("rollout", "profile"))
    assert rollout["max_batch"] == profile["batch_size"] == 16


def _commands():
    return typer.main.get_command(app).commands


@pytest.mark.parametrize("command", sorted(_commands()))
def test_boolean_flags_take_x_and_no_x_and_show_no_value(tmp_path, command):
    flags = [p for p in _commands()[command].params if getattr(p, "is_flag", False)]
    shown = _help(command)
    assert "<bool>" not in shown
    for flag in flags:
        on, off = flag.opts[0], f"--no-{flag.opts[0].removeprefix('--')}"
        assert flag.secondary_opts == [off], flag.name
        assert on in shown and off in shown
        if not flag.expose_value:  # -q/--quiet acts as it is read (tests/test_quiet.py)
            continue
        required = _required(command, tmp_path)
        assert _parsed(command, [*required, on])[flag.name] is True
        assert _parsed(command, [*required, off])[flag.name] is False
    assert any(flags) or command in ("models",)


@pytest.mark.parametrize("command", sorted(c for c, cmd in _commands().items()
                                           if any(p.name in ("format", "fmt") for p in cmd.params)))
def test_format_lists_its_choices_in_help(command):
    assert "[table|csv|json|tsv]" in " ".join(_help(command).split())


def test_format_takes_any_case_and_refuses_others_naming_the_choices():
    lower = runner.invoke(app, ["models", "--format", "json"])
    upper = runner.invoke(app, ["models", "--format", "JSON"])
    assert upper.exit_code == 0 and json.loads(upper.stdout) == json.loads(lower.stdout)
    assert runner.invoke(app, ["models", "-f", "Csv"]).stdout.startswith("preset,arch,")
    line = error_line(runner.invoke(app, ["models", "--format", "xml"]))
    assert line == "error: --format must be one of table, csv, json, tsv, got 'xml'"


def test_printed_tables_have_snake_case_headers():
    """Column headers read as the artifacts' columns do (snake_case), so a TSV header is a query's name."""
    snake = re.compile(r"[a-z][a-z0-9_]*")
    for args in (["models"], ["plan-schedule", "--model", "qwen3-4b", "--sweep", "0.8,0.9"],
                 ["plan-schedule", "--compare-published"]):
        r = runner.invoke(app, [*args, "--format", "tsv"])
        assert r.exit_code == 0, r.output
        headers = [line for line in r.stdout.splitlines() if line and not line[0].isdigit()
                   and "\t" in line and not line.startswith(("qwen", "smollm", "tiny", "llama"))]
        for header in headers:
            for column in header.split("\t"):
                assert snake.fullmatch(column), (args, column)


# ---------------------------------------------------------------- --threads on the commands that run a model


@pytest.mark.parametrize("command", ["profile", "rollout", "train", "distill"])
def test_threads_is_an_option_and_zero_is_one_sentence(tmp_path, command):
    assert "--threads" in runner.invoke(app, [command, "--help"], terminal_width=200).stdout
    prompts = _token_prompts(tmp_path / "p.parquet")
    extra = ["--budget", "64"] if command == "distill" else []
    out = tmp_path / "out"
    line = error_line(runner.invoke(app, [command, "--model", "tiny-llama", "--prompts", str(prompts), *extra,
                                          "--threads", "0", "-o", str(out)]))
    assert line == "error: --threads must be at least 1, got 0"
    assert not out.exists()


def test_rollout_runs_on_the_threads_it_is_given(tmp_path):
    """In a process of its own (the setting is the process's): torch runs on the one thread asked for."""
    prompts = _token_prompts(tmp_path / "p.parquet", n=1, length=8)
    code = ("import sys, torch; from sparrow.cli.app import main; sys.argv = sys.argv[1:]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('threads', torch.get_num_threads())")
    proc = subprocess.run(
        [sys.executable, "-c", code, "sparrow", "rollout", "--model", "tiny-llama", "--prompts", str(prompts),
         "--max-new-tokens", "2", "--threads", "1", "-o", str(tmp_path / "r.parquet")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "threads 1"
    assert (tmp_path / "r.parquet").exists()


def test_profile_samples_with_top_k_as_rollout_does(tmp_path):
    """--top-k 1 at temperature 1 keeps only the most likely token: the greedy (--temperature 0)
    trajectories, token for token; a --top-k below -1 (vLLM's off) is one sentence before any work."""
    prompts = _token_prompts(tmp_path / "p.parquet", n=2, length=12)
    common_args = ["profile", "--model", "tiny-llama", "--prompts", str(prompts), "--budgets", "48",
                   "--samples", "2", "--max-new-tokens", "6", "--format", "tsv"]
    tokens = []
    for name, extra in (("k1", ["--top-k", "1"]), ("greedy", ["--temperature", "0"])):
        out = tmp_path / f"{name}.parquet"
        result = runner.invoke(app, [*common_args, *extra, "-o", str(out)])
        assert result.exit_code == 0, result.output
        table = read_artifact(out, "mismatch").sort_by([("prompt_id", "ascending"), ("sample", "ascending"),
                                                        ("position", "ascending")])
        tokens.append(table.column("token_id").to_pylist())
    assert tokens[0] == tokens[1] and len(tokens[0]) == 2 * 2 * 6
    line = error_line(runner.invoke(app, [*common_args, "--top-k", "-2", "-o", str(tmp_path / "x.parquet")]))
    assert line == "error: --top-k must be a number of tokens >= 1, or 0 or -1 for off, got -2"
    assert not (tmp_path / "x.parquet").exists()


def test_train_takes_dtype_as_profile_and_rollout_do(tiny_chat, tmp_path, monkeypatch):
    """--dtype bfloat16 on a CPU: the model loads in bf16, a step runs, and the checkpoint records it (a
    resume must agree); an unknown dtype is one sentence before the model loads."""
    from sparrow.stages.model import loading

    loaded_as = []
    real = loading.load_model

    def spy(*args, **kwargs):
        loaded_as.append(kwargs.get("dtype"))
        return real(*args, **kwargs)

    monkeypatch.setattr(loading, "load_model", spy)
    prompts = _token_prompts(tmp_path / "p.parquet")
    bad = tmp_path / "bad"
    line = error_line(runner.invoke(app, _train_args(tiny_chat, prompts, bad, "--steps", "1", "--dtype",
                                                     "float16")))
    assert line == "error: --dtype float16: float16 is not supported; use bfloat16 (or float32)"
    assert loaded_as == [] and not bad.exists()
    run = tmp_path / "run"
    r = runner.invoke(app, _train_args(tiny_chat, prompts, run, "--steps", "1", "--dtype", "bfloat16"))
    assert r.exit_code == 0, r.output
    assert loaded_as == [torch.bfloat16]
    assert json.loads((run / "checkpoint" / "config.json").read_text())["dtype"] == "bfloat16"
    line = error_line(runner.invoke(app, _train_args(tiny_chat, prompts, run, "--steps", "2", "--resume")))
    assert "--dtype 'bfloat16', not 'auto'" in line
