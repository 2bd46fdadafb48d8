"""Users' reward functions (`--reward-fn path.py:function`) and the dataset's code tests (`--reward code`):
what is refused before any work, in one sentence and exit status 2, and what is accepted as verl and TRL
accept it. The expected rewards are stated here, from the functions' definitions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import read_artifact

from cli_checks import error_line
from tiny_models import tiny_chat_llama

runner = CliRunner()
ANSWERS = ["5", "24"]
TEXTS = ["it is 5", "24", "no idea"]  # each prompt's completions
VERL_COLUMNS = "ability, data_source, extra_info, reward_model"

FUNCTIONS = '''\
import numpy as np

def _text(completion):
    return completion[0]["content"] if isinstance(completion, list) else completion

def no_extra_info(data_source, solution_str, ground_truth):
    return 1.0

def gsm8k_style(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    return 1.0

def only_solution(solution_str):
    return 1.0

def verl_kwargs(solution_str, **kwargs):
    return 0.5

def compute_score(**kwargs):
    return float(kwargs["ground_truth"] in kwargs["solution_str"])

def kwargs_only(**kwargs):
    return [0.25] * len(kwargs["completions"])

not_a_function = 3

def big(data_source, solution_str, ground_truth, extra_info=None):
    return 10**400

def big_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 10**400}

def huge(data_source, solution_str, ground_truth, extra_info=None):
    return 10**5000

def infinite(data_source, solution_str, ground_truth, extra_info=None):
    return float("inf")

def no_prompts(completions, solution):
    return [1.0] * len(completions)

def needs_answer(completions, answer, **kwargs):
    return [1.0] * len(completions)

def needs_ids(prompts, completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]

def ids_in_kwargs(completions, **kwargs):
    return [float(len(ids)) for ids in kwargs["completion_ids"]]

def ids_optional(prompts, completions, completion_ids=None, **kwargs):
    return [0.5] * len(completions)

def reads_reward_model(prompts, completions, reward_model):
    return [1.0] * len(completions)

def exact_columns(prompts, completions, solution):
    return [float(s in c) for c, s in zip(completions, solution)]

def numpy_rewards(prompts, completions, **kwargs):
    return np.array([len(_text(c)) for c in completions], dtype=np.float32) / 10

def numpy_matrix(prompts, completions, **kwargs):
    return np.ones((len(completions), 1))

def tuple_rewards(prompts, completions, **kwargs):
    return tuple(0.25 for _ in completions)

def some_none(prompts, completions, **kwargs):
    return [None if _text(c) == "no idea" else 1.0 for c in completions]

async def async_verl(data_source, solution_str, ground_truth, extra_info=None):
    return float(ground_truth in solution_str)

async def async_trl(prompts, completions, solution, **kwargs):
    return [float(s in c) for c, s in zip(completions, solution)]

async def async_raises(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] == 1:
        raise ValueError("judge unreachable")
    return 1.0
'''


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A verl dataset (train.parquet), a TRL one (trl.jsonl: prompt text and solution), completions of
    both and the functions above (fns.py), in a folder that is not the current directory."""
    monkeypatch.chdir(tmp_path)
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": a},
             "extra_info": {"split": "train", "index": i}}
            for i, (q, a) in enumerate(zip(["What is 2 + 3?", "What is 4 times 6?"], ANSWERS))]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    (tmp_path / "trl.jsonl").write_text("".join(json.dumps({"prompt": q, "solution": a}) + "\n"
                                                for q, a in zip(["2 + 3?", "4 * 6?"], ANSWERS)))
    for stem in ("train", "trl"):
        (tmp_path / f"{stem}-c.jsonl").write_text("".join(
            json.dumps({"prompt_id": f"{stem}-{i}", "text": t}) + "\n" for i in range(2) for t in TEXTS))
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "fns.py").write_text(FUNCTIONS)
    return tmp_path


