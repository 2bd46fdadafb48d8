"""The `passkey` task (stages/tasks/learnable.py): generation and the per-digit reward rule.

Fast: prompts are built with the embedded tokenizer only (no model weights), scores are hand-checked.
"""

from __future__ import annotations

import json
import re

import pytest

from sparrow.stages.tasks import TASKS, TaskError, make_prompts, score
from sparrow.stages.tasks.learnable import NEEDLE, generate, given_code
from sparrow.stages.tasks.learnable import score as passkey_score


@pytest.fixture(scope="module")
def tok():
    from sparrow.stages.model.loading import load_tokenizer

    return load_tokenizer("embedded")


def _meta(row: dict) -> dict:
    return json.loads(row["metadata"])


def test_registered_as_a_long_context_task_with_its_options():
    task = TASKS["passkey"]
    assert task.long_context
    assert set(task.options) == {"context_tokens", "distractors", "digits", "depth"}


def test_generation_is_deterministic_per_seed(tok):
    rows = make_prompts("passkey", 3, 0, tok, context_tokens=400)
    assert rows == make_prompts("passkey", 3, 0, tok, context_tokens=400)
    other = make_prompts("passkey", 3, 1, tok, context_tokens=400)
    assert [r["prompt"] for r in rows] != [r["prompt"] for r in other]
    assert len({r["answer"] for r in rows}) == 3  # examples within a seed differ too


@pytest.mark.parametrize("target", [200, 256, 1000, 2000])
def test_prompts_fit_the_requested_length(tok, target):
    """At most the tokens asked for, short by less than a filler sentence (at most about 20 tokens)."""
    for row in make_prompts("passkey", 3, 0, tok, context_tokens=target):
        assert 0 <= target - len(row["prompt_token_ids"]) <= 20


def test_needle_distractors_and_question(tok):
    for row in make_prompts("passkey", 4, 2, tok, context_tokens=800, distractors=3, digits=5):
        meta, prompt, code = _meta(row), row["prompt"], row["answer"]
        assert len(code) == 5 and code.isdigit()
        assert prompt.count(NEEDLE.format(key=meta["key"], code=code)) == 1
        assert f"what is the code for the {meta['key']}?" in prompt
        assert len(meta["distractor_codes"]) == 3 and code not in meta["distractor_codes"]
        assert all(prompt.count(f" is {c}.") == 1 for c in meta["distractor_codes"])
        document = prompt.split("\n\n")[1]  # the filler is number-free: only the codes are numbers
        assert sorted(re.findall(r"\d+", document)) == sorted([code, *meta["distractor_codes"]])
        assert 0.0 <= meta["depth"] <= 0.5


def test_short_and_long_variants_share_the_question(tok):
    short = make_prompts("passkey", 2, 5, tok, context_tokens=256)
    long = make_prompts("passkey", 2, 5, tok, context_tokens=2000)
    for s, lo in zip(short, long):
        assert s["answer"] == lo["answer"] and _meta(s)["key"] == _meta(lo)["key"]
        assert _meta(lo)["records"] > 5 * _meta(s)["records"]


@pytest.mark.parametrize("depth", [0.0, 1.0])
def test_depth_places_the_needle(tok, depth):
    row = make_prompts("passkey", 1, 0, tok, context_tokens=1000, distractors=0, depth=depth)[0]
    document = row["prompt"].split("\n\n")[1]
    where = document.index(NEEDLE.format(key=_meta(row)["key"], code=row["answer"])) / len(document)
    assert (where < 0.02) if depth == 0.0 else (where > 0.95)


def test_bad_options_raise_clear_errors(tok):
    with pytest.raises(TaskError, match="too short"):
        make_prompts("passkey", 1, 0, tok, context_tokens=64)
    with pytest.raises(TaskError, match="too short"):
        make_prompts("passkey", 1, 0, tok, context_tokens=200, distractors=12)
    with pytest.raises(TaskError, match="--digits"):
        list(generate(1, 0, len, context_tokens=500, digits=0))
    with pytest.raises(TaskError, match="--depth"):
        list(generate(1, 0, len, context_tokens=500, depth=1.5))
    with pytest.raises(TaskError, match="--distractors"):
        list(generate(1, 0, len, context_tokens=500, distractors=-1))


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("5242", 1.0),
        ("The code for the blue door is 5242.", 1.0),
        ("<think>maybe 1111</think>The code is 5242", 1.0),
        ("5243", 0.75),  # one wrong digit of four
        ("The code is 5942.", 0.75),
        ("1242", 0.75),
        ("9999", 0.0),
        ("52421", 0.8),  # padding costs: 4 hits / 5 digits
        ("524", 0.75),  # truncation costs: 3 hits / 4 digits
        ("2425", 0.0),  # right digits, wrong places
        ("The code is 5242, no wait, 5243.", 1.0),  # the first number is the answer given
        ("The code is 7777, no wait, 5242.", 0.0),
        ("I don't know.", 0.0),
        ("", 0.0),
        ("The code is five two four two.", 0.0),
    ],
)
def test_reward_rule(completion, expected):
    assert passkey_score(completion, "5242", {}) == pytest.approx(expected)
    assert score("passkey", completion, "5242", "{}") == pytest.approx(expected)


def test_reward_is_in_unit_interval_and_deterministic():
    for completion in ("", "0", "5242" * 10, "12 34", "x" * 100, "99999999999999999"):
        r = passkey_score(completion, "5242", {})
        assert 0.0 <= r <= 1.0 and r == passkey_score(completion, "5242", {})
    assert given_code("door 12 34") == "12"
    assert passkey_score("5242", "", {}) == 0.0
