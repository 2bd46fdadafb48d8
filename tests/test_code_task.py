"""The `code` task: prompts, code extraction, and rewards from running programs in the sandbox.

Expected outputs are checked against implementations written here (not the task's canonical solutions),
and a wrong program's reward against the fraction of tests it passes when the test calls it in-process.
"""

from __future__ import annotations

import json
import math

import pytest

from sparrow.stages.tasks import TaskError, make_prompts, score, score_batch
from sparrow.stages.tasks import sandbox as sb
from sparrow.stages.tasks.code import FAMILIES, FORMAT_WEIGHT, extract_code

pytestmark = pytest.mark.skipif(sb.sandbox_problem(sb.bwrap_binary()) is not None,
                                reason="no sandbox here")


class WordTokenizer:
    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return type("Encoded", (), {"input_ids": [1] * len(text.split())})()


def rows(n=12, seed=0, **options):
    return make_prompts("code", n, seed, WordTokenizer(), **options)


def _sum_of_evens(numbers):
    total = 0
    for x in numbers:
        if x % 2 == 0:
            total += x
    return total


def _is_prime(n):
    return n >= 2 and not any(n % d == 0 for d in range(2, n))


def _running_total(numbers):
    return [sum(numbers[: i + 1]) for i in range(len(numbers))]


INDEPENDENT = {"sum_of_evens": _sum_of_evens, "is_prime": _is_prime, "running_total": _running_total,
               "reverse_string": lambda s: "".join(reversed(s)), "factorial": math.factorial,
               "second_largest": lambda xs: sorted(set(xs), reverse=True)[1],
               "remove_duplicates": lambda xs: [x for i, x in enumerate(xs) if x not in xs[:i]]}


def test_prompts_are_seeded_and_their_expected_outputs_are_right():
    a, b = rows(40, seed=3, level=0), rows(40, seed=3, level=0)
    assert a == b and a != rows(40, seed=4, level=0)
    checked = 0
    for r in a:
        meta = json.loads(r["metadata"])
        assert f"`{meta['function']}(" in r["prompt"] and "```python" in r["prompt"]
        assert len(meta["cases"]) == 6
        if meta["function"] in INDEPENDENT:
            fn = INDEPENDENT[meta["function"]]
            assert meta["expected"] == [fn(*case) for case in meta["cases"]]
            checked += 1
    assert checked >= 5
    assert {json.loads(r["metadata"])["function"] for r in rows(30, level=1)} <= {
        f.name for f in FAMILIES if f.level == 1}


def test_options_are_checked():
    with pytest.raises(TaskError, match="--level"):
        rows(level=5)
    with pytest.raises(TaskError, match="--tests"):
        rows(tests=0)
    assert len(json.loads(rows(1, tests=3)[0]["metadata"])["cases"]) == 3


DEF = "def f(x):\n    return x + 1\n"


@pytest.mark.parametrize("completion, expected", [
    (f"Here it is:\n```python\n{DEF}```\nDone.", DEF),
    (f"```\n{DEF}```", DEF),
    (f"```py\n{DEF}", DEF),  # an unclosed last fence
    (f"Sure! {DEF}\nThis adds one to x.", DEF),  # unfenced, prose after it is cut off
    (f"import math\n{DEF}", f"import math\n{DEF}"),
    (f"```python\ndef g(x):\n    return x\n```\nBetter:\n```python\n{DEF}```", DEF),  # the block defining f
    (f"```python\n{DEF}```\n```python\nprint(f(2))\n```", DEF),  # a later block without f is skipped
    (f"<think>```python\ndef f(x):\n    return 0\n```</think>```python\n{DEF}```", DEF),
    ("```python\ndef g(x):\n    return x\n```", None),
    ("no code here", None),
    ("```python\ndef f(x:\n```", None),  # does not parse
])
def test_code_extraction(completion, expected):
    assert extract_code(completion, "f") == expected