def _reward(work: Path, fn: str, data: str = "train", *extra: str):
    """`sparrow reward` of `data`'s completions with lib/fns.py:`fn` (or `fn` as given when it has ':')."""
    spec = fn if ":" in fn else f"{work / 'lib' / 'fns.py'}:{fn}"
    prompts = work / (f"{data}.parquet" if data == "train" else f"{data}.jsonl")
    return runner.invoke(app, ["reward", "--prompts", str(prompts), "--completions",
                               str(work / f"{data}-c.jsonl"), "--reward-fn", spec, "-o",
                               str(work / "out.parquet"), *extra])


def _rewards(work: Path) -> list[float]:
    return [r["reward"] for r in read_artifact(work / "out.parquet", "rewards").to_pylist()]


def _refused(result, *parts: str) -> str:
    line = error_line(result)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    for part in parts:
        assert part in line, line
    return line


# ---------------------------------------------------------------- signatures, before any work


@pytest.mark.parametrize("name, takes, why", [
    ("no_extra_info", "(data_source, solution_str, ground_truth)",
     "unexpected keyword argument 'extra_info'"),
    ("gsm8k_style", "(solution_str, ground_truth, method, format_score, score)",
     "unexpected keyword argument 'data_source'"),
    ("only_solution", "(solution_str)", "unexpected keyword argument 'data_source'"),
])
def test_a_verl_signature_that_cannot_take_verls_keywords_is_refused_at_load(work, name, takes, why):
    r = _reward(work, name)
    _refused(r, f"fns.py:{name} takes {takes}, which cannot be called as verl calls compute_score, with the "
                "keywords data_source, solution_str, ground_truth, extra_info", why)
    assert not (work / "out.parquet").exists()


def test_a_verl_function_with_kwargs_takes_them(work):
    assert _reward(work, "verl_kwargs").exit_code == 0
    assert _rewards(work) == [0.5] * 6


def test_a_function_of_kwargs_alone_is_verls_under_verls_default_name_else_trls(work):
    assert _reward(work, "compute_score").exit_code == 0  # called per completion with verl's keywords
    assert _rewards(work) == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]  # "5" in "it is 5"; "24" in "24"
    assert _reward(work, "kwargs_only", "train", "--force").exit_code == 0  # called per batch, as TRL does
    assert _rewards(work) == [0.25] * 6


@pytest.mark.parametrize("name, message", [
    ("no_prompts", "takes (completions, solution), which cannot take the keywords TRL passes, prompts, "
                   "completions and the dataset's columns (got an unexpected keyword argument 'prompts'); a "
                   "TRL reward function takes **kwargs for those it does not read"),
    ("needs_ids", "needs completion_ids, and these completions are text alone; score a rollouts artifact "
                  "(it keeps each completion's token ids) or give a completion_ids column"),
])
def test_a_trl_signature_that_cannot_take_what_is_passed_is_refused_at_load(work, name, message):
    _refused(_reward(work, name, "trl"), f"--reward-fn {work / 'lib' / 'fns.py'}:{name} {message}")


def test_a_trl_parameter_the_dataset_has_no_column_for_is_refused_with_the_row(work):
    r = _reward(work, "needs_answer")
    _refused(r, "train.parquet: prompt 'train-0' of task reward-fn:fns.py:needs_answer cannot be scored",
             "takes (completions, answer, **kwargs), which cannot take what TRL passes it for this row: "
             f"prompts, completions and the dataset's columns ({VERL_COLUMNS}) as keywords (missing a "
             "required argument: 'answer'); TRL fills each parameter beyond prompts and completions from the "
             "dataset's column of that name")
    assert not (work / "out.parquet").exists()


