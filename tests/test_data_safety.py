"""Issue 26, data safety (items 1, 2, 5, 7, 8, 12): outputs never destroy what they point at, nothing is
replaced silently, unwritable outputs and unseekable inputs are handled before any work, and `sparrow sql`
is read-only over the run directory. Each test runs the CLI as a user does and checks the exit code, the
one sentence and what is left on disk.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import subprocess
import threading
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_kind, artifact_metadata, read_artifact, write_artifact
from sparrow.stages.sql import open_run

from cli_checks import error_line

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
SPARROW = ROOT / ".venv" / "bin" / "sparrow"
PROMPTS = ["prompts", "--task", "kv_lookup", "--n", "1", "--context-tokens", "600"]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def token_prompts(path: Path, n: int = 2) -> Path:
    """Prompts with token ids inside tiny-llama's vocabulary (no tokenizer needed)."""
    rows = [{"prompt_id": f"p{i}", "task": "basic_arithmetic", "prompt": None,
             "prompt_token_ids": list(range(5 + i, 30)), "answer": "3", "metadata": None} for i in range(n)]
    return write_artifact(rows, path, "prompts")


def rollout(prompts: str, out: str, *extra: str, **kw):
    return runner.invoke(app, ["rollout", "--model", "tiny-llama", "--prompts", prompts, "--max-new-tokens",
                               "2", "-o", out, *extra], **kw)


# ---------------------------------------------------------------- 1. what an output points at

def test_a_symlink_output_is_written_through_and_stays_a_link(tmp_path):
    target = tmp_path / "real" / "prompts.parquet"
    target.parent.mkdir()
    target.write_bytes(b"")  # an empty file is replaced without --force
    link = tmp_path / "link.parquet"
    link.symlink_to(target)
    r = runner.invoke(app, [*PROMPTS, "-o", str(link)])
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert artifact_kind(target) == "prompts" and read_artifact(link, "prompts").num_rows == 1
    assert sorted(p.name for p in target.parent.iterdir()) == ["prompts.parquet"]  # no temporary left


@pytest.mark.parametrize("make", ["fifo", "directory", "link to fifo"])
def test_a_fifo_or_a_directory_is_refused_and_left_as_it_was(tmp_path, make, no_work):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    out = {"fifo": fifo, "directory": tmp_path, "link to fifo": tmp_path / "l.parquet"}[make]
    if make == "link to fifo":
        out.symlink_to(fifo)
    line = error_line(rollout(str(token_prompts(tmp_path / "p.parquet")), str(out)))
    assert ("is a FIFO" if "fifo" in make else "is a directory") in line
    assert stat.S_ISFIFO(fifo.stat().st_mode) and (make != "link to fifo" or out.is_symlink())


def test_dash_writes_a_valid_parquet_file_to_stdout(tmp_path):
    r = runner.invoke(app, [*PROMPTS, "-o", "-"])
    assert r.exit_code == 0, r.output
    table = pq.read_table(io.BytesIO(r.stdout_bytes))
    assert table.num_rows == 1 and table.schema.metadata[b"sparrow.artifact"] == b"prompts"
    assert not Path("-").exists() and "to -" in r.stderr


def test_dash_in_a_shell_pipe_gives_the_parquet_bytes(tmp_path):
    """The issue's command: `sparrow prompts ... -o - | wc -c` counts the Parquet file's bytes."""
    env = {**os.environ, "PATH": f"{SPARROW.parent}:/usr/bin:/bin"}
    cmd = " ".join(PROMPTS)
    counted = subprocess.run(f"set -o pipefail; sparrow {cmd} -o - | tee saved.parquet | wc -c", shell=True,
                             executable="/bin/bash", capture_output=True, text=True, env=env, cwd=tmp_path,
                             timeout=300)
    assert counted.returncode == 0, counted.stderr
    assert int(counted.stdout) == (tmp_path / "saved.parquet").stat().st_size > 0
    assert read_artifact(tmp_path / "saved.parquet", "prompts").num_rows == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved.parquet"]


def test_rollout_to_stdout_keeps_its_summary_off_stdout(tmp_path):
    r = rollout(str(token_prompts(tmp_path / "p.parquet")), "-", "--format", "json")
    assert r.exit_code == 0, r.output
    assert pq.read_table(io.BytesIO(r.stdout_bytes)).num_rows == 2  # only the artifact on stdout
    assert "tokens / s" in r.stderr or "tokens_per_s" in r.stderr


# ---------------------------------------------------------------- 8. inputs that cannot seek