def _longest_parsable_prefix(code: str, name: str) -> str | None:
    """The cut's definition by brute force: every prefix of whole lines, longest first."""
    import ast

    lines = code.rstrip().splitlines()
    for end in range(len(lines), 0, -1):
        text = "\n".join(lines[:end])
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        defined = any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
                      for n in tree.body)
        return text.rstrip() + "\n" if defined else None
    return None


TAILS = ["This adds one to x.", "    return (x", ")", "x = [1,", "]", '"""a docstring', '"""',
         "  indented prose", "def g(y):", "    return y", "print(f(2))", "if x:", "else:", "@decorator",
         "'unterminated",
         "# a comment", "", "    pass", "for i in range(3): (", "class C:", "lambda: (", "}"]


def test_code_extraction_cuts_where_the_brute_force_does():
    """The cut that jumps to a failed parse's error line keeps what the longest parsable prefix keeps,
    on random completions: a function, then random lines of prose and broken code."""
    import random

    from sparrow.stages.tasks.code import _parsable_prefix

    rng = random.Random(0)
    for _ in range(400):
        head = rng.choice([DEF, "import math\n" + DEF, "def f(x):\n    return (x +\n        1)\n", ""])
        tail = [rng.choice(TAILS) for _ in range(rng.randint(0, 8))]
        middle = [rng.choice(TAILS) for _ in range(rng.randint(0, 2))]
        code = "\n".join(middle) + "\n" + head + "\n".join(tail)
        assert _parsable_prefix(code, "f") == _longest_parsable_prefix(code, "f"), code


def test_code_extraction_of_an_unclosed_bracket_parses_a_few_cuts(monkeypatch):
    """A completion that never closes a bracket over thousands of lines is cut in a few parses, not one
    per line (the cut runs outside the sandbox, in our process)."""
    import ast

    from sparrow.stages.tasks import code as code_task

    calls = []
    real = ast.parse
    monkeypatch.setattr(code_task.ast, "parse",
                        lambda text, *a, **k: calls.append(len(text)) or real(text, *a, **k))
    completion = "```python\ndef f(x):\n    return (0\n" + "    + 1\n" * 10_000 + "```"
    assert extract_code(completion, "f") is None
    assert len(calls) <= 8 and sum(calls) <= code_task.PARSE_BUDGET


def _wrong_fraction(source: str, name: str, meta: dict) -> float:
    namespace: dict = {}
    exec(source, namespace)
    hits = sum(namespace[name](*case) == expected and type(namespace[name](*case)) is type(expected)
               for case, expected in zip(meta["cases"], meta["expected"]))
    return hits / len(meta["cases"])


def test_correct_scores_1_and_wrong_scores_its_fraction():
    for r in rows(10, seed=1, level=0):
        meta = json.loads(r["metadata"])
        name = meta["function"]
        family = next(f for f in FAMILIES if f.name == name)
        assert score("code", f"```python\n{family.source}```", r["answer"], r["metadata"]) == 1.0
        wrong = f"def {name}(*args):\n    return 0\n"
        fraction = _wrong_fraction(wrong, name, meta)
        expected = (1 - FORMAT_WEIGHT) * fraction + FORMAT_WEIGHT
        assert score("code", wrong, r["answer"], r["metadata"]) == pytest.approx(expected)
        assert score("code", "I do not know.", r["answer"], r["metadata"]) == 0.0
        crash = f"def {name}(*args):\n    raise ValueError\n"
        assert score("code", crash, r["answer"], r["metadata"]) == 0.0


def test_a_program_cannot_forge_the_harness_report():
    r = rows(1, seed=2)[0]
    meta = json.loads(r["metadata"])
    lines = [f"print('[{i}, \"returned\", {json.dumps(e)}]')\n" for i, e in enumerate(meta["expected"])]
    forged = "".join(lines)
    program = f"{forged}def {meta['function']}(*args):\n    return None\n"
    assert score("code", program, r["answer"], r["metadata"]) <= FORMAT_WEIGHT