def test_a_trl_function_without_kwargs_must_name_every_column(work):
    _refused(_reward(work, "reads_reward_model"), f"columns ({VERL_COLUMNS}) as keywords (got an unexpected "
             "keyword argument 'ability'); a TRL reward function takes **kwargs for the columns it does not "
             "read")
    assert _reward(work, "exact_columns", "trl").exit_code == 0  # trl.jsonl has exactly `solution`
    assert _rewards(work) == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]  # the solution in the completion's text
    assert _reward(work, "ids_optional", "trl", "--force").exit_code == 0
    assert _rewards(work) == [0.5] * 6


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> str:
    return tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat"))


@pytest.mark.parametrize("name", ["needs_ids", "ids_in_kwargs"])
def test_a_trl_function_gets_each_completions_token_ids_as_trl_passes_them(work, tiny_chat, name):
    """completion_ids, as GRPOTrainer passes them (TRL's length rewards read them): the rollout's own token
    ids, and in `sparrow reward` those of a rollouts artifact or of a completion_ids column."""
    spec = f"{work / 'lib' / 'fns.py'}:{name}"
    rollouts = work / "rollouts.parquet"
    prompts = str(work / "trl.jsonl")
    r = runner.invoke(app, ["rollout", "--model", tiny_chat, "--prompts", prompts, "--samples", "2",
                            "--max-new-tokens", "6", "--reward-fn", spec, "-o", str(rollouts)])
    assert r.exit_code == 0, r.output
    rows = read_artifact(rollouts, "rollouts").to_pylist()
    assert [row["reward"] for row in rows] == [float(len(row["token_ids"])) for row in rows]
    table = pa.table({"prompt_id": ["trl-0", "trl-1"], "text": ["a", "b"],
                      "completion_ids": [[1, 2, 3], [4]]})
    pq.write_table(table, work / "given.parquet")
    for completions, expected in ((rollouts, [float(len(row["token_ids"])) for row in rows]),
                                  (work / "given.parquet", [3.0, 1.0])):
        r = runner.invoke(app, ["reward", "--prompts", prompts, "--completions", str(completions),
                                "--reward-fn", spec, "-o", str(work / "out.parquet"), "--force"])
        assert r.exit_code == 0, r.output
        assert _rewards(work) == expected


@pytest.mark.parametrize("command", ["rollout", "train"])
@pytest.mark.parametrize("name, message", [
    ("gsm8k_style", "which cannot be called as verl calls compute_score"),
    ("needs_answer", "(missing a required argument: 'answer')"),
])
def test_rollout_and_train_refuse_a_signature_before_the_model_loads(work, tiny_chat, command, name, message):
    out = work / ("run" if command == "train" else "rollouts.parquet")
    steps = ["--steps", "1", "--prompts-per-step", "1", "--samples", "2"] if command == "train" else []
    r = runner.invoke(app, [command, "--model", tiny_chat, "--prompts", str(work / "train.parquet"),
                            "--reward-fn", f"{work / 'lib' / 'fns.py'}:{name}", "--max-new-tokens", "2",
                            *steps, "-o", str(out)])
    _refused(r, message)
    assert "loading model" not in r.output and not out.exists()


def test_a_name_that_is_not_a_function_is_called_so(work):
    _refused(_reward(work, "not_a_function"), f"'not_a_function' in {work / 'lib' / 'fns.py'} is an int (3), "
             "not a function")
    _refused(_reward(work, "absent"), f"{work / 'lib' / 'fns.py'} has no function 'absent'")


# ---------------------------------------------------------------- what a function returns


@pytest.mark.parametrize("name, shown", [
    ("big", "returned 1" + "0" * 56 + "..."),
    ("big_score", "returned {'score': 1" + "0" * 46 + "..."),
    ("huge", "returned an int of 5,001 digits or so"),
    ("infinite", "returned inf"),
])
def test_a_number_too_large_for_a_float_is_refused_as_inf_is(work, name, shown):
    _refused(_reward(work, name), f"fns.py:{name} {shown} on row 0 (counting from 0) of train.parquet; a "
             "verl reward function returns a finite number or a dict with a numeric 'score'")
    assert not (work / "out.parquet").exists()


