"""Pull the final answer out of a completion, and normalise answers for exact matching.

Every task asks for its answer in a parseable form (`\\boxed{...}` for math, a final line
`Answer: ...` for the long-context tasks), but models drift, so extraction accepts any of them, in
this order: the last `\\boxed{}` (braces balanced), the last `answer: X` / `answer is X`, and
finally the last number in the text. A reasoning block closed by `</think>` is ignored.
"""

from __future__ import annotations

import re

_ANSWER_LINE = re.compile(r"answer\s*(?:is\s*:?|:)\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_NUMBER_WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty".split()
)}


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces included."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


def _clean(value: str) -> str:
    """Drop surrounding markdown/LaTeX delimiters and a trailing full stop."""
    return value.strip().lstrip("*_`\"'$ ").rstrip("*_`\"'$ .")


def extract_answer(completion: str) -> str | None:
    """The final answer a completion gives, or None if it gives nothing recognisable."""
    text = completion.rsplit("</think>", 1)[-1]
    boxed = last_boxed(text)
    if boxed is not None:
        return _clean(boxed)
    lines = _ANSWER_LINE.findall(text)
    if lines and _clean(lines[-1]):
        return _clean(lines[-1])
    numbers = _NUMBER.findall(text)
    return numbers[-1].rstrip(".") if numbers else None


def normalize(value: str) -> str:
    """Case, surrounding punctuation/markup, inner whitespace and digit-group commas do not matter."""
    value = _clean(value).lower()
    value = re.sub(r"\\text\{([^}]*)\}", r"\1", value)
    value = re.sub(r"(?<=\d),(?=\d{3}\b)", "", value)
    value = re.sub(r"\s+", " ", value).strip(" .,;:!?")
    return value


def parse_int(value: str | None) -> int | None:
    """An integer written as digits (commas allowed, `7.0` accepted) or as a word up to twenty."""
    if value is None:
        return None
    v = normalize(value)
    if v in _NUMBER_WORDS:
        return _NUMBER_WORDS[v]
    match = re.fullmatch(r"-?\d+(?:\.0+)?", v)
    return int(float(v)) if match else None