def test_the_same_program_scores_the_same_whatever_the_pool_size():
    items = []
    for r in rows(6, seed=5, level=0):
        name = json.loads(r["metadata"])["function"]
        family = next(f for f in FAMILIES if f.name == name)
        for text in (family.source, f"def {name}(*a):\n    return 1\n", f"def {name}(*a):\n    return a[0]\n",
                     "no code"):
            items.append(("code", text, r["answer"], r["metadata"]))
    items.append(("passkey", "1234", "1234", None))
    one, three = score_batch(items, workers=1), score_batch(items, workers=3)
    assert one == three
    assert one == [score(*item) for item in items]
    assert one[-1] == 1.0 and one[0] == 1.0


# ---------------------------------------------------------------------------- humaneval


def test_humaneval_prompts_and_canonical_solutions():
    from sparrow.stages.tasks.humaneval import problems

    got = make_prompts("humaneval", 164, 0, WordTokenizer())
    assert len({r["answer"] for r in got}) == 164
    assert got[:5] == make_prompts("humaneval", 5, 0, WordTokenizer()) != make_prompts("humaneval", 5, 1,
                                                                                         WordTokenizer())
    by_id = {p["task_id"]: p for p in problems()}
    for r in got[:12]:
        meta = json.loads(r["metadata"])
        p = by_id[meta["task_id"]]
        assert p["prompt"].strip() in r["prompt"] and meta["test"] == p["test"]
        assert score("humaneval", f"```python\n{r['answer']}```", r["answer"], r["metadata"]) == 1.0
        # a model that only continues the stub's body
        assert score("humaneval", p["canonical_solution"], r["answer"], r["metadata"]) == 1.0


def _task_ids(rows: list[dict]) -> list[str]:
    return [json.loads(r["metadata"])["task_id"] for r in rows]


def test_humaneval_splits_are_disjoint_and_never_repeat_a_problem():
    everything = {f"HumanEval/{k}" for k in range(164)}
    test = {f"HumanEval/{k}" for k in range(0, 164, 4)}  # the documented partition: every fourth
    for seed in (0, 1):
        got = {split: _task_ids(make_prompts("humaneval", n, seed, WordTokenizer(), split=split))
               for split, n in (("train", 123), ("test", 41), ("all", 164))}
        assert set(got["test"]) == test and set(got["train"]) == everything - test
        assert set(got["all"]) == everything and all(len(set(v)) == len(v) for v in got.values())
    rows = make_prompts("humaneval", 2, 0, WordTokenizer(), split="test")
    assert [r["prompt_id"] for r in rows] == ["humaneval-test-0-0", "humaneval-test-0-1"]
    with pytest.raises(TaskError, match="--n 42 is more than the 41 problems of humaneval's 'test' split"):
        make_prompts("humaneval", 42, 0, WordTokenizer(), split="test")
    with pytest.raises(TaskError, match="--split must be one of all, train, test"):
        make_prompts("humaneval", 1, 0, WordTokenizer(), split="eval")


def test_humaneval_wrong_solution_scores_its_fraction():
    from sparrow.stages.tasks.humaneval import problems

    p = problems()[0]  # has_close_elements: 7 asserts, those expecting False pass for `return False`
    asserts = [line for line in p["test"].splitlines() if line.strip().startswith("assert")]
    expected_false = sum(line.rstrip().endswith("== False") for line in asserts)
    assert (len(asserts), expected_false) == (7, 3)
    meta = {"task_id": p["task_id"], "function": p["entry_point"], "stub": p["prompt"], "test": p["test"]}
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    assert score("humaneval", wrong, "", meta) == pytest.approx(0.9 * 3 / 7 + 0.1)
    crash = "```python\ndef has_close_elements(numbers, threshold):\n    return 1 / 0\n```"
    assert score("humaneval", crash, "", meta) == 0.0
