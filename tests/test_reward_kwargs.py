"""`--reward-kwargs` (verl's `custom_reward_function.reward_kwargs`): keywords passed to every call of
`--reward-fn`'s function besides what verl or TRL passes, refused where they would override those or where
the function cannot take them, recorded with the rewards. Expected rewards are worked out here from the
completions' text and the functions' definitions, never read from the code under test.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact
from sparrow.stages.core.user_data import DataOptions
from sparrow.stages.rollout_journal import REWARD_FIELDS, Manifest

from cli_checks import error_line

runner = CliRunner()

VERL = """def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0, scale=1.0):
    return {"score": scale * float(ground_truth in solution_str) + bonus, "bonus": bonus}
"""
TRL = """def near(prompts, completions, target=10, **kwargs):
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]  # text, or messages
    return [-abs(len(t) - target) for t in texts]
"""
TEXTS = {("gsm8k-0", 0): "it is 1", ("gsm8k-0", 1): "no idea", ("gsm8k-1", 0): "2, surely"}


@pytest.fixture
def data(tmp_path):
    """(dataset, completions, folder): a verl dataset of 2 prompts and 3 completions as JSON lines."""
    path = tmp_path / "gsm8k.parquet"
    pd.DataFrame([{"data_source": "openai/gsm8k",
                   "prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "ability": "math",
                   "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
                   "extra_info": {"index": i}} for i in range(2)]).to_parquet(path)
    completions = tmp_path / "done.jsonl"
    completions.write_text("".join(json.dumps({"prompt_id": p, "sample": s, "text": t}) + "\n"
                                   for (p, s), t in TEXTS.items()))
    (tmp_path / "verl_fn.py").write_text(VERL)
    (tmp_path / "trl_fn.py").write_text(TRL)
    return path, completions, tmp_path


def _reward(data, fn, kwargs, out="rewards.parquet"):
    path, completions, folder = data
    return runner.invoke(app, ["reward", "--prompts", str(path), "--completions", str(completions),
                               "--reward-fn", str(folder / fn), "--reward-kwargs", kwargs,
                               "-o", str(folder / out)])


def _scores(path) -> dict[tuple[str, int], float]:
    return {(r["prompt_id"], r["sample"]): r["reward"] for r in read_artifact(path, "rewards").to_pylist()}


def test_a_verl_function_gets_the_keywords_on_every_call(data):
    r = _reward(data, "verl_fn.py", '{"bonus": 0.25, "scale": 2}')
    assert r.exit_code == 0, r.output
    answers = {"gsm8k-0": "1", "gsm8k-1": "2"}
    expected = {k: 2 * float(answers[k[0]] in t) + 0.25 for k, t in TEXTS.items()}
    out = data[2] / "rewards.parquet"
    assert _scores(out) == expected
    meta = artifact_metadata(out)
    assert meta["reward_kwargs"] == '{"bonus":0.25,"scale":2}'
    extras = [json.loads(x) for x in read_artifact(out, "rewards").column("reward_extra").to_pylist()]
    assert {e["bonus"] for e in extras} == {0.25}


def test_a_trl_function_gets_the_keywords_beside_the_columns(data):
    r = _reward(data, "trl_fn.py:near", '{"target": 3}')
    assert r.exit_code == 0, r.output
    assert _scores(data[2] / "rewards.parquet") == {k: -abs(len(t) - 3) for k, t in TEXTS.items()}


def test_two_keyword_sets_of_one_function_register_apart_in_one_process(data):
    """The keywords are part of the reward's name: each set registers its own reward."""
    fn = str(data[2] / "verl_fn.py")
    one = DataOptions(reward_fn=fn, reward_kwargs={"bonus": 1})
    two = DataOptions(reward_fn=fn, reward_kwargs={})
    assert one.reward_task() == "reward-fn:verl_fn.py:compute_score(bonus=1)"
    assert two.reward_task() == "reward-fn:verl_fn.py:compute_score"


