"""Eviction policies (Sparse-RL's KV compression): SnapKV and R-KV under a fixed KV budget.

The rule, per sample, per layer, per KV head (each KV head keeps its own tokens, all keep as many):

When: the prompt is prefilled whole (no compression at prefill, as in the Sparse-RL release, whose
extend step keeps the full KV). A decode step appends the fed token's keys and values and its query
attends densely to everything retained. After any decode step that leaves the cache holding
budget + buffer tokens or more, the cache is compressed back to `budget` tokens before the next step.
So a cache never holds more than max(budget + buffer, prompt + 1) tokens, compressions come every
`buffer` decode steps (the release's `step_length` divide method with divide length = buffer), and the
prompt's tokens are candidates like any other (the release compresses the whole retained set,
prompt included; its "max prompt" flag is what we call the budget).

What is kept, on a cache of L tokens in slots 0..L-1 (slot order = position order), with the
observation window Q: the post-RoPE queries of the last W positions (those of the last W slots):
- protected: the sink, slots 0..S-1 (positions 0..S-1, never evicted), and the window, slots L-W..L-1;
- importance of a slot j < L-W, for KV head h and its group G(h) of query heads (SnapKV, as the
  release and R-KV compute it):
      a[g, i, j] = q_{g,i} . k_{h,j} / sqrt(D)                 (i in the window, g in G(h))
      m[i, j]    = max_g a[g, i, j]                            (the release's attn_pooling="max")
      p[i, j]    = softmax over j' < L-W of m[i, j']           (the window keys are not in it)
      imp[j]     = mean_i p[i, j]
      pool[j]    = max of imp over j-3..j+3 within [0, L-W)    (max pooling, kernel 7)
  SnapKV's score is pool[j].
- R-KV's redundancy of slot j: with k^_j = k_j / (|k_j| + 1e-8) and c[i, j] = k^_i . k^_j for i != j
  (0 on the diagonal), each row i forgives its most recent highly similar slot, r(i) = the largest j
  with c[i, j] > 0.5 (slot 0 when none), by setting c[i, r(i)] = 0; then
      red[j] = softmax over j' < L of (mean_i c[i, j'])
  and R-KV's score is lambda * pool[j] - (1 - lambda) * red[j], lambda = 0.1.
- kept: the sink, the window and the budget - S - W candidate slots S..L-W-1 of highest score, ties
  broken toward the earlier position; the kept tokens are compacted into slots 0..budget-1 in position
  order. Their keys keep the RoPE of their original positions, and a later query keeps its true
  position: only the cache length shrinks.

Constants and where the defaults come from:
- budget: given (the release's --sglang-compress-max-prompt, 512 in its runs). It must exceed S + W.
- W = 8: the observation window (R-KV's alpha = 8 observation tokens; the release's compress_max_window
  = 8, which also makes its protected recent window 8 tokens).
- buffer = 128: R-KV's B_buffer and the release's compress_divide_length (step_length) of 128.
- kernel 7, max pooling: the release's KVCluster (kernel_size=7, pooling="maxpool") and R-KV's code.
  (SnapKV's own repository defaults to average pooling over 5 at prompt time; the decode-time form
  Sparse-RL and R-KV run uses the above.)
- attention pooled over the query group by max before the softmax: the release (attn_pooling="max")
  and R-KV's compute_attention_scores; mean over the window's queries after the softmax.
- lambda = 0.1, threshold 0.5, "last" retention, softmax normalisation: the release's KVCluster for
  RKV (mix_alpha=0.1, sim_threshold=0.5, retain_direction="last", sim_normalization=True) and R-KV's
  README (lambda 0.1; its code's default is 0.07).
- S = 4: StreamingLLM's four attention-sink tokens (the release's KVCluster first_tokens=4 for its
  streamingllm mode). Neither SnapKV nor R-KV protects a sink; this engine does.

Two deliberate departures from the release, both toward the papers: the kept set is chosen per layer
and per KV head (SnapKV and R-KV), where the release sums the scores over heads and shares one set
across heads (and its layers write one shared set per request); and compressions are timed by the
cache length (every `buffer` steps once it is full), where the release counts the batch's steps, so
that eviction is a function of the sample's own prefix and teacher forcing replays it.
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

    def cache_len(self, prompt_len: int, fed: int) -> int:
        first = self.first_compression(prompt_len)
        if fed < first:
            return prompt_len + fed
        return self.budget + (fed - first) % self.buffer

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
        try:
            kw[key] = int(value)
        except ValueError:
            raise ValueError(f"sparsity {spec!r}: {key} must be an integer number of tokens") from None
    return cls(budget, **kw).validate()
