"""Eviction policies (Sparse-RL's KV compression): SnapKV and R-KV under a fixed KV budget.

Per sample, layer and KV head: the prompt is prefilled whole; after a decode step that leaves the cache
at budget + buffer tokens or more, it is compressed back to `budget` before the next step. The sink
(first S tokens) and the observation window (last W) are kept; the other slots are ranked by SnapKV's
pooled attention of the window's queries (R-KV: that minus key redundancy), the best kept in position
order, their keys keeping the RoPE of their positions. Compressions are timed by the cache length, so
eviction is a function of the sample's own prefix and teacher forcing replays it. The rule, its
constants and where each comes from: docs/kv-compression.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import KVPolicy

SINK = 4
WINDOW = 8
BUFFER = 128
KERNEL = 7
MIX_LAMBDA = 0.1
SIMILARITY_THRESHOLD = 0.5


@dataclass(frozen=True)
class Eviction(KVPolicy):
    """A fixed KV budget kept by an importance rule (subclasses: `SnapKV`, `RKV`)."""

    budget: int
    window: int = WINDOW
    buffer: int = BUFFER
    sink: int = SINK

    evicts: ClassVar[bool] = True
    kernel: ClassVar[int] = KERNEL

    def validate(self, context: int | None = None, label: str | None = None) -> Eviction:
        """Self, or one sentence on what is wrong, starting with `label` (default: the spec's head)
        (`context`: the model's, when known)."""
        label = label or f"{self.name}:{self.budget}"
        if self.window < 1 or self.buffer < 1 or self.sink < 0:
            raise ValueError(f"{label}: the window and the buffer must be at least 1 and the sink at least "
                             f"0 tokens, got window {self.window}, buffer {self.buffer}, sink {self.sink}")
        if self.budget <= self.sink + self.window:
            raise ValueError(f"{label}: the budget must exceed the sink plus the window "
                             f"({self.sink} + {self.window} = {self.sink + self.window} tokens), which are "
                             "always kept, so that the rule keeps some tokens by score")
        if context is not None and self.capacity > context:
            raise ValueError(f"{label}: budget + buffer ({self.budget} + {self.buffer} = {self.capacity} "
                             f"tokens) exceeds the model's context of {context}, so its cache would never be "
                             "compressed")
        return self

    @property
    def capacity(self) -> int:
        """The cache length that triggers a compression."""
        return self.budget + self.buffer

    @property
    def sparse(self) -> bool:
        return True

    def token_budget(self, cache_len: int) -> int:
        return self.budget

    def compression_due(self, cached: int, fed: int) -> bool:
        return fed >= 1 and cached >= self.capacity  # the prefill itself is never compressed

    def first_compression(self, prompt_len: int) -> int:
        """Generated tokens fed when the first compression runs."""
        return max(1, self.capacity - prompt_len)

    def evicts_within(self, prompt_len: int, generated: int) -> bool:
        """Whether a teacher-forced sequence of `generated` tokens after its prompt (G - 1 of them fed)
        has any token read a compressed cache: its first compression comes before the last one is fed."""
        return self.first_compression(prompt_len) < generated - 1

    def cache_len(self, prompt_len: int, fed: int) -> int:
        first = self.first_compression(prompt_len)
        if fed < first:
            return prompt_len + fed
        return self.budget + (fed - first) % self.buffer

    def compressions(self, prompt_len: int, fed: int) -> int:
        first = self.first_compression(prompt_len)
        return 0 if fed < first else 1 + (fed - first) // self.buffer

    def max_cache(self, prompt_len: int, max_new_tokens: int) -> int:
        return min(prompt_len + max_new_tokens - 1, max(prompt_len + 1, self.capacity))

    def segments(self, prompt_len: int, fed: int) -> list[tuple[int, int, bool]]:
        """The fed tokens 0..fed-1 as (start, end, compressed after) runs between compressions: the
        tokens of a run attend to the set retained at the last compression and causally to each other."""
        out, start, end = [], 0, self.first_compression(prompt_len)
        while start < fed:
            out.append((start, min(end, fed), end <= fed))
            start, end = end, end + self.buffer
        return out

    def scores(self, q_window, keys):
        """Scores [B, Hkv, L - W] of the non-window slots (stages/kv_policies/scoring.py)."""
        raise NotImplementedError

    def retained(self, q_window, keys):
        """Slots kept per KV head, ascending: [B, Hkv, budget] int64 (scoring.retained_slots)."""
        from .scoring import retained_slots

        return retained_slots(self, q_window, keys)

    def spec(self) -> str:
        return f"{self.name}:{self.budget},window={self.window},buffer={self.buffer},sink={self.sink}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec()!r})"


@dataclass(frozen=True, repr=False)
class SnapKV(Eviction):
    """SnapKV (Li et al. 2024) at decode time: importance from the observation window's attention."""

    name: ClassVar[str] = "snapkv"

    def scores(self, q_window, keys):
        from .scoring import attention_importance

        return attention_importance(q_window, keys, self.window, self.kernel)


@dataclass(frozen=True, repr=False)
class RKV(Eviction):
    """R-KV (Cai et al. 2025): importance minus redundancy (cosine similarity of keys)."""

    name: ClassVar[str] = "rkv"
    mix_lambda: ClassVar[float] = MIX_LAMBDA
    threshold: ClassVar[float] = SIMILARITY_THRESHOLD

    def scores(self, q_window, keys):
        from .scoring import attention_importance, key_redundancy

        importance = attention_importance(q_window, keys, self.window, self.kernel)
        redundancy = key_redundancy(keys, self.threshold)[..., : keys.shape[2] - self.window]
        return self.mix_lambda * importance - (1 - self.mix_lambda) * redundancy


EVICTION_POLICIES: dict[str, type[Eviction]] = {"snapkv": SnapKV, "rkv": RKV}


def parse_eviction(spec: str) -> Eviction:
    """'snapkv:B' or 'rkv:B', optionally followed by ',window=W', ',buffer=N', ',sink=S' -> the policy
    (not yet checked against a model's context: `Eviction.validate`)."""
    kind, _, rest = spec.partition(":")
    cls = EVICTION_POLICIES.get(kind.lower())
    if cls is None:
        raise ValueError(f"unknown KV compression {kind!r}: expected one of {', '.join(EVICTION_POLICIES)}")
    budget_text, *options = rest.split(",")
    try:
        budget = int(budget_text)
    except ValueError:
        raise ValueError(f"sparsity {spec!r}: the KV budget must be an integer number of tokens") from None
    kw = {}
    for option in options:
        key, _, value = option.partition("=")
        key = key.strip()
        if key not in ("window", "buffer", "sink"):
            raise ValueError(f"sparsity {spec!r}: unknown option {key!r} (expected window=, buffer= or "
                             "sink=)")
        if key in kw:
            raise ValueError(f"sparsity {spec!r}: {key}= is given twice; give it once")
        try:
            kw[key] = int(value)
        except ValueError:
            raise ValueError(f"sparsity {spec!r}: {key} must be an integer number of tokens") from None
    return cls(budget, **kw).validate()
