"""Stages that compose: complete plain tables through a real pipe, and prompts written by other tools
(DuckDB Parquet, JSONL) rolled out as they are."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import duckdb
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import read_artifact, write_artifact
from sparrow.stages.model.presets import PRESETS

runner = CliRunner()


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The real command with stdout a pipe (not a terminal), as in `sparrow models | grep ...`."""
    code = "import sys; from sparrow.cli.app import main; sys.argv = ['sparrow', *sys.argv[1:]]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "80"})


def test_models_through_a_pipe_lists_every_preset_in_full():
    r = _cli("models")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split("\t")[0] == "preset"
    assert {line.split("\t")[0] for line in lines[1:]} == set(PRESETS)
    assert all(len(line.split("\t")) == 12 for line in lines)


def test_table_formats_parse():
    import csv
    import io

    as_json = json.loads(runner.invoke(app, ["models", "--format", "json"]).stdout)
    as_csv = list(csv.DictReader(io.StringIO(runner.invoke(app, ["models", "--format", "csv"]).stdout)))
    assert [r["preset"] for r in as_json] == [r["preset"] for r in as_csv] == list(PRESETS)
    plan = runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", "--format", "csv"])
    assert plan.exit_code == 0 and plan.stdout.splitlines()[0] == "bin,positions,budget,tail,step ms,dense ms"


def _tiny_prompts(tmp_path):
    rows = [{"prompt_id": f"p{i}", "task": "basic_arithmetic", "prompt": None,
             "prompt_token_ids": list(range(3 + i, 40 + i)), "answer": "7", "metadata": None}
            for i in range(2)]
    return write_artifact(rows, tmp_path / "ours.parquet", "prompts")


def test_duckdb_written_prompts_roll_out(tmp_path):
    ours = _tiny_prompts(tmp_path)
    duck = tmp_path / "duck.parquet"
    duckdb.sql(f"COPY (SELECT prompt_id, task, prompt, prompt_token_ids, answer, metadata "
               f"FROM read_parquet('{ours}')) TO '{duck}' (FORMAT parquet)")
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, ["rollout", "--model", "tiny-llama", "--prompts", str(duck), "--samples", "2",
                            "--max-new-tokens", "4", "--temperature", "0", "-o", str(out)])
    assert r.exit_code == 0, r.output
    rows = read_artifact(out, "rollouts").to_pylist()
    got = [(x["prompt_id"], len(x["token_ids"])) for x in rows]
    assert got == [("p0", 4), ("p0", 4), ("p1", 4), ("p1", 4)]


def test_jsonl_prompts_roll_out_and_a_bad_column_is_one_sentence(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt_id": f"j{i}", "task": "basic_arithmetic",
                                          "prompt_token_ids": list(range(5, 30))}) for i in range(2)))
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, ["rollout", "--model", "tiny-llama", "--prompts", str(path),
                            "--max-new-tokens", "3", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert read_artifact(out, "rollouts").num_rows == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt_id": "x", "task": "t", "prompt_token_ids": "5 6 7"}))
    r = runner.invoke(app, ["rollout", "--model", "tiny-llama", "--prompts", str(bad),
                            "-o", str(tmp_path / "b")])
    assert r.exit_code != 0 and "has column 'prompt_token_ids' of type string" in r.stderr