@pytest.mark.parametrize("fn,kwargs,said", [
    ("verl_fn.py", '{"solution_str": "x"}', "error: --reward-kwargs solution_str: verl passes it to the "
                                             "function itself (data_source, solution_str, ground_truth, "
                                             "extra_info); give your keywords other names"),
    ("trl_fn.py:near", '{"completions": 1}', "error: --reward-kwargs completions: TRL passes it to the "
                                             "function itself"),
    ("trl_fn.py:near", '{"ability": 1}', "--reward-kwargs ability: the dataset has a column of that name, "
                                         "which TRL passes the function as a keyword"),
    ("verl_fn.py", '{"nope": 1}', "and --reward-kwargs' nope (got an unexpected keyword argument 'nope')"),
    ("verl_fn.py", '[1]', "error: --reward-kwargs '[1]' is a JSON list, not an object of keywords"),
    ("verl_fn.py", '{bad', "error: --reward-kwargs '{bad' is not JSON ("),
    ("verl_fn.py", '{"a b": 1}', "error: --reward-kwargs key 'a b' is not a Python name"),
])
def test_keywords_that_cannot_be_passed_are_refused_before_any_work(data, fn, kwargs, said):
    r = _reward(data, fn, kwargs)
    line = error_line(r)
    assert r.exit_code == 2 and said in line, r.output
    assert not (data[2] / "rewards.parquet").exists()


def test_keywords_without_a_function_of_ones_own_are_refused(data):
    path, completions, folder = data
    r = runner.invoke(app, ["reward", "--prompts", str(path), "--completions", str(completions), "--reward",
                            "math", "--reward-kwargs", '{"a": 1}', "-o", str(folder / "r.parquet")])
    assert r.exit_code == 2
    assert error_line(r) == ("error: --reward-kwargs passes keywords to a function of yours; name it with "
                             "--reward-fn")


def test_a_journal_scored_with_other_keywords_is_rescored_not_refused():
    """The keywords are what scores, as --reward-fn is: a resume may change them (its parts are scored
    again), and the journal's manifest names them."""
    base = dict(model="m", prompts=2, prompts_sha256="a", samples=2, max_new_tokens=4, temperature=1.0,
                top_p=1.0, top_k=0, seed=0, ignore_eos=False, kv_policy="dense", schedule_sha256="",
                dense_layers=(0, 1), page_size=16, speculate=0, dtype="float32", device="cpu",
                adapter_sha256="", reward=None, reward_fn="/f.py:compute_score", reward_fn_sha256="b",
                raw_prompts=False)
    saved, now = Manifest(**base, reward_kwargs='{"bonus":1}'), Manifest(**base)
    assert "reward_kwargs" in REWARD_FIELDS and saved.difference(now) == "reward_kwargs"
    assert saved.difference(now, ignoring=REWARD_FIELDS) is None
    assert saved.scorer["reward_kwargs"] == '{"bonus":1}'
    assert "--reward-kwargs '{\"bonus\":1}'" in saved.scored_by()
    older = {k: v for k, v in now.record().items() if k != "reward_kwargs"}  # a journal from before them
    assert Manifest.of(older) == now


def test_train_records_the_keywords_and_a_resume_with_others_is_refused(tmp_path):
    from tiny_models import tiny_chat_llama

    model = tiny_chat_llama(tmp_path / "model")
    (tmp_path / "fn.py").write_text(TRL)
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in ("What is 2 + 2?", "Name a colour.")))
    run = tmp_path / "run"
    args = ["train", "--model", model, "--prompts", str(data), "--reward-fn", f"{tmp_path / 'fn.py'}:near",
            "--steps", "1", "--prompts-per-step", "2", "--samples", "2", "--max-new-tokens", "3",
            "-o", str(run)]
    r = runner.invoke(app, [*args, "--reward-kwargs", '{"target": 2}'])
    assert r.exit_code == 0, r.output
    assert json.loads((run / "checkpoint" / "config.json").read_text())["reward_kwargs"] == '{"target":2}'
    r = runner.invoke(app, [*args, "--steps", "2", "--resume", "--reward-kwargs", '{"target": 5}'])
    assert r.exit_code == 2 and "--reward-kwargs" in error_line(r), r.output