def test_trl_rewards_may_be_any_sequence(work):
    assert _reward(work, "numpy_rewards").exit_code == 0
    assert _rewards(work) == pytest.approx([len(t) / 10 for _ in range(2) for t in TEXTS])
    assert _reward(work, "tuple_rewards", "train", "--force").exit_code == 0
    assert _rewards(work) == [0.25] * 6
    _refused(_reward(work, "numpy_matrix", "train", "--force"),
             "returned a ndarray of shape (6, 1) for 6 completions")


def test_trl_none_is_refused_and_says_why(work):
    _refused(_reward(work, "some_none"), "fns.py:some_none returned None on row 0 (counting from 0) of "
             "train.parquet; TRL reads None as 'not applicable' and leaves the completion to its other "
             "reward functions, but Sparrow scores with this one function alone")


def test_async_functions_are_awaited(work):
    r = _reward(work, "async_verl")
    assert r.exit_code == 0 and "RuntimeWarning" not in r.output, r.output
    assert _rewards(work) == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]  # the ground truth in the completion's text
    r = _reward(work, "async_trl", "trl", "--force")
    assert r.exit_code == 0 and "RuntimeWarning" not in r.output, r.output
    assert _rewards(work) == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    r = _reward(work, "async_raises", "train", "--force")
    _refused(r, "fns.py:async_raises raised ValueError (judge unreachable) on row 1 (counting from 0) of "
                "train.parquet")
    assert "RuntimeWarning" not in r.output


# ---------------------------------------------------------------- the reward file's neighbours


def test_a_reward_file_imports_the_modules_beside_it(work):
    pkg = work / "lib" / "pkg"
    pkg.mkdir()
    (pkg / "helper.py").write_text("def score(text):\n    return len(text) / 100\n")
    (pkg / "later.py").write_text("VALUE = 0.75\n")
    (pkg / "main_r.py").write_text(
        "from helper import score\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return score(solution_str)\n\n"
        "def lazy(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    import later\n"
        "    return later.VALUE\n")
    path_before = list(sys.path)
    assert _reward(work, f"{pkg / 'main_r.py'}:compute_score").exit_code == 0  # run from another folder
    assert _rewards(work) == [len(t) / 100 for _ in range(2) for t in TEXTS]
    assert _reward(work, f"{pkg / 'main_r.py'}:lazy", "train", "--force").exit_code == 0
    assert _rewards(work) == [0.75] * 6
    assert sys.path == path_before  # the folder was on it only while the user's code ran


def test_a_relative_import_says_how_to_import_instead(work):
    (work / "lib" / "helper.py").write_text("def score(text):\n    return 1.0\n")
    (work / "lib" / "rel.py").write_text("from .helper import score\n")
    _refused(_reward(work, f"{work / 'lib' / 'rel.py'}:score"),
             f"importing {work / 'lib' / 'rel.py'} raised ImportError (attempted relative import with no "
             "known parent package); a reward file is imported as a script, with its folder on sys.path, so "
             "import the modules beside it by their names (from helper import f, not from .helper import f)")


# ---------------------------------------------------------------- --reward code


