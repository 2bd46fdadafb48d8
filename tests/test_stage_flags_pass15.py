"""The same flag means the same thing across stages: plan-schedule's --model defaults to the model its
--profile (or --threshold-file) records; fit-cost takes rollout's --dtype, times its decode steps in it
and records it, and plan-schedule names it; profile's --budget/--schedule are its sampler, as rollout's
are; distill refuses a negative --temperature with rollout's sentence before any model loads.

References: the artifacts' footers read with pyarrow, the presets' own shapes, the dtypes of the weights
the timed engine was handed, rollout's own refusals and trajectories for the same flags.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import write_artifact
from sparrow.stages.cost import write_fitted
from sparrow.stages.model.presets import get_preset

from cli_checks import error_line

runner = CliRunner()
COLUMNS = ("prompt_id", "sample", "position", "bin", "budget", "token_id", "alpha", "logp_dense",
           "logp_sparse", "log_ratio", "k1", "k2", "k3", "entropy_dense")
VOCAB = 300


def footer(path: Path) -> dict:
    """The stage's metadata as pyarrow reads it from the Parquet footer, not through Sparrow's readers."""
    return json.loads(pq.read_metadata(path).metadata[b"sparrow.meta"])


def profile_of(path: Path, model: str | None, width: int = 256) -> Path:
    """A mismatch artifact of one trajectory (positions 300-459) at budgets 48 and 96, recording `model`
    (none when None)."""
    rng = np.random.default_rng(0)
    rows = {c: [] for c in COLUMNS}
    for pos in range(300, 460):
        for budget in (48, 96):
            values = ("p", 0, pos, pos // width, budget, 1, float(rng.uniform(0.6, 1.0)), -1.0, -1.0, 0.0,
                      0.0, 0.0, 0.0, 1.0)
            for c, v in zip(COLUMNS, values):
                rows[c].append(v)
    meta = {"bin_width": width} | ({"model": model} if model else {})
    return write_artifact(rows, path, "mismatch", metadata=meta)


def plan(*args) -> object:
    return runner.invoke(app, ["plan-schedule", "--threshold", "0.5", "--min-tokens", "1", *map(str, args)])


# ---------------------------------------------------------------- 4. plan-schedule's --model


def test_plan_schedule_plans_for_the_model_the_profile_records(tmp_path):
    prof = profile_of(tmp_path / "m.parquet", "tiny-llama")
    out, given = tmp_path / "s.parquet", tmp_path / "given.parquet"
    r = plan("--profile", prof, "-o", out)
    assert r.exit_code == 0, r.output
    meta = footer(out)
    assert meta["model"] == "tiny-llama"  # not smollm2-135m, the other stages' default
    assert json.loads(meta["model_config"])["hidden_size"] == get_preset("tiny-llama").config.hidden_size
    assert plan("--profile", prof, "--model", "tiny-llama", "-o", given).exit_code == 0
    assert pq.read_table(out).equals(pq.read_table(given))


def test_plan_schedule_plans_for_the_model_a_threshold_file_records(tmp_path):
    """No --profile: the threshold artifact's model picks the reference profile, as --model would."""
    th = write_artifact({"threshold": [0.86], "quantile": [0.05], "source": ["prior"], "n_runs": [0],
                         "n_collapsed": [0]},
                        tmp_path / "th.parquet", "threshold", metadata={"model": "qwen3-4b"})
    out, given = tmp_path / "s.parquet", tmp_path / "given.parquet"
    r = runner.invoke(app, ["plan-schedule", "--threshold-file", str(th), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert footer(out)["model"] == "qwen3-4b"
    r = runner.invoke(app, ["plan-schedule", "--threshold-file", str(th), "--model", "qwen3-4b", "-o",
                            str(given)])
    assert r.exit_code == 0, r.output
    assert pq.read_table(out).equals(pq.read_table(given))


def test_plan_schedule_without_a_recorded_model_asks_for_model_in_one_sentence(tmp_path):
    prof = profile_of(tmp_path / "m.parquet", None)
    out = tmp_path / "s.parquet"
    line = error_line(plan("--profile", prof, "-o", out))
    assert line.startswith("error: --model is required: --profile ") and "records no model" in line
    assert not out.exists()
    line = error_line(plan("-o", out))  # the reference profile is a preset's: --model picks it
    assert line.startswith("error: --model is required without a --profile")
    assert not out.exists()


def test_plan_schedule_help_shows_the_default_model(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    r = runner.invoke(app, ["plan-schedule", "--help"])
    assert r.exit_code == 0
    text = " ".join(r.output.replace("│", " ").split())
    assert "the profile's model" in text and "required where neither records one" in text


# ---------------------------------------------------------------- 5. fit-cost --dtype


@pytest.fixture()
def timed_weights(monkeypatch) -> list[set]:
    """The dtypes of the weights each timed engine ran with, observed where fit-cost hands them over."""
    import sparrow.stages.cost as cost

    seen: list[set] = []
    real = cost.time_decode_steps

    def spy(loaded, *args, **kwargs):
        seen.append({p.dtype for p in loaded.model.parameters()})
        return real(loaded, *args, **kwargs)

    monkeypatch.setattr(cost, "time_decode_steps", spy)
    return seen


GRID = ["--model", "tiny-qwen3", "--batches", "1,2", "--contexts", "64,128", "--budgets", "dense,48",
        "--repeats", "1", "--warmup", "0", "--threads", "1"]


@pytest.mark.parametrize("given,dtype", [("bf16", torch.bfloat16), (None, torch.float32)])
def test_fit_cost_times_and_records_the_dtype(tmp_path, timed_weights, given, dtype):
    out = tmp_path / "cost.parquet"
    r = runner.invoke(app, ["fit-cost", *GRID, *(["--dtype", given] if given else []), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert timed_weights == [{dtype}]  # auto on a CPU stays fp32, as rollout's auto does
    assert footer(out)["dtype"] == str(dtype).removeprefix("torch.")


def test_fit_cost_refuses_a_dtype_as_rollout_does(tmp_path):
    out = tmp_path / "cost.parquet"
    ours = error_line(runner.invoke(app, ["fit-cost", "--dtype", "half", "-o", str(out)]))
    theirs = error_line(runner.invoke(app, ["rollout", "--prompts", str(tmp_path / "none.parquet"),
                                            "--dtype", "half", "-o", str(tmp_path / "r.parquet")]))
    assert ours == theirs == "error: --dtype half: float16 is not supported; use bfloat16 (or float32)"
    line = error_line(runner.invoke(app, ["fit-cost", "--hardware", "h100", "--dtype", "bfloat16", "-o",
                                          str(out)]))
    assert line.startswith("error: --dtype applies only when measuring on a device")
    assert not out.exists()


def test_plan_schedule_names_the_dtype_the_cost_model_timed(tmp_path):
    cfg = get_preset("smollm2-135m").config
    points = [(b, c, k, 1e-3 * b + 1e-6 * c * (k or c) / c) for b in (1, 4) for c in (256, 512)
              for k in (0, 64)]
    bf16, unrecorded = tmp_path / "bf16.parquet", tmp_path / "none.parquet"
    write_fitted(cfg, "smollm2-135m", points, "cpu", 1, bf16, dtype="bfloat16")
    write_fitted(cfg, "smollm2-135m", points, "cpu", 1, unrecorded)
    prof = profile_of(tmp_path / "m.parquet", "smollm2-135m")
    said = plan("--profile", prof, "--cost", bf16, "--max-num-seqs", 4)
    assert said.exit_code == 0, said.output
    lines = [ln.strip() for ln in said.stderr.splitlines() if "timed in" in ln]
    assert lines == ["cost timed in: bfloat16 (the weights and KV cache of fit-cost's decode steps)"]
    silent = plan("--profile", prof, "--cost", unrecorded, "--max-num-seqs", 4)
    assert silent.exit_code == 0 and "timed in" not in silent.stderr


# ---------------------------------------------------------------- 6. profile --budget / --schedule


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A 4-layer random Llama (layers 2-3 sparse) and two prompts of token ids, longer than budget 48."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("tiny-flags")
    transformers.AutoModelForCausalLM.from_config(cfg).float().eval().save_pretrained(root / "base")
    rng = np.random.default_rng(1)
    rows = [{"prompt_id": f"t{i}", "task": "test", "prompt": None, "answer": None, "metadata": None,
             "prompt_token_ids": rng.integers(3, VOCAB, n).tolist()} for i, n in enumerate((70, 130))]
    write_artifact(rows, root / "prompts.parquet", "prompts")
    return root


SAMPLING = ["--samples", "2", "--max-new-tokens", "12", "--seed", "3", "--threads", "1"]


def test_profile_budget_samples_as_rollout_budget_does(tiny, tmp_path):
    base, prompts = str(tiny / "base"), str(tiny / "prompts.parquet")
    prof, rolled = tmp_path / "m.parquet", tmp_path / "r.parquet"
    r = runner.invoke(app, ["profile", "--model", base, "--prompts", prompts, "--budget", "48", "--budgets",
                            "48", *SAMPLING, "-o", str(prof)])
    assert r.exit_code == 0, r.output
    assert footer(prof)["sampler"] == "budget:48"
    r = runner.invoke(app, ["rollout", "--model", base, "--prompts", prompts, "--budget", "48", *SAMPLING,
                            "-o", str(rolled)])
    assert r.exit_code == 0, r.output
    scored = pq.read_table(prof).to_pandas().sort_values(["prompt_id", "sample", "position"])
    profiled = {key: g.token_id.tolist() for key, g in scored.groupby(["prompt_id", "sample"])}
    rows = pq.read_table(rolled).to_pylist()
    sampled = {(row["prompt_id"], row["sample"]): row["token_ids"] for row in rows}
    assert profiled == sampled


def test_profile_schedule_is_the_schedule_sampler(tiny, tmp_path):
    base, prompts = str(tiny / "base"), str(tiny / "prompts.parquet")
    schedule = write_artifact({"bin": [0, 1], "bin_start": [0, 256], "bin_end": [256, None],
                               "budget": [48, 64], "tail": [None, None],
                               "predicted_step_seconds": [None, None]},
                              tmp_path / "schedule.parquet", "schedule", metadata={"page_size": 16})
    by_flag, by_spec = tmp_path / "flag.parquet", tmp_path / "spec.parquet"
    for out, sampler in ((by_flag, ["--schedule", str(schedule)]),
                         (by_spec, ["--sampler", f"schedule:{schedule}"])):
        r = runner.invoke(app, ["profile", "--model", base, "--prompts", prompts, *sampler, "--budgets", "48",
                                *SAMPLING, "-o", str(out)])
        assert r.exit_code == 0, r.output
    assert footer(by_flag)["sampler"] == footer(by_spec)["sampler"] == f"schedule:{schedule}"
    assert pq.read_table(by_flag).equals(pq.read_table(by_spec))


@pytest.mark.parametrize("args,phrase", [
    (["--budget", "48", "--sampler", "dense"], "error: --budget and --sampler were given together"),
    (["--budget", "48", "--schedule", "s.parquet"], "error: --budget and --schedule were given together"),
    (["--budget", "50"], "error: --budget: budget 50 is not a multiple of the page size 16"),
])
def test_profile_sampler_flags_are_refused_in_one_sentence(tmp_path, args, phrase):
    out = tmp_path / "m.parquet"
    line = error_line(runner.invoke(app, ["profile", "--prompts", str(tmp_path / "p.parquet"), *args,
                                          "-o", str(out)]))
    assert line.startswith(phrase)
    assert not out.exists()


# ---------------------------------------------------------------- 7. distill --temperature


def test_distill_refuses_a_negative_temperature_as_rollout_does(tiny, tmp_path, no_work):
    prompts = str(tiny / "prompts.parquet")
    theirs = error_line(runner.invoke(app, ["rollout", "--prompts", prompts, "--temperature", "-1", "-o",
                                            str(tmp_path / "r.parquet")]))
    ours = error_line(runner.invoke(app, ["distill", "--model", str(tiny / "base"), "--prompts", prompts,
                                          "--budget", "48", "--temperature", "-1", "-o",
                                          str(tmp_path / "d")]))
    assert ours == theirs == "error: --temperature must be >= 0, got -1.0"
    assert not (tmp_path / "d").exists()
