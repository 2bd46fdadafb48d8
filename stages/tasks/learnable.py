"""`passkey`: a retrieval task the embedded 135M model can learn from with GRPO.

SmolLM2-135M-Instruct scores about 0 on the math tasks and on `kv_lookup` (hundreds of look-alike
records, six-digit values, exact match), so GRPO gets no signal there. `passkey` is the classic
passkey retrieval test made easier on the three axes that matter for a small model, while keeping
its answer far back in a long prompt so that sparse attention has to find it:

- Few distractors: the document is number-free prose (a caretaker's notebook) with one *needle*,
  "The code for the blue door is 5242.", and `distractors` (default 1) look-alike sentences for other
  keys ("the grey safe"). The question names the needle's key.
- Short answers: `digits` (default 4) digit codes, all distinct within a prompt.
- Dense reward: partial credit per digit (below), so a near miss is better than nothing.

The defaults (1 distractor, 4 digits, 1,500 tokens) were tuned on SmolLM2-135M-Instruct so that its
sampled reward starts well inside [0.1, 0.6]: difficulty rises with both the distractor count and the
length (at temperature 1, 2 distractors: about 0.33 at 1,000 tokens and 0.13 at 2,000; 0 distractors
at 1,000 tokens: 0.65). bench/task_baseline.py measures it.

Length: the document is grown one filler sentence at a time from one seeded stream, as many as fit in the
chat-formatted prompt length (`context_tokens`, at most that many tokens; default 1,500, down to about 160
with the embedded chat template), so the same task has a short variant where attention is trivially
dense and a long one where the needle is pages away. The needle sits at relative depth `depth` of the document
(default: drawn from [0, 0.5], so it is at least half a document back); distractors are placed
uniformly. Placement is by fraction of the record count, so a document with N records is the same
whatever path the length fit took, prompts are deterministic per seed, and one seed gives the same
keys and codes at every length (short and long variants differ only by filler).

Reward rule (`score`), deterministic and in [0, 1]: take the completion after any `</think>`; the
given code is its *first* maximal run of ASCII digits (the model's first commitment; a later
correction does not count). No digits: 0. Otherwise
    reward = #{i < min(len(g), len(a)) : g[i] == a[i]} / max(len(g), len(a))
for given g and answer a: 1 for the exact code, 0.75 for one wrong digit of four, and padding or
truncating the code costs credit (12345 for 1234 earns 4/5). Accuracy is reward == 1. A random
four-digit number earns 0.1 in expectation; a distractor's code about the same.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Any

from .base import Example, Measure, Task, TaskError
from .longcontext import _Stream, fit_records

DEFAULT_CONTEXT_TOKENS = 1500
MIN_CONTEXT_TOKENS = 160
DEFAULT_DISTRACTORS = 1
DEFAULT_DIGITS = 4
MAX_DEPTH = 0.5  # default needle depth is uniform in [0, MAX_DEPTH] of the document
SENTENCES_PER_PARAGRAPH = 6

COLORS = (
    "red",
    "blue",
    "green",
    "yellow",
    "white",
    "black",
    "orange",
    "purple",
    "brown",
    "grey",
    "pink",
    "silver",
)
THINGS = ("door", "gate", "safe", "locker", "cabinet", "shed")
SUBJECTS = (
    "The gardener",
    "A young teacher",
    "The old fisherman",
    "Our neighbour",
    "The baker",
    "A traveller",
    "The librarian",
    "The farmer's daughter",
    "The postman",
    "My grandmother",
    "A tired student",
    "The carpenter",
)
VERBS = (
    "walked slowly along",
    "painted a picture of",
    "talked for hours about",
    "remembered",
    "swept",
    "wrote a letter about",
    "dreamed about",
    "visited",
    "complained about",
    "photographed",
    "sang a song about",
    "sat quietly by",
)
PLACES = (
    "the quiet harbour",
    "the little garden behind the house",
    "the old stone bridge",
    "the market square",
    "the windy hill",
    "the river bank",
    "the school yard",
    "the forest path",
    "the empty station",
    "the village church",
    "the apple orchard",
    "the narrow lane",
)
ENDINGS = (
    "in the morning.",
    "before the rain came.",
    "with a smile.",
    "while the birds were singing.",
    "after lunch.",
    "on a cold day.",
    "without saying a word.",
    "as the sun went down.",
    "for the first time in years.",
    "once again.",
    "under a grey sky.",
    "with an old friend.",
)

INTRO = (
    "Below is a page from the notebook of the caretaker of an old estate. Among everyday notes it "
    "records the codes of a few doors and safes. Read it carefully: a question about it follows."
)
QUESTION = "Question: what is the code for the {key}? Reply with the code only."
NEEDLE = "The code for the {key} is {code}."
_DIGITS = re.compile(r"[0-9]+")


def _filler(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(PLACES)} {rng.choice(ENDINGS)}"


def _keys_and_codes(rng: random.Random, count: int, digits: int) -> tuple[list[str], list[str]]:
    keys = [f"{c} {t}" for c, t in rng.sample([(c, t) for c in COLORS for t in THINGS], count)]
    codes: list[str] = []
    while len(codes) < count:
        code = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
        if code not in codes:
            codes.append(code)
    return keys, codes


def _render(fillers: list[str], inserts: list[tuple[float, str]], key: str) -> str:
    """The user message: intro, the document with `inserts` (fraction, sentence), the question."""
    records = len(fillers)
    at: dict[int, list[str]] = {}
    for frac, sentence in inserts:
        at.setdefault(min(int(frac * records), records), []).append(sentence)
    sentences: list[str] = []
    for i in range(records + 1):
        sentences.extend(at.get(i, []))
        if i < records:
            sentences.append(fillers[i])
    paragraphs = [
        " ".join(sentences[i : i + SENTENCES_PER_PARAGRAPH])
        for i in range(0, len(sentences), SENTENCES_PER_PARAGRAPH)
    ]
    return f"{INTRO}\n\n" + "\n".join(paragraphs) + "\n\n" + QUESTION.format(key=key)


def _check_options(context_tokens: int, distractors: int, digits: int, depth: float | None) -> None:
    if not 0 <= distractors < len(COLORS) * len(THINGS):
        raise TaskError(f"--distractors must be in [0, {len(COLORS) * len(THINGS) - 1}], got {distractors}")
    if not 1 <= digits <= 9:
        raise TaskError(f"--digits must be in [1, 9], got {digits}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise TaskError(f"--depth must be in [0, 1], got {depth}")
    if context_tokens < MIN_CONTEXT_TOKENS:
        raise TaskError(
            f"--context-tokens {context_tokens} is too short for passkey (at least {MIN_CONTEXT_TOKENS})"
        )


def _example(
    rng: random.Random,
    measure: Measure,
    context_tokens: int,
    distractors: int,
    digits: int,
    depth: float | None,
) -> Example:
    keys, codes = _keys_and_codes(rng, distractors + 1, digits)
    needle_depth = rng.uniform(0.0, MAX_DEPTH) if depth is None else depth
    inserts = [(needle_depth, NEEDLE.format(key=keys[0], code=codes[0]))]
    inserts += [(rng.random(), NEEDLE.format(key=k, code=c)) for k, c in zip(keys[1:], codes[1:])]
    fillers = _Stream(random.Random(rng.random()), _filler)
    render = lambda records: _render(fillers.take(records), inserts, keys[0])
    smallest = measure(render(0))
    if smallest > 0.9 * context_tokens:
        raise TaskError(
            f"--context-tokens {context_tokens} is too short for passkey with "
            f"{distractors} distractors (at least {int(smallest / 0.9) + 1})"
        )
    text, records = fit_records(render, measure, context_tokens, minimum=0)
    metadata = {
        "key": keys[0],
        "depth": round(needle_depth, 4),
        "records": records,
        "context_tokens": context_tokens,
        "distractor_codes": codes[1:],
    }
    return Example(text, codes[0], metadata)


def generate(
    n: int,
    seed: int,
    measure: Measure,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    distractors: int = DEFAULT_DISTRACTORS,
    digits: int = DEFAULT_DIGITS,
    depth: float | None = None,
) -> Iterator[Example]:
    _check_options(context_tokens, distractors, digits, depth)
    for i in range(n):
        yield _example(
            random.Random(f"passkey/{seed}/{i}"), measure, context_tokens, distractors, digits, depth
        )


def given_code(completion: str) -> str | None:
    """The code a completion gives: its first run of digits after any reasoning block."""
    match = _DIGITS.search(completion.rsplit("</think>", 1)[-1])
    return match.group(0) if match else None


def score(completion: str, answer: str, metadata: dict[str, Any] | None = None) -> float:
    """Per-digit positional credit, normalised by the longer of the two codes (module docstring)."""
    given = given_code(completion)
    if not given or not answer:
        return 0.0
    hits = sum(g == a for g, a in zip(given, answer))
    return hits / max(len(given), len(answer))


def tasks() -> list[Task]:
    return [
        Task(
            "passkey",
            "long-context",
            "recall a short code stated once in a long number-free "
            "document with a few look-alike distractors (partial credit per digit)",
            generate,
            score,
            ("context_tokens", "distractors", "digits", "depth"),
            given=given_code,
        )
    ]
