"""`sparrow prompts`: writes a valid prompts artifact; rejects bad input with one clear line."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from sparrow.cli.prompts import _LazyProgress, prompts
from sparrow.schemas import artifact_metadata, read_artifact

from cli_checks import error_line

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_app() -> typer.Typer:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

    @app.callback()
    def _root() -> None:
        """Only `prompts`, so these tests do not depend on the other subcommands importing."""

    app.command("prompts")(prompts)
    return app


def _run(app, *args: str):
    return runner.invoke(app, ["prompts", *args])



def test_writes_a_prompts_artifact(tiny_app, tmp_path):
    out = tmp_path / "kv.parquet"
    result = _run(tiny_app, "--task", "kv_lookup", "--n", "3", "--seed", "5", "--context-tokens", "1000",
                  "-o", str(out))
    assert result.exit_code == 0, result.output
    table = read_artifact(out, "prompts")
    assert table.num_rows == 3
    assert set(table.column("task").to_pylist()) == {"kv_lookup"}
    lengths = [len(ids) for ids in table.column("prompt_token_ids").to_pylist()]
    assert all(abs(n - 1000) <= 100 for n in lengths)
    meta = artifact_metadata(out)
    assert meta["task"] == "kv_lookup" and meta["n"] == 3 and meta["seed"] == 5
    assert meta["model"] == "smollm2-135m"
    assert "wrote 3 kv_lookup prompts" in result.stderr and "prompt tokens: mean" in result.stderr


@pytest.mark.parametrize("args,message", [
    (["--task", "nope"], "unknown task 'nope'; known tasks: gsm_symbolic"),
    (["--task", "chain_sum", "--n", "0"], "--n must be at least 1"),
    (["--task", "kv_lookup", "--context-tokens", "9000"], "exceeds the context of smollm2-135m (8192"),
    (["--task", "kv_lookup", "--context-tokens", "10"], "--context-tokens must be at least"),
    (["--task", "chain_sum", "--context-tokens", "1000"], "applies only to long-context tasks"),
    (["--task", "chain_sum", "--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--task", "chain_sum", "--model", "tiny-llama"], "has no tokenizer"),
    (["--task", "basic_arithmetic", "--seed", "-1"], "--seed must be >= 0, got -1"),
])
def test_rejects_bad_input(tiny_app, tmp_path, args, message):
    out = tmp_path / "p.parquet"
    line = error_line(_run(tiny_app, *args, "-o", str(out)))
    assert message in line
    assert not out.exists()


def _humaneval_ids(path) -> list[str]:
    import json

    return [json.loads(m)["task_id"] for m in read_artifact(path, "prompts").column("metadata").to_pylist()]


def test_humaneval_splits_never_share_a_problem(tiny_app, tmp_path):
    got = {}
    for split, seed, n in (("train", 0, 123), ("test", 1, 41), ("test", 0, 8)):
        out = tmp_path / f"{split}-{seed}.parquet"
        result = _run(tiny_app, "--task", "humaneval", "--split", split, "--seed", str(seed), "--n", str(n),
                      "-o", str(out))
        assert result.exit_code == 0, result.output
        got[split, seed] = _humaneval_ids(out)
        assert artifact_metadata(out)["split"] == split
        assert read_artifact(out, "prompts").column("prompt_id")[0].as_py() == f"humaneval-{split}-{seed}-0"
    every_fourth = {f"HumanEval/{k}" for k in range(0, 164, 4)}  # the documented test split
    assert set(got["test", 1]) == every_fourth and len(got["test", 1]) == 41
    assert set(got["train", 0]) == {f"HumanEval/{k}" for k in range(164)} - every_fourth
    assert len(set(got["train", 0])) == 123 and set(got["test", 0]) <= every_fourth


@pytest.mark.parametrize("args,message", [
    (["--n", "500"], "--n 500 is more than the 164 problems of humaneval's 'all' split; ask for at most 164"),
    (["--n", "42", "--split", "test"], "--n 42 is more than the 41 problems of humaneval's 'test' split"),
    (["--split", "eval"], "--split must be one of all, train, test, got 'eval'"),
])
def test_humaneval_refuses_more_prompts_than_problems_before_loading_a_tokenizer(tiny_app, tmp_path,
                                                                                 monkeypatch, args, message):
    import sparrow.stages.tasks.tokenizers as tokenizers

    monkeypatch.setattr(tokenizers, "load_model_tokenizer", lambda spec: pytest.fail("the tokenizer loaded"))
    out = tmp_path / "p.parquet"
    line = error_line(_run(tiny_app, "--task", "humaneval", *args, "-o", str(out)))
    assert message in line and not out.exists()


def test_split_is_refused_for_generated_tasks(tiny_app, tmp_path):
    out = tmp_path / "p.parquet"
    line = error_line(_run(tiny_app, "--task", "code", "--split", "test", "-o", str(out)))
    assert "--split applies only to tasks with a fixed set of problems (humaneval)" in line
    assert not out.exists()


def test_checkpoint_directory_uses_its_own_tokenizer(tiny_app, tmp_path):
    from sparrow.stages.model.loading import embedded_checkpoint

    out = tmp_path / "p.parquet"
    result = _run(tiny_app, "--task", "count", "--n", "1", "--context-tokens", "700",
                  "--model", str(embedded_checkpoint()), "-o", str(out))
    assert result.exit_code == 0, result.output
    row = read_artifact(out, "prompts").to_pylist()[0]
    assert row["prompt"].startswith("<|im_start|>system") and abs(len(row["prompt_token_ids"]) - 700) <= 70


def test_rejects_a_directory_as_output(tiny_app, tmp_path):
    assert "is a directory" in error_line(_run(tiny_app, "--task", "chain_sum", "-o", str(tmp_path)))


def test_through_the_real_app(tmp_path):
    try:
        from sparrow.cli.app import app
    except ImportError as e:  # another subcommand's module is still being written
        pytest.skip(f"sparrow.cli.app does not import yet: {e}")
    out = tmp_path / "sums.parquet"
    result = runner.invoke(app, ["prompts", "--task", "chain_sum", "--n", "4", "-o", str(out)])
    assert result.exit_code == 0, result.output
    rows = read_artifact(out, "prompts").to_pylist()
    assert [r["prompt_id"] for r in rows] == [f"chain_sum-0-{i}" for i in range(4)]
    assert all("\\boxed{}" in r["prompt"] and r["answer"] for r in rows)
    assert "--task" in runner.invoke(app, ["prompts", "--help"]).output


def test_progress_bar_appears_only_after_the_delay_on_a_terminal(monkeypatch):
    from sparrow.cli.console import console

    in_a_pipe = _LazyProgress(3, "x", delay=0)  # a log gets no bar (issue 26, item 17)
    in_a_pipe(1)
    assert in_a_pipe.bar is None
    monkeypatch.setattr(console, "_force_terminal", True)
    quick = _LazyProgress(3, "x", delay=60)
    quick(1)
    assert quick.bar is None
    slow = _LazyProgress(3, "x", delay=0)
    slow(1)
    assert slow.bar is not None
    slow(3)
    slow.close()