def test_prompts_dash_reads_stdin(tmp_path):
    data = token_prompts(tmp_path / "p.parquet").read_bytes()
    out = tmp_path / "r.parquet"
    r = rollout("-", str(out), input=data)
    assert r.exit_code == 0, r.output
    assert read_artifact(out, "rollouts").column("prompt_id").to_pylist() == ["p0", "p1"]
    assert not (tmp_path / "-").exists()
    assert artifact_metadata(out)["prompts"] == "-"  # what the user gave, not the gone temporary copy


def test_a_schedule_from_stdin_is_recorded_as_stdin(tmp_path):
    """The sampler a rollout records (and `sql` shows as source_sparsity) names what the user gave, `-`,
    not the private copy of stdin that is gone when the command ends."""
    one_bin = {"bin": [0], "bin_start": [0], "bin_end": [None], "budget": [64], "tail": [None],
               "predicted_step_seconds": [None]}
    schedule = write_artifact(one_bin, tmp_path / "s.parquet", "schedule", metadata={"page_size": 16})
    out = tmp_path / "r.parquet"
    r = rollout(str(token_prompts(tmp_path / "p.parquet")), str(out), "--schedule", "-",
                input=schedule.read_bytes())
    assert r.exit_code == 0, r.output
    assert artifact_metadata(out)["sparsity"] == "schedule -"


def test_prompts_from_a_fifo_are_buffered(tmp_path):
    data = token_prompts(tmp_path / "p.parquet").read_bytes()
    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)

    def feed():
        with open(fifo, "wb") as f:
            f.write(data)

    writer = threading.Thread(target=feed)
    writer.start()
    r = rollout(str(fifo), str(tmp_path / "r.parquet"))
    writer.join(timeout=60)
    assert r.exit_code == 0, r.output
    assert read_artifact(tmp_path / "r.parquet", "rollouts").num_rows == 2
    assert artifact_metadata(tmp_path / "r.parquet")["prompts"] == str(fifo)


