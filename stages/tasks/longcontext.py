"""Long-context tasks whose answer depends on tokens far back in the prompt.

Both are generated here from a seed (no downloads) as natural-looking documents:

- `kv_lookup`: an inventory of lockers and their access codes; the question asks for the code of
  one locker listed near the start (depth 0-10% of the list by default).
- `count`: a wildlife observation log; the question asks how many entries report one animal,
  with its first sighting near the start and the rest spread through the log.

Length is fitted to the *chat-formatted* prompt, counted as `prompt_token_ids` holds it: the document is
rendered with N records, measured with the model's tokenizer, and N is the most records whose prompt is at
most `context_tokens` tokens (the secant method, then a bisection: a few tokenisations), so a prompt is
never longer than asked and short of it by less than one record.
Records are drawn from one random stream in order, so a document with N records is the same
whatever path the fit took, and prompts are deterministic for a seed. Scoring is exact match after
normalisation (case, markup, punctuation; integers also accept number words).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

from .answers import extract_answer, normalize, parse_int
from .base import Example, Measure, Task, TaskError

DEFAULT_CONTEXT_TOKENS = 3000
MIN_CONTEXT_TOKENS = 512
TOLERANCE = 0.01  # the secant stops within 1% of the requested length; a bisection then fits it from below
ANSWER_FORMAT = 'End your reply with a final line of the form "Answer: {what}".'

ADJECTIVES = ("amber", "silver", "crimson", "quiet", "northern", "hollow", "golden", "rusty", "misty",
              "bright", "copper", "velvet", "frozen", "hidden", "little", "ancient", "western", "lucky",
              "olive", "stormy", "coral", "dusty", "ivory", "scarlet")
NOUNS = ("falcon", "harbor", "maple", "lantern", "river", "meadow", "anchor", "willow", "summit",
         "canyon", "garden", "beacon", "orchard", "pebble", "thistle", "compass", "glacier", "violet",
         "cedar", "quarry", "island", "marble", "sparrow", "tunnel")
KV_LINES = ("Locker {key} opens with code {value}.", "The access code for locker {key} is {value}.",
            "Locker {key}: access code {value}.", "Locker {key} is assigned the code {value}.")
ANIMALS = ("heron", "fox", "badger", "otter", "deer", "hare", "owl", "beaver", "weasel", "kingfisher",
           "woodpecker", "squirrel", "hedgehog", "stoat", "swan", "egret", "lynx", "marten", "vole",
           "shrew", "pheasant", "magpie", "raven", "kestrel", "toad", "newt", "salamander", "mole")
PLACES = ("near the river", "by the old oak", "at the pond", "in the meadow", "along the fence",
          "on the hill", "behind the barn", "at the edge of the wood", "by the stone bridge",
          "in the reeds", "near the footpath", "under the hedge")


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


class _Stream:
    """Records drawn in order from one random stream: `take(n)` is a prefix of every later `take`."""

    def __init__(self, rng: random.Random, draw: Callable[[random.Random], str]):
        self.rng, self.draw, self.items = rng, draw, []

    def take(self, n: int) -> list[str]:
        while len(self.items) < n:
            self.items.append(self.draw(self.rng))
        return self.items[:n]


def fit_records(render: Callable[[int], str], measure: Measure, target: int, minimum: int) -> tuple[str, int]:
    """The rendering with the most records whose measured length is at most `target` (the rendering with
    `minimum` records when even it is longer: the tasks refuse such a target first), and its record count.

    The secant method gets near `target` in a few measurements; a bisection between the largest count
    seen that fits and the smallest that does not then finds the last count that fits."""
    seen: dict[int, int] = {}

    def length(n: int) -> int:
        if n not in seen:
            seen[n] = measure(render(n))
        return seen[n]

    a, b = minimum, minimum + 32
    for _ in range(12):
        la, lb = length(a), length(b)
        if abs(lb - target) <= TOLERANCE * target or la == lb:
            break
        nxt = max(minimum, round(b + (target - lb) * (b - a) / (lb - la)))
        if nxt in seen:
            break
        a, b = b, nxt
    fits = max((n for n, tokens in seen.items() if tokens <= target), default=minimum)
    over = min((n for n, tokens in seen.items() if tokens > target and n > fits), default=None)
    step = max(1, fits - minimum)
    while over is None:  # every count seen fits: grow until one does not
        if length(fits + step) <= target:
            fits, step = fits + step, step * 2
        else:
            over = fits + step
    while over - fits > 1:
        mid = (fits + over) // 2
        fits, over = (mid, over) if length(mid) <= target else (fits, mid)
    return render(fits), fits


def _check_length(context_tokens: int, smallest: int) -> None:
    """`smallest` is the length of the prompt with the fewest records the task allows."""
    if context_tokens < MIN_CONTEXT_TOKENS or smallest > 0.9 * context_tokens:
        need = max(MIN_CONTEXT_TOKENS, int(smallest / 0.9) + 1)
        raise TaskError(f"--context-tokens {context_tokens} is too short for a long-context task "
                        f"(at least {need})")


def _kv_generate(n: int, seed: int, measure: Measure, context_tokens: int = DEFAULT_CONTEXT_TOKENS,
                 depth: float | None = None) -> Iterator[Example]:
    for i in range(n):
        yield _kv_example(random.Random(f"kv_lookup/{seed}/{i}"), measure, context_tokens, depth)


def _kv_example(rng: random.Random, measure: Measure, context_tokens: int, depth: float | None) -> Example:
    used: set[str] = set()

    def draw_key(r: random.Random) -> str:
        while True:
            key = f"{r.choice(ADJECTIVES)}-{r.choice(NOUNS)}-{r.randint(100, 999)}"
            if key not in used:
                used.add(key)
                return key

    key, value = draw_key(rng), str(rng.randint(100000, 999999))
    target_line = rng.choice(KV_LINES).format(key=key, value=value)
    frac = rng.uniform(0.0, 0.1) if depth is None else depth
    fillers = _Stream(random.Random(rng.random()),
                      lambda r: r.choice(KV_LINES).format(key=draw_key(r), value=r.randint(100000, 999999)))
    position = lambda records: min(records - 1, int(frac * records))

    def render(records: int) -> str:
        lines = fillers.take(records - 1)
        pos = position(records)
        return (
            "Below is the inventory of the storage lockers in our building, with the access code "
            "assigned to each locker. Read it carefully: a question about it follows.\n\n"
            + "\n".join([*lines[:pos], target_line, *lines[pos:]])
            + f"\n\nQuestion: what is the access code for locker {key}? "
            + ANSWER_FORMAT.format(what="<code>")
        )

    _check_length(context_tokens, measure(render(1)))
    text, records = fit_records(render, measure, context_tokens, minimum=1)
    pos = position(records)
    return Example(text, value, {"key": key, "position": pos, "records": records,
                                 "depth": round(pos / records, 4), "context_tokens": context_tokens})


def _kv_score(completion: str, answer: str, metadata: dict[str, Any]) -> float:
    given = extract_answer(completion)
    return float(given is not None and normalize(given) == normalize(answer))


def _count_generate(n: int, seed: int, measure: Measure, context_tokens: int = DEFAULT_CONTEXT_TOKENS,
                    depth: float | None = None) -> Iterator[Example]:
    for i in range(n):
        yield _count_example(random.Random(f"count/{seed}/{i}"), measure, context_tokens, depth)


def _count_example(rng: random.Random, measure: Measure, context_tokens: int, depth: float | None) -> Example:
    animal = rng.choice(ANIMALS)
    others = [a for a in ANIMALS if a != animal]
    occurrences = rng.randint(2, 9)
    first = rng.uniform(0.0, 0.1) if depth is None else depth
    fracs = sorted([first, *(rng.uniform(first, 1.0) for _ in range(occurrences - 1))])
    places = [rng.choice(PLACES) for _ in range(occurrences)]
    fillers = _Stream(random.Random(rng.random()), lambda r: f"{r.choice(others)}|{r.choice(PLACES)}")

    def render(records: int) -> str:
        slots: list[int] = []
        for f in fracs:
            s = min(int(f * records), records - 1)
            while s in slots:
                s = (s + 1) % records
            slots.append(s)
        found = dict(zip(slots, places, strict=True))
        stream = iter(fillers.take(records - occurrences))
        lines = []
        for k in range(records):
            who, where = (animal, found[k]) if k in found else next(stream).split("|")
            lines.append(f"Entry {k + 1}: {article(who)} {who} was seen {where}.")
        return (
            "Here is the wildlife observation log kept by the rangers of the nature reserve this "
            "season, one sighting per entry. Read it carefully: a question about it follows.\n\n"
            + "\n".join(lines)
            + f"\n\nQuestion: how many entries in the log report {article(animal)} {animal}? "
            + ANSWER_FORMAT.format(what="<number>")
        )

    _check_length(context_tokens, measure(render(occurrences)))
    text, records = fit_records(render, measure, context_tokens, minimum=occurrences)
    metadata = {"animal": animal, "records": records, "first_depth": round(fracs[0], 4),
                "context_tokens": context_tokens}
    return Example(text, str(occurrences), metadata)


def _count_given(completion: str) -> int | None:
    return parse_int(extract_answer(completion))


def _count_score(completion: str, answer: str, metadata: dict[str, Any]) -> float:
    given = _count_given(completion)
    return float(given is not None and given == parse_int(answer))


def tasks() -> list[Task]:
    options = ("context_tokens", "depth")
    return [
        Task("kv_lookup", "long-context", "find the value of a key listed near the start of a long "
             "key-value inventory", _kv_generate, _kv_score, options, given=extract_answer),
        Task("count", "long-context", "count how often one item occurs in a long log",
             _count_generate, _count_score, options, given=_count_given),
    ]
