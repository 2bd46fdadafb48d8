"""Issue 11, items 1 and 2: output that fits its reader, and inputs from other tools.

- Every table command prints a complete plain table when stdout is not a terminal (TSV by default,
  `--format csv|json|tsv|table` on demand); data on stdout, messages on stderr.
- The rollout summary is also in the rollouts artifact's metadata, readable by scripts and DuckDB.
- A prompts file written by DuckDB or as JSONL, with the prompts schema's columns but none of Sparrow's
  metadata, is read by its columns and rolls out; a missing or mistyped column is one sentence.
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.cli.output import emit
from sparrow.schemas import ArtifactError, artifact_kind, artifact_metadata, read_artifact
from sparrow.stages.model.presets import PRESETS

from cli_checks import error_line

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
TINY_VOCAB = PRESETS["tiny-llama"].config.vocab_size



# ---------------------------------------------------------------- output that fits its reader


def test_models_through_a_shell_pipe_is_complete():
    """`sparrow models | cat`: the real entry point, stdout a pipe, a narrow COLUMNS."""
    r = subprocess.run(
        f"{ROOT / '.venv/bin/sparrow'} models | cat",
        shell=True,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "40"},
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "…" not in r.stdout and lines[0].startswith("preset\tarch\t")
    assert [line.split("\t")[0] for line in lines[1:]] == list(PRESETS)
    for name in PRESETS:  # `sparrow models | grep qwen3-1.7b` finds it
        assert any(line.startswith(f"{name}\t") for line in lines)


def test_models_with_cli_runner_default_is_tsv_and_table_on_request():
    r = runner.invoke(app, ["models"])
    assert r.exit_code == 0 and r.stderr == ""
    assert [line.split("\t")[0] for line in r.stdout.splitlines()] == ["preset", *PRESETS]
    table = runner.invoke(app, ["models", "--format", "table"])
    assert table.exit_code == 0 and "model presets" in table.stdout and "\t" not in table.stdout


def test_formats_parse_with_csv_and_json():
    as_csv = list(csv.DictReader(io.StringIO(runner.invoke(app, ["models", "-f", "csv"]).stdout)))
    as_json = json.loads(runner.invoke(app, ["models", "--format", "json"]).stdout)
    assert [r["preset"] for r in as_csv] == [r["preset"] for r in as_json] == list(PRESETS)
    assert as_json[0]["layers"] == PRESETS[as_json[0]["preset"]].config.num_layers  # numbers stay numbers
    plan = runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", "--format", "json"])
    assert plan.exit_code == 0, plan.output
    first = json.loads(plan.stdout.splitlines()[0])
    assert {"bin", "budget", "tail"} <= set(first["schedule"][0])


@pytest.mark.parametrize(
    "command", [["models"], ["plan-schedule", "--model", "qwen3-4b"], ["sql", "SELECT 1", "--run", "."]]
)
def test_unknown_format_is_one_sentence(command):
    line = error_line(runner.invoke(app, [*command, "--format", "xml"]))
    assert "--format must be one of table, csv, json, tsv" in line


def test_tsv_and_csv_lose_nothing_and_the_table_rounds(capsys):
    """TSV in PostgreSQL COPY's text format (\\N for None, text escaped), CSV quoted, floats whole in both;
    booleans and rendered columns alike in every text format; the table rounds for reading."""
    columns = ("x", "s", "n", "b", "budget")
    rows = [[123456789.0, "a\tb\nc\\d", None, True, None], [1 / 3, "", "", False, 64]]
    render = {"budget": lambda v: "dense" if v is None else str(v)}
    emit(columns, rows, "tsv", render=render)
    assert capsys.readouterr().out == ("x\ts\tn\tb\tbudget\n"
                                       "123456789.0\ta\\tb\\nc\\\\d\t\\N\tyes\tdense\n"
                                       "0.3333333333333333\t\t\tno\t64\n")
    emit(columns, rows, "csv", render=render)
    assert list(csv.reader(io.StringIO(capsys.readouterr().out))) == [
        list(columns), ["123456789.0", "a\tb\nc\\d", "", "yes", "dense"],
        ["0.3333333333333333", "", "", "no", "64"]]
    emit(columns, rows, "table", render=render)
    table = capsys.readouterr().out
    assert "1.23457e+08" in table and "0.333333" in table and "0.3333333" not in table


def test_a_table_prints_its_cells_and_headers_as_stored(capsys):
    emit(("[/x]:fire:",), [[":x: [bold]hi[/bold] [/INST]"]], "table")
    printed = capsys.readouterr().out
    assert "[/x]:fire:" in printed and ":x: [bold]hi[/bold] [/INST]" in printed


# ---------------------------------------------------------------- messages quote user text as typed


@pytest.mark.parametrize("command,sentence", [
    (["rollout", "--prompts", "{dir}/my:fire:[bold]data[/INST].parquet"],
     "{dir}/my:fire:[bold]data[/INST].parquet: no such prompts file"),
    (["profile", "--prompts", "{dir}/[x]:x:.parquet", "--budgets", "64"],
     "{dir}/[x]:x:.parquet: no such prompts file"),
])
def test_an_error_quotes_user_input_as_typed(tmp_path, command, sentence):
    """`:name:` is no emoji and brackets are no markup, in any command's error."""
    args = [a.format(dir=tmp_path) for a in command]
    line = error_line(runner.invoke(app, [*args, "-o", str(tmp_path / "out.parquet")]))
    assert line == f"error: {sentence.format(dir=tmp_path)}"


