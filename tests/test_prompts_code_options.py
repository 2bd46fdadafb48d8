"""`sparrow prompts --task code --level L --tests T`: the generator's difficulty and hidden test count, from
the command line (docs/tasks.md describes both); other tasks refuse them in one sentence."""

import json

import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact
from sparrow.stages.tasks.code import FAMILIES

from cli_checks import error_line

runner = CliRunner()


def test_level_and_tests_reach_the_prompts(tmp_path):
    out = tmp_path / "c.parquet"
    result = runner.invoke(app, ["prompts", "--task", "code", "--n", "6", "--level", "1", "--tests", "3",
                                 "-o", str(out)])
    assert result.exit_code == 0, result.output
    one_liners = {f.name for f in FAMILIES if f.level == 1}
    for row in read_artifact(out, "prompts").to_pylist():
        meta = json.loads(row["metadata"])
        assert meta["function"] in one_liners and len(meta["cases"]) == len(meta["expected"]) == 3
    assert artifact_metadata(out)["level"] == 1 and artifact_metadata(out)["tests"] == 3


def test_another_level_or_test_count_gets_other_prompt_ids(tmp_path):
    """Samples, rewards and mismatch rows are keyed by prompt_id: prompts of another level or test count
    from the same seed must not share ids; the defaults, given or not, keep the plain ones."""
    ids = {}
    for name, extra in (("plain", []), ("default", ["--level", "2", "--tests", "6"]),
                        ("one", ["--level", "1"]), ("three", ["--tests", "3"])):
        out = tmp_path / f"{name}.parquet"
        result = runner.invoke(app, ["prompts", "--task", "code", "--n", "2", *extra, "-o", str(out)])
        assert result.exit_code == 0, result.output
        ids[name] = read_artifact(out, "prompts")["prompt_id"].to_pylist()
    assert ids["plain"] == ids["default"] == ["code-0-0", "code-0-1"]
    assert ids["one"] == ["code-L1-0-0", "code-L1-0-1"] and ids["three"] == ["code-T3-0-0", "code-T3-0-1"]


@pytest.mark.parametrize(("args", "expected"), [
    (["--task", "chain_sum", "--level", "1"], "error: --level applies only to --task code, not to chain_sum"),
    (["--task", "humaneval", "--tests", "2"], "error: --tests applies only to --task code, not to humaneval"),
    (["--task", "code", "--level", "3"], "error: --level must be one of 0, 1, 2, got 3"),
    (["--task", "code", "--tests", "0"], "error: --tests must be in [1, 50], got 0"),
])
def test_code_options_are_refused_where_they_do_not_apply(tmp_path, args, expected):
    out = tmp_path / "p.parquet"
    assert error_line(runner.invoke(app, ["prompts", *args, "-o", str(out)])) == expected
    assert not out.exists()
