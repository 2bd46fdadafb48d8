"""`sparrow profile` end to end on SmolLM2, checked against numpy, DuckDB and the invariants."""

import numpy as np
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact, write_artifact
from sparrow.stages.profile import summarize

runner = CliRunner()


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory, smollm2):
    tok = smollm2.tokenizer
    rows = []
    for i, n in enumerate((40, 70)):
        text = " ".join(f"item {j}: the {['red', 'blue', 'green'][j % 3]} box" for j in range(n))
        ids = tok(tok.apply_chat_template([{"role": "user", "content": text + " Which box is item 5?"}],
                                          add_generation_prompt=True, tokenize=False),
                  add_special_tokens=False).input_ids
        rows.append({"prompt_id": f"p{i}", "task": "test", "prompt": None, "prompt_token_ids": ids,
                     "answer": "red", "metadata": None})
    path = tmp_path_factory.mktemp("profile") / "prompts.parquet"
    write_artifact(rows, path, "prompts")
    return path


@pytest.fixture(scope="module")
def profiled(prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile-out") / "mismatch.parquet"
    r = runner.invoke(app, ["profile", "--prompts", str(prompts_file), "--budgets", "64,128,4096",
                            "--samples", "2", "--max-new-tokens", "24", "--bin-width", "256",
                            "-o", str(out)])
    assert r.exit_code == 0, r.output
    return out, read_artifact(out, "mismatch")


def test_rows_and_invariants(profiled):
    _, t = profiled
    d = t.to_pandas()
    assert set(d.budget) == {64, 128, 4096}
    per_budget = d.groupby("budget").size()
    assert per_budget.nunique() == 1 and per_budget.iloc[0] == len(d[d.budget == 64])
    full = d[d.budget == 4096]  # covers every sequence: sparse must equal dense
    assert np.all(np.abs(full.alpha - 1) <= 1e-5)
    assert np.abs(full.logp_sparse - full.logp_dense).max() <= 1e-5
    small = d[d.budget == 64]
    assert small.alpha.min() < 0.999
    assert (d.bin == d.position // 256).all()
    r = d.logp_dense - d.logp_sparse
    assert np.allclose(d.log_ratio, r, atol=1e-6)
    assert np.allclose(d.k3, np.exp(r) - 1 - r, atol=1e-5)
    assert np.allclose(d.k2, r**2 / 2, atol=1e-6)
    # the first generated token comes from the dense prefill: alpha is exactly 1 there
    first = d.groupby(["prompt_id", "sample", "budget"]).position.transform("min") == d.position
    assert np.all(np.abs(d[first].alpha - 1) <= 1e-6)


def test_tail_matches_numpy_and_sql(profiled):
    path, t = profiled
    summary = summarize(t, 0.05).to_pandas().set_index(["bin", "budget"])
    d = t.to_pandas()
    for (b, budget), g in d.groupby(["bin", "budget"]):
        assert summary.loc[(b, budget), "tail_alpha"] == pytest.approx(
            np.percentile(g.alpha.to_numpy(np.float64), 5), abs=1e-9)
    r = runner.invoke(app, ["sql", "SELECT bin, budget, quantile_cont(alpha, 0.05) AS p5 FROM mismatch "
                            "GROUP BY ALL ORDER BY ALL", "--run", str(path.parent), "--format", "csv"])
    assert r.exit_code == 0, r.output
    lines = [line.split(",") for line in r.stdout.strip().splitlines()[1:]]
    for b, budget, p5 in lines:
        assert float(p5) == pytest.approx(summary.loc[(int(b), int(budget)), "tail_alpha"], abs=1e-6)


def test_metadata(profiled):
    _, t = profiled
    meta = artifact_metadata(t)
    assert int(meta["bin_width"]) == 256 and meta["model"] == "smollm2-135m"


@pytest.mark.parametrize("args,expected", [
    (["--model", "nope"], "unknown model"),
    (["--budgets", "100"], "not a multiple of the page size"),
    (["--budgets", "32"], "below three pages"),
    (["--sampler", "budget:40"], "not a multiple"),
    (["--sampler", "sparse"], "--sampler must be"),
])
def test_bad_input(prompts_file, tmp_path, args, expected):
    out = tmp_path / "m.parquet"
    r = runner.invoke(app, ["profile", "--prompts", str(prompts_file), "-o", str(out), *args])
    assert r.exit_code != 0
    assert expected in r.output and "Traceback" not in r.output
    assert not out.exists()


def test_wrong_kind_and_empty_prompts(profiled, tmp_path):
    mismatch, _ = profiled
    r = runner.invoke(app, ["profile", "--prompts", str(mismatch), "-o", str(tmp_path / "m.parquet")])
    assert r.exit_code != 0 and "mismatch" in r.output and "prompts" in r.output
    empty = tmp_path / "empty.parquet"
    write_artifact({"prompt_id": [], "task": [], "prompt": [], "prompt_token_ids": [], "answer": [],
                    "metadata": []}, empty, "prompts")
    r = runner.invoke(app, ["profile", "--prompts", str(empty), "-o", str(tmp_path / "m.parquet")])
    assert r.exit_code != 0 and "empty" in r.output