def test_cat_into_dev_stdin(tmp_path):
    """The issue's command: `cat prompts.parquet | sparrow rollout --prompts /dev/stdin ...`."""
    token_prompts(tmp_path / "p.parquet")
    r = subprocess.run(f"cat p.parquet | {SPARROW} rollout --model tiny-llama --prompts /dev/stdin "
                       "--max-new-tokens 2 -o r.parquet", shell=True, capture_output=True, text=True,
                       cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert read_artifact(tmp_path / "r.parquet", "rollouts").num_rows == 2


def test_empty_stdin_is_one_sentence(tmp_path, no_work):
    line = error_line(rollout("-", str(tmp_path / "r.parquet"), input=b""))
    assert "--prompts -: nothing was read" in line and not (tmp_path / "r.parquet").exists()


# ---------------------------------------------------------------- 5. nothing replaced silently

def test_a_text_file_is_not_replaced_without_force(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    line = error_line(runner.invoke(app, [*PROMPTS, "-o", str(notes)]))
    assert "notes.txt exists and is not a Sparrow artifact, not a 'prompts' artifact" in line
    assert "pass --force to replace it" in line and notes.read_text() == "my notes\n"
    r = runner.invoke(app, [*PROMPTS, "-o", str(notes), "--force"])
    assert r.exit_code == 0, r.output
    assert artifact_kind(notes) == "prompts"


@pytest.mark.parametrize("cmd", [["plan-schedule", "--model", "qwen3-4b", "-o"],
                                 ["fit-cost", "--model", "qwen3-4b", "--hardware", "h100", "-o"],
                                 ["plan-schedule", "--model", "qwen3-4b", "--export", "json", "--export-to"]])
def test_every_writer_follows_the_rule(tmp_path, cmd):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    line = error_line(runner.invoke(app, [*cmd, str(notes)]))
    assert "notes.txt exists and" in line and "pass --force to replace it" in line
    assert notes.read_text() == "my notes\n"
    assert runner.invoke(app, [*cmd, str(notes), "--force"]).exit_code == 0
    again = runner.invoke(app, [*cmd, str(notes)])  # now of its own kind: replaced without --force
    assert again.exit_code == 0, again.output
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "target")
    assert runner.invoke(app, [*cmd, str(link)]).exit_code == 0
    assert link.is_symlink() and (tmp_path / "target").read_bytes() == notes.read_bytes()


def test_report_writes_into_a_foreign_folder_only_when_forced(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    schedule = {"bin": [0], "bin_start": [0], "bin_end": [None], "budget": [64], "tail": [0.9],
                "predicted_step_seconds": [None]}
    write_artifact(schedule, run / "schedule.parquet", "schedule", {"page_size": 16})
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("...")
    line = error_line(runner.invoke(app, ["report", str(run), "-o", str(mine)]))
    assert line.endswith("is not a Sparrow report folder; pass --force to write the report's files into it "
                         "(its other files are kept), or choose another directory")
    assert sorted(os.listdir(mine)) == ["thesis.tex"]
    r = runner.invoke(app, ["report", str(run), "-o", str(mine), "--force"])
    assert r.exit_code == 0, r.output
    assert (mine / "thesis.tex").read_text() == "..." and (mine / "index.html").exists()
    assert runner.invoke(app, ["report", str(run), "-o", str(mine)]).exit_code == 0  # now a report folder


def test_an_artifact_of_another_kind_is_refused_before_any_work(tmp_path, no_work):
    prompts = token_prompts(tmp_path / "p.parquet")
    other = token_prompts(tmp_path / "other.parquet")  # not its input, which even --force never replaces
    before = digest(other)
    line = error_line(runner.invoke(app, ["profile", "--model", "tiny-llama", "--prompts", str(prompts),
                                          "-o", str(other)]))
    assert "is a 'prompts' artifact, not a 'mismatch' artifact; pass --force" in line
    assert digest(other) == before


def test_an_artifact_of_the_same_kind_is_replaced(tmp_path):
    out = tmp_path / "p.parquet"
    token_prompts(out, n=5)
    r = runner.invoke(app, [*PROMPTS, "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert read_artifact(out, "prompts").num_rows == 1


def test_distill_refuses_an_adapter_it_did_not_write(tmp_path, no_work):
    adapter = tmp_path / "adapter"  # a training run's adapter: no sparrow_distill.json
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    args = ["distill", "--model", "tiny-llama", "--rollouts", str(tmp_path / "r.parquet"), "--budget", "48",
            "-o", str(adapter)]
    line = error_line(runner.invoke(app, args))
    assert "is not an adapter written by sparrow distill; pass --force" in line
    mine = tmp_path / "mine"  # a directory of other files: never replaced, not even with --force
    mine.mkdir()
    (mine / "thesis.tex").write_text("...")
    line = error_line(runner.invoke(app, [*args[:-1], str(mine), "--force"]))
    assert "is a directory that is not an adapter written by sparrow distill; choose a new directory" in line
    assert (mine / "thesis.tex").read_text() == "..."
    assert (adapter / "adapter_config.json").read_text() == "{}"


def test_train_refuses_a_file_of_a_run_name_that_is_not_of_its_kind(tmp_path, no_work):
    run = tmp_path / "run"
    run.mkdir()
    token_prompts(run / "metrics.parquet")  # a prompts artifact where the run's metrics would go
    line = error_line(runner.invoke(app, ["train", "--model", "tiny-llama", "--prompts",
                                          str(token_prompts(tmp_path / "p.parquet")), "-o", str(run)]))
    assert "metrics.parquet exists and is a 'prompts' artifact, not the run's 'metrics' artifact" in line
    assert "--force" in line and artifact_kind(run / "metrics.parquet") == "prompts"


# ---------------------------------------------------------------- 7. unwritable outputs, before any work

@pytest.mark.parametrize("where", ["/proc/nope/p.parquet", "under a file"])
def test_an_unwritable_output_is_one_sentence_before_any_work(tmp_path, where, no_work):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = where if where.startswith("/") else str(blocker / "deep" / "r.parquet")
    result = rollout(str(token_prompts(tmp_path / "p.parquet")), out)
    assert result.exit_code == 2
    line = error_line(result)
    assert "cannot be written" in line and ("/proc" in line if where.startswith("/") else "is a file" in line)
    assert not Path("/proc/nope").exists() and blocker.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_is_refused(tmp_path, no_work):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        line = error_line(rollout(str(token_prompts(tmp_path / "p.parquet")), str(ro / "r.parquet")))
    finally:
        ro.chmod(0o755)
    assert "cannot be written: no file can be created in" in line


def test_train_output_under_a_file_is_refused_before_any_work(tmp_path, no_work):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = error_line(runner.invoke(app, ["train", "--model", "tiny-llama", "--prompts",
                                          str(token_prompts(tmp_path / "p.parquet")), "-o",
                                          str(blocker / "run")]))
    assert "is a file, so nothing can be created under it" in line


# ---------------------------------------------------------------- 2. sparrow sql is read-only

@pytest.fixture()
def run_dir(tmp_path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    token_prompts(run / "prompts.parquet")
    return run


def sql(run: Path, query: str, *extra: str):
    return runner.invoke(app, ["sql", query, "--run", str(run), *extra])


def test_sql_copy_is_refused_and_writes_nothing(run_dir, tmp_path):
    before = digest(run_dir / "prompts.parquet")
    outside = tmp_path / "x.csv"
    artifact = run_dir / "prompts.parquet"
    for query in (f"COPY (SELECT 1) TO '{outside}'",
                  f"COPY (SELECT 42 AS a) TO '{artifact}' (FORMAT parquet)",
                  f"COPY (SELECT 42 AS a) TO '{artifact}' (FORMAT parquet, USE_TMP_FILE false)",
                  f"EXPLAIN ANALYZE COPY prompts TO '{outside}'", f"SELECT 1; COPY prompts TO '{outside}'"):
        line = error_line(sql(run_dir, query))
        assert "sparrow sql is read-only over the run's views, so COPY is refused" in line and "-o" in line
    assert not outside.exists() and digest(run_dir / "prompts.parquet") == before
    assert sorted(p.name for p in run_dir.iterdir()) == ["prompts.parquet"]


@pytest.mark.parametrize("query,word", [
    ("ATTACH '{d}/evil.db' AS evil; CREATE TABLE evil.t AS SELECT 1", "ATTACH"),
    ("INSTALL httpfs", "INSTALL"), ("LOAD httpfs", "LOAD"), ("CREATE TABLE t AS SELECT 1", "CREATE"),
    ("SET enable_external_access = true", "SET"), ("EXPORT DATABASE '{d}/dump'", "EXPORT"),
])
def test_sql_statements_that_write_or_reach_out_are_refused(run_dir, tmp_path, query, word):
    line = error_line(sql(run_dir, query.format(d=tmp_path)))
    assert f"sparrow sql is read-only over the run's views, so {word} is refused" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.parametrize("query", ["SELECT * FROM read_csv('/etc/passwd')",
                                   "SELECT * FROM read_text('/etc/hostname')",
                                   "SELECT * FROM read_parquet('/etc/nope.parquet')",
                                   "SELECT * FROM glob('/etc/*')"])
def test_sql_reads_nothing_outside_the_run(run_dir, query):
    line = error_line(sql(run_dir, query))
    assert "Permission Error" in line and "reads only the run's artifacts" in line


def test_sql_reads_still_work(run_dir):
    for query in ("SELECT count(*) AS n FROM prompts", "DESCRIBE prompts", "SUMMARIZE prompts",
                  "WITH x AS (SELECT 1 AS n) SELECT n FROM x", "PIVOT prompts ON task USING count(*)",
                  "EXPLAIN SELECT * FROM prompts"):
        r = sql(run_dir, query, "-f", "json")
        assert r.exit_code == 0, (query, r.output)
    assert json.loads(sql(run_dir, "SELECT count(*) AS n FROM prompts", "-f", "json").stdout) == [{"n": 2}]


def test_duckdb_itself_is_sandboxed_to_the_run(run_dir, tmp_path):
    """The second layer, without the statement check: DuckDB's own settings on the connection."""
    con = open_run(run_dir)
    try:
        for query in (f"COPY (SELECT 1) TO '{tmp_path / 'x.csv'}'", f"ATTACH '{tmp_path / 'evil.db'}'",
                      "SELECT * FROM read_csv('/etc/passwd')", "INSTALL httpfs", "LOAD httpfs"):
            with pytest.raises(duckdb.PermissionException):
                con.execute(query)
        with pytest.raises(duckdb.Error, match="configuration has been locked"):
            con.execute("SET enable_external_access = true")
        assert con.execute("SELECT current_setting('autoinstall_known_extensions'), "
                           "current_setting('autoload_known_extensions')").fetchone() == (False, False)
        assert con.execute("SELECT count(*) FROM prompts").fetchone() == (2,)
    finally:
        con.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_sql_writes_only_through_its_own_output(run_dir, tmp_path):
    out = tmp_path / "tails.parquet"
    assert sql(run_dir, "SELECT 1 AS a", "-o", str(out)).exit_code == 0
    assert sql(run_dir, "SELECT 2 AS a", "-o", str(out)).exit_code == 0  # a query result: replaced
    assert pq.read_table(out).to_pylist() == [{"a": 2}]
    line = error_line(sql(run_dir, "SELECT 3 AS a", "-o", str(run_dir / "prompts.parquet"), "--force"))
    assert "is a file of the --run this command reads; choose another path" in line
    assert artifact_kind(run_dir / "prompts.parquet") == "prompts"
    r = sql(run_dir, "SELECT 4 AS a", "-o", "-")
    assert r.exit_code == 0 and pq.read_table(io.BytesIO(r.stdout_bytes)).to_pylist() == [{"a": 4}]


# ---------------------------------------------------------------- 12. one bad Parquet file

def test_sql_skips_an_unrelated_bad_parquet_with_a_warning(run_dir):
    (run_dir / "download.parquet").write_bytes(b"<html>not found</html>")
    (run_dir / "half.parquet").write_bytes((run_dir / "prompts.parquet").read_bytes()[:100])
    r = sql(run_dir, "SELECT count(*) AS n FROM prompts", "-f", "json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == [{"n": 2}]
    err = " ".join(r.stderr.split())
    assert "download.parquet is not a Parquet file" in err
    assert "half.parquet is a truncated Parquet file" in err
    assert err.count("warning:") == 2