def test_an_error_quotes_a_spec_as_typed(real_prompts, tmp_path):
    line = error_line(runner.invoke(app, ["profile", "--prompts", str(real_prompts), "--budgets", "64",
                                          "--sampler", "budget:abc", "-o", str(tmp_path / "m.parquet")]))
    assert line.startswith("error: --sampler budget:abc")


def test_a_summary_names_the_output_as_typed(tmp_path):
    """A stage's own message (its markup around the path) through the shared console: the path as given."""
    path = tmp_path / "[x]:fire:[/INST].parquet"
    r = runner.invoke(app, ["prompts", "--task", "basic_arithmetic", "--n", "1", "-o", str(path)])
    assert r.exit_code == 0, r.output
    assert f"to {path}" in r.stderr and path.exists()


# ---------------------------------------------------------------- foreign inputs


@pytest.fixture(scope="module")
def real_prompts(tmp_path_factory) -> Path:
    """A prompts artifact as `sparrow prompts` writes it (SmolLM2's tokenizer and chat template)."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.parquet"
    r = runner.invoke(
        app, ["prompts", "--task", "basic_arithmetic", "--n", "2", "--seed", "0", "-o", str(path)]
    )
    assert r.exit_code == 0, r.output
    return path


def _duckdb_copy(select: str, path: Path) -> Path:
    duckdb.sql(f"COPY ({select}) TO '{path}' (FORMAT parquet)")
    return path


def _duck_prompts(real_prompts: Path, path: Path) -> Path:
    """DuckDB's own rewrite of the real rows: BIGINT token ids folded into the tiny model's vocabulary
    and cut to 40, no `prompt` column (optional), and a column the schema does not have."""
    return _duckdb_copy(
        f"SELECT prompt_id, task, "
        f"list_transform(prompt_token_ids[1:40], lambda x: (x % {TINY_VOCAB})::BIGINT) AS prompt_token_ids, "
        f"answer, metadata, 'duckdb' AS source FROM read_parquet('{real_prompts}')",
        path,
    )


def test_duckdb_written_prompts_are_read_by_their_columns(real_prompts, tmp_path):
    duck = _duck_prompts(real_prompts, tmp_path / "p.parquet")
    assert artifact_kind(duck) is None and pq.read_schema(duck).field("prompt_token_ids").type == pa.list_(
        pa.field("element", pa.int64())
    )
    table = read_artifact(duck, "prompts")
    ours = read_artifact(real_prompts, "prompts")
    assert table.schema.equals(ours.schema)  # widths cast, the extra column dropped, `prompt` null
    assert table["prompt_id"].to_pylist() == ours["prompt_id"].to_pylist()
    assert table["answer"].to_pylist() == ours["answer"].to_pylist()
    assert table["prompt"].null_count == 2
    with pytest.raises(ArtifactError, match="without Sparrow artifact metadata"):
        read_artifact(duck)  # no kind to go by: refused, not guessed


def test_duckdb_written_prompts_roll_out_and_the_summary_is_in_the_metadata(real_prompts, tmp_path):
    duck = _duck_prompts(real_prompts, tmp_path / "p.parquet")
    out = tmp_path / "r.parquet"
    r = runner.invoke(
        app,
        [
            "rollout",
            "--model",
            "tiny-llama",
            "--prompts",
            str(duck),
            "--samples",
            "2",
            "--max-new-tokens",
            "4",
            "--ignore-eos",
            "--budget",
            "48",
            "--format",
            "json",
            "-o",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    rows = read_artifact(out, "rollouts").to_pylist()
    ids = read_artifact(real_prompts, "prompts")["prompt_id"].to_pylist()
    assert [(x["prompt_id"], len(x["token_ids"])) for x in rows] == [(i, 4) for i in ids for _ in range(2)]
    printed = json.loads(r.stdout)  # stdout holds only the summary; messages are on stderr
    assert f"wrote 4 rollouts to {out}" in r.stderr
    summary = artifact_metadata(out)["summary"]
    assert summary == printed and summary["samples"] == 4 and summary["tokens"] == 16
    assert summary["tokens_per_s"] > 0 and summary["mean_budget"] == 48 and summary["reward_mean"] is None
    kv = duckdb.sql(f"SELECT value FROM parquet_kv_metadata('{out}') WHERE key = 'sparrow.meta'").fetchall()[
        0
    ]
    assert json.loads(kv[0])["summary"]["tokens_per_s"] == summary["tokens_per_s"]  # scripts: plain DuckDB


def test_rollout_summary_in_a_pipe_is_one_tsv_row(real_prompts, tmp_path):
    duck = _duck_prompts(real_prompts, tmp_path / "p.parquet")
    r = runner.invoke(
        app,
        [
            "rollout",
            "--model",
            "tiny-llama",
            "--prompts",
            str(duck),
            "--max-new-tokens",
            "2",
            "-o",
            str(tmp_path / "r.parquet"),
        ],
    )
    assert r.exit_code == 0, r.output
    header, row = r.stdout.splitlines()
    values = dict(zip(header.split("\t"), row.split("\t")))
    assert values["samples"] == "2" and values["mean_budget"] == "dense"  # as the table says; JSON: null


def test_jsonl_prompts_roll_out(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [
        {
            "prompt_id": f"j{i}",
            "task": "basic_arithmetic",
            "prompt_token_ids": list(range(5 + i, 40)),
            "answer": "3",
            "metadata": {"note": "nested objects become JSON text"},
        }
        for i in range(3)
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "r.parquet"
    r = runner.invoke(
        app,
        ["rollout", "--model", "tiny-llama", "--prompts", str(path), "--max-new-tokens", "3", "-o", str(out)],
    )
    assert r.exit_code == 0, r.output
    rows = read_artifact(out, "rollouts").to_pylist()
    assert [(x["prompt_id"], x["prompt_token_ids"]) for x in rows] == [
        (x["prompt_id"], x["prompt_token_ids"]) for x in lines
    ]


def test_text_only_prompts_are_tokenized_by_the_model_or_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"prompt_id": "t0", "task": "basic_arithmetic", "prompt": "What is 2 + 3?", "answer": "5"})
        + "\n"
    )
    line = error_line(
        runner.invoke(
            app,
            ["rollout", "--model", "tiny-llama", "--prompts", str(path), "-o", str(tmp_path / "no.parquet")],
        )
    )
    assert "prompt 't0' has only text and the model has no tokenizer" in line
    from sparrow.stages.model.loading import load_model

    tok = load_model("smollm2-135m").tokenizer
    templated = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                        add_generation_prompt=True, tokenize=True)
    templated = templated if isinstance(templated, list) else templated["input_ids"]  # transformers 5: a dict
    raw = tok("What is 2 + 3?", add_special_tokens=False).input_ids
    for flags, ids in (([], templated), (["--raw-prompts"], raw)):  # text goes through the chat template
        out = tmp_path / f"r{len(flags)}.parquet"
        r = runner.invoke(app, ["rollout", "--model", "smollm2-135m", "--prompts", str(path), *flags,
                                "--max-new-tokens", "1", "--temperature", "0", "-o", str(out)])
        assert r.exit_code == 0, r.output
        assert read_artifact(out, "rollouts")["prompt_token_ids"].to_pylist() == [list(ids)]


def _good_prompts() -> dict:
    return {
        "prompt_id": ["a", "b"],
        "task": ["basic_arithmetic"] * 2,
        "prompt": [None, "hi"],
        "prompt_token_ids": [[1, 2, 3], None],
        "answer": ["1", "2"],
        "metadata": [None, None],
    }


@pytest.mark.parametrize(
    "change,column,expected",
    [
        ({"drop": "task"}, "task", "lacks column 'task' required by the 'prompts' schema"),
        ({"drop": "prompt_id"}, "prompt_id", "lacks column 'prompt_id'"),
        (
            {"prompt_token_ids": ["1 2 3", None]},
            "prompt_token_ids",
            "has column 'prompt_token_ids' of type string, expected list<int32> (any list of integers)",
        ),
        (
            {"prompt_token_ids": [[1.5, 2.0], None]},
            "prompt_token_ids",
            "of type list<double>, expected list<int32>",
        ),
        ({"prompt_id": [1, 2]}, "prompt_id", "has column 'prompt_id' of type int64, expected string"),
    ],
)
def test_a_parquet_whose_columns_do_not_fit_is_one_sentence(tmp_path, change, column, expected):
    data = _good_prompts()
    data.pop(change.pop("drop", None), None)
    data.update(change)
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table(data), path)
    with pytest.raises(ArtifactError) as e:
        read_artifact(path, "prompts")
    message = str(e.value)
    assert message.startswith(f"{path} (read as 'prompts' by its columns)") and expected in message
    assert f"'{column}'" in message and "\n" not in message
    line = error_line(
        runner.invoke(
            app,
            ["rollout", "--model", "tiny-llama", "--prompts", str(path), "-o", str(tmp_path / "r.parquet")],
        )
    )
    assert str(path) in line and expected in line
    assert not (tmp_path / "r.parquet").exists()


def test_integer_widths_that_do_not_fit_are_refused_not_wrapped(tmp_path):
    path = tmp_path / "wide.parquet"
    data = {**_good_prompts(), "prompt_token_ids": pa.array([[1, 2**40], None], pa.list_(pa.int64()))}
    pq.write_table(pa.table(data), path)
    with pytest.raises(
        ArtifactError, match="has values in column 'prompt_token_ids' that do not fit list<int32> "
    ):
        read_artifact(path, "prompts")


def test_token_ids_outside_the_vocabulary_are_one_sentence(real_prompts, tmp_path):
    """Ids made by another tokenizer (SmolLM2's, 49K tokens) do not fit the tiny model's 512."""
    line = error_line(
        runner.invoke(
            app,
            [
                "rollout",
                "--model",
                "tiny-llama",
                "--prompts",
                str(real_prompts),
                "-o",
                str(tmp_path / "r.parquet"),
            ],
        )
    )
    assert f"column 'prompt_token_ids', but the model's vocabulary has {TINY_VOCAB} tokens" in line


def test_sql_sees_a_foreign_prompts_file_beside_the_artifacts(real_prompts, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _duck_prompts(real_prompts, run / "prompts.parquet")
    r = runner.invoke(
        app,
        [
            "sql",
            "SELECT prompt_id, len(prompt_token_ids) AS n FROM prompts ORDER BY 1",
            "--run",
            str(run),
            "--format",
            "csv",
        ],
    )
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert [(x["prompt_id"], x["n"]) for x in rows] == [
        (i, "40") for i in read_artifact(real_prompts, "prompts")["prompt_id"].to_pylist()
    ]
