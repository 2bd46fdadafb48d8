"""What a sampling stage does with a prompt too long for it: verl's `data.max_prompt_length`,
`data.truncation` and `data.filter_overlong_prompts`, TRL's `max_prompt_length`.

Decisions:
- A prompt's length is its token ids after the chat template, as verl and TRL count it.
- Without `--max-prompt-length` a prompt is too long when it and `--max-new-tokens` exceed the model's
  context; that is refused (one sentence naming the prompt), or with `filter_overlong` the prompt is left
  out. With it, a longer prompt is refused (`truncation` error, verl's default), cut to its length (left:
  its last tokens, as TRL cuts; right: its first; middle: its first half and last half, verl's three
  ways), or left out under `filter_overlong`, which verl applies first, so nothing is then cut.
- A prompt left out or cut keeps its id and its row in the file, and its samples their seeds (seed, row,
  sample): the others' samples are those of a run that kept every prompt whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Truncation(StrEnum):
    """What becomes of a prompt longer than --max-prompt-length (verl's data.truncation)."""

    ERROR = "error"  # refused
    LEFT = "left"  # its last tokens kept
    RIGHT = "right"  # its first
    MIDDLE = "middle"  # its first and last halves

    @classmethod
    def of(cls, value: str) -> Truncation:
        """The truncation a flag's value names (any case), ValueError naming the choices otherwise."""
        try:
            return cls(value.strip().lower())
        except ValueError:
            raise ValueError(f"--truncation must be one of {', '.join(cls)}, got {value!r}") from None


@dataclass(frozen=True)
class PromptLength:
    max_length: int | None = None  # prompt tokens at most (None: what the context leaves)
    truncation: Truncation = Truncation.ERROR
    filter_overlong: bool = False  # a prompt too long is left out, not refused or cut

    def validate(self) -> None:
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"--max-prompt-length must be at least 1, got {self.max_length}")
        if self.truncation != Truncation.ERROR and self.max_length is None:
            raise ValueError(f"--truncation {self.truncation} cuts prompts to --max-prompt-length; give it "
                             "too")

    def limit(self, context: int, max_new_tokens: int) -> int:
        """The most prompt tokens a row may have: --max-prompt-length, else what the context leaves."""
        room = context - max_new_tokens
        return room if self.max_length is None else self.max_length

    def cut(self, ids: list[int]) -> list[int]:
        """`ids` cut to `max_length` by `truncation` (left, right or middle)."""
        n = self.max_length
        if n is None or len(ids) <= n or self.truncation == Truncation.ERROR:
            return ids
        if self.truncation == Truncation.LEFT:
            return ids[len(ids) - n:]
        if self.truncation == Truncation.RIGHT:
            return ids[:n]
        head = n // 2
        return ids[:head] + ids[len(ids) - (n - head):]

    def metadata(self) -> dict:
        """What an artifact records of the flags given (verl's names; nothing when none was)."""
        return ({} if self.max_length is None else {"max_prompt_length": self.max_length}) | (
            {"truncation": self.truncation.value} if self.truncation != Truncation.ERROR else {}) | (
            {"filter_overlong_prompts": True} if self.filter_overlong else {})