def test_code_tests_without_a_case_are_refused_before_any_work(work):
    def write(path: Path, tests: dict) -> Path:
        pq.write_table(pa.Table.from_pylist([
            {"data_source": "apps", "prompt": [{"role": "user", "content": "Print 1."}], "ability": "code",
             "reward_model": {"style": "rule", "ground_truth": json.dumps(tests)}}]), path)
        return path

    good = write(work / "code.parquet", {"inputs": [""], "outputs": ["1"]})
    (work / "code-c.jsonl").write_text(json.dumps({"prompt_id": "code-0", "text": "```python\nprint(1)\n```"})
                                       + "\n")
    out = work / "code-r.parquet"
    args = ["reward", "--completions", str(work / "code-c.jsonl"), "--reward", "code",
            "--unsafe-code-execution", "-o", str(out)]
    r = runner.invoke(app, [*args[:1], "--prompts", str(good), *args[1:]])
    assert r.exit_code == 0, r.output
    before = out.read_bytes()
    for tests in ({"inputs": [], "outputs": []}, {"fn_name": "add", "inputs": [], "outputs": []}):
        write(good, tests)
        r = runner.invoke(app, [*args[:1], "--prompts", str(good), *args[1:], "--force"])
        _refused(r, f"{good}: prompt 'code-0', row 0 (counting from 0), cannot be scored by the code-tests "
                    "reward: its tests have no cases ('inputs' and 'outputs' are empty lists)")
        assert out.read_bytes() == before


def test_rollouts_of_a_dataset_are_told_from_another_with_its_ids_wherever_the_files_are(work, tiny_chat,
                                                                                        monkeypatch):
    """Rollouts of a verl dataset (chat messages, no token ids) record each prompt's digest, so `reward`
    refuses another dataset of the same ids (verl names every split train.parquet) even after the
    sampled file moved, and takes the sampled questions from anywhere, run from any folder."""
    r = runner.invoke(app, ["rollout", "--model", tiny_chat, "--prompts", "train.parquet", "--reward", "math",
                            "--samples", "1", "--max-new-tokens", "2", "-o", "rollouts.parquet"])
    assert r.exit_code == 0, r.output
    other = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q}],
              "reward_model": {"style": "rule", "ground_truth": a}}
             for q, a in (("What is 10 - 7?", "3"), ("What is 2 + 2?", "4"))]
    for folder in ("other", "elsewhere"):
        (work / folder).mkdir()
        pq.write_table(pa.Table.from_pylist(other), work / folder / "train.parquet")
    (work / "moved").mkdir()
    (work / "train.parquet").rename(work / "moved" / "train.parquet")

    def reward(prompts: str, completions: str = "rollouts.parquet"):
        return runner.invoke(app, ["reward", "--prompts", prompts, "--completions", completions, "--reward",
                                   "math", "-o", str(work / "out.parquet"), "--force"])

    _refused(reward("other/train.parquet"), "prompt 'train-0'", "other/train.parquet", "another prompt")
    assert not (work / "out.parquet").exists()
    assert reward("moved/train.parquet").exit_code == 0
    monkeypatch.chdir(work / "elsewhere")  # its train.parquet is not the one the rollouts name
    r = reward("../moved/train.parquet", "../rollouts.parquet")
    assert r.exit_code == 0, r.output
    assert len(_rewards(work)) == 2


def test_a_reward_named_by_its_task_or_a_folder_as_the_function_file(work):
    """--reward math-verify (the task name its artifacts record) is --reward math; a folder given as the
    function's file is named as one."""
    args = ["reward", "--prompts", str(work / "train.parquet"), "--completions", str(work / "train-c.jsonl"),
            "-o", str(work / "out.parquet")]
    r = runner.invoke(app, [*args, "--reward", "MATH_VERIFY"])
    assert r.exit_code == 0, r.output
    assert read_artifact(work / "out.parquet", "rewards").column("task").to_pylist() == ["math-verify"] * 6
    _refused(runner.invoke(app, [*args, "--force", "--reward-fn", str(work / "lib")]),
             f"--reward-fn {work / 'lib'}:compute_score: {work / 'lib'} is a folder; name a Python file")


def test_a_trl_function_returning_nan_is_told_what_trl_functions_return(work):
    (work / "lib" / "nan.py").write_text("def f(completions, **kw):\n"
                                         "    return [float('nan')] * len(completions)\n")
    _refused(_reward(work, f"{work / 'lib' / 'nan.py'}:f", "trl"), "returned nan on row 0 (counting from 0) "
             "of trl.jsonl; a TRL reward function returns a list of one finite number per completion")
