"""`sparrow reward`: any sampler's completions (Parquet or JSONL) scored by their tasks, as a user sees it.

Expected rewards are computed here: 1 for the task's canonical solution, and for a wrong program the
fraction of the hidden tests it passes when called in-process, plus the format credit.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact, write_artifact
from sparrow.stages.tasks import make_prompts
from sparrow.stages.tasks import sandbox as sb
from sparrow.stages.tasks.code import FORMAT_WEIGHT

from cli_checks import error_line

runner = CliRunner()
pytestmark = pytest.mark.skipif(sb.sandbox_problem(sb.bwrap_binary()) is not None, reason="no sandbox here")


class WordTokenizer:
    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return type("Encoded", (), {"input_ids": [1] * len(text.split())})()


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.delenv(sb.UNSAFE_ENV, raising=False)  # restored after a test whose command sets it
    rows = make_prompts("code", 3, 7, WordTokenizer(), level=0)
    prompts = tmp_path / "prompts.parquet"
    write_artifact(rows, prompts, "prompts", {})
    completions, expected = [], []
    for r in rows:
        meta = json.loads(r["metadata"])
        name = meta["function"]
        wrong = f"def {name}(*args):\n    return 0\n"
        hits = sum(0 == e and type(e) is int for e in meta["expected"]) / len(meta["expected"])
        for text, reward in ((f"```python\n{r['answer']}```", 1.0),
                             (wrong, (1 - FORMAT_WEIGHT) * hits + FORMAT_WEIGHT), ("I cannot.", 0.0)):
            completions.append({"prompt_id": r["prompt_id"], "text": text})
            expected.append(reward)
    jsonl = tmp_path / "completions.jsonl"
    jsonl.write_text("".join(json.dumps(c) + "\n" for c in completions))
    return {"prompts": prompts, "jsonl": jsonl, "completions": completions, "expected": expected,
            "dir": tmp_path}


def _reward(*args):
    return runner.invoke(app, ["reward", *map(str, args)])


def test_scores_jsonl_completions(files):
    out = files["dir"] / "rewards.parquet"
    result = _reward("--prompts", files["prompts"], "--completions", files["jsonl"], "-o", out,
                     "--format", "json")
    assert result.exit_code == 0, result.output
    table = read_artifact(out, "rewards")
    assert table.column("reward").to_pylist() == pytest.approx(files["expected"])
    assert table.column("sample").to_pylist() == [0, 1, 2] * 3
    summary = json.loads(result.stdout)
    assert summary[0]["task"] == "code" and summary[0]["completions"] == 9
    assert summary[0]["accuracy"] == pytest.approx(3 / 9)
    assert artifact_metadata(out)["n"] == 9


def test_parquet_completions_and_pool_size(files):
    parquet = files["dir"] / "completions.parquet"
    pq.write_table(pa.Table.from_pylist([{**c, "sample": i % 3, "extra": 1}
                                         for i, c in enumerate(files["completions"])]), parquet)
    outs = []
    for workers in (1, 4):
        out = files["dir"] / f"rewards-{workers}.parquet"
        result = _reward("--prompts", files["prompts"], "--completions", parquet, "-o", out,
                         "--workers", workers)
        assert result.exit_code == 0, result.output
        outs.append(read_artifact(out, "rewards").column("reward").to_pylist())
    assert outs[0] == outs[1] == pytest.approx(files["expected"])


def test_bad_input_is_refused_before_any_work(files):
    out = files["dir"] / "rewards.parquet"
    stray = files["dir"] / "stray.jsonl"
    stray.write_text(json.dumps({"prompt_id": "nope", "text": "x"}) + "\n")
    line = error_line(_reward("--prompts", files["prompts"], "--completions", stray, "-o", out))
    assert "'nope'" in line and "--prompts" in line
    notext = files["dir"] / "notext.jsonl"
    notext.write_text(json.dumps({"prompt_id": "x", "completion": "y"}) + "\n")
    assert "'text'" in error_line(_reward("--prompts", files["prompts"], "--completions", notext, "-o", out))
    assert not out.exists()
    out.write_text("precious")
    line = error_line(_reward("--prompts", files["prompts"], "--completions", files["jsonl"], "-o", out))
    assert "--force" in line and out.read_text() == "precious"


def test_no_sandbox_is_refused_unless_unsafe(files, monkeypatch):
    monkeypatch.setenv("SPARROW_BWRAP", "/nonexistent/bwrap")
    out = files["dir"] / "rewards.parquet"
    line = error_line(_reward("--prompts", files["prompts"], "--completions", files["jsonl"], "-o", out))
    assert "no sandbox" in line and "--unsafe-code-execution" in line and not out.exists()
    result = _reward("--prompts", files["prompts"], "--completions", files["jsonl"], "-o", out,
                     "--unsafe-code-execution")
    assert result.exit_code == 0, result.output
    assert "WITHOUT a sandbox" in result.stderr
    assert read_artifact(out, "rewards").column("reward").to_pylist() == pytest.approx(files["expected"])


def test_prompts_whose_metadata_the_scorer_cannot_read_are_refused(files):
    table = read_artifact(files["prompts"], "prompts").to_pylist()
    table[0]["metadata"] = json.dumps({"function": "f"})
    broken = files["dir"] / "broken.parquet"
    write_artifact(table, broken, "prompts", {})
    out = files["dir"] / "rewards.parquet"
    line = error_line(_reward("--prompts", broken, "--completions", files["jsonl"], "-o", out))
    assert "'cases', 'expected'" in line and "metadata" in line and not out.exists()
