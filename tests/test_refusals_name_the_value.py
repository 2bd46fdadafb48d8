"""profile's and plan-schedule's refusals of a number say the value they got, as every other stage's do."""

import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import write_artifact

from cli_checks import error_line

runner = CliRunner()


@pytest.mark.parametrize(("args", "expected"), [
    (["--samples", "0"], "error: --samples must be at least 1, got 0"),
    (["--max-tokens", "-3"], "error: --max-new-tokens must be at least 1, got -3"),
    (["--bin-width", "0"], "error: --bin-width must be at least 1, got 0"),
    (["--temperature", "-0.5"], "error: --temperature must be >= 0, got -0.5"),
    (["--top-p", "1.5"], "error: --top-p must be in (0, 1], got 1.5"),
])
def test_profile_refusal_names_the_value(tmp_path, no_work, args, expected):
    prompts = tmp_path / "p.parquet"
    write_artifact([{"prompt_id": "a", "task": "basic_arithmetic", "prompt": None,
                     "prompt_token_ids": [5, 6, 7], "answer": "5", "metadata": None}], prompts, "prompts")
    out = tmp_path / "m.parquet"
    result = runner.invoke(app, ["profile", "--model", "tiny-llama", "--prompts", str(prompts),
                                 "--budgets", "48", *args, "-o", str(out)])
    assert error_line(result).startswith(expected)
    assert not out.exists()


@pytest.mark.parametrize(("flag", "value"), [("--bin-width", "0"), ("--min-tokens", "-2")])
def test_eviction_plan_refusal_names_the_flag_and_value(tmp_path, flag, value):
    profile = tmp_path / "m.parquet"
    row = {"prompt_id": "a", "sample": 0, "position": 3, "bin": 0, "budget": 64, "token_id": 1, "alpha": 1.0,
           "logp_dense": -1.0, "logp_sparse": -1.0, "log_ratio": 0.0, "k1": 0.0, "k2": 0.0, "k3": 0.0,
           "entropy_dense": 1.0}
    write_artifact([row], profile, "mismatch", metadata={"kv_compression": "snapkv", "bin_width": 512,
                                                         "model": "smollm2-135m"})
    result = runner.invoke(app, ["plan-schedule", "--profile", str(profile), flag, value])
    assert error_line(result) == f"error: {flag} must be at least 1, got {value}"
