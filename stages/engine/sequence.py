"""Requests, sampling parameters and the per-sample state the scheduler moves around."""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from ..kv_policies import KVPolicy

MIN_TEMPERATURE = 1e-6  # below it, logits / T can overflow float32 (NaN logprobs): 0 is greedy
TEMPERATURE_FLOOR = f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}"  # what flags say of a smaller one


def below_temperature_floor(t: float) -> bool:
    """A positive temperature too small to divide the logits by (0 itself is greedy)."""
    return 0 < t < MIN_TEMPERATURE


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. Temperature 0 is greedy, else at least MIN_TEMPERATURE and finite. Top-k (0 = off)
    is applied before top-p. Reported logprobs are those of the full distribution at the sampling
    temperature (1 when greedy), before any top-k/top-p truncation: the convention of
    `stages.scoring.generate.sample_next`. `seed` (with the request id and the sample's index) seeds each
    sample's draws, so it is a whole number >= 0: there is no "random" seed. Each field of a wrong
    type or range is refused in one sentence naming it, here at construction; `logprobs` past the
    vocabulary is refused by `Engine.generate`, which knows the model."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    n: int = 1  # samples of the prompt, sharing one prefill
    ignore_eos: bool = False
    logprobs: int = 0  # also return this many top logprobs per generated token

    def __post_init__(self) -> None:
        whole = {"max_new_tokens": (1, "at least 1"), "top_k": (0, ">= 0 (0: off)"),
                 "seed": (0, ">= 0 (with the request id and sample index it seeds each sample's draws; "
                          "there is no random seed)"),
                 "n": (1, "at least 1 (samples per prompt)"), "logprobs": (0, ">= 0")}
        for name, (least, rule) in whole.items():
            object.__setattr__(self, name, whole_number(name, getattr(self, name), least, rule))
        for name in ("temperature", "top_p"):
            object.__setattr__(self, name, real_number(name, getattr(self, name)))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        t = self.temperature
        if not (t == 0 or MIN_TEMPERATURE <= t < math.inf):
            raise ValueError(f"temperature must be 0 (greedy) or a finite number of at least "
                             f"{MIN_TEMPERATURE:g}, got {t}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def whole_number(name: str, value: object, least: int, rule: str) -> int:
    """`value` as an int if it is a whole number (not a bool) of at least `least`, else one sentence naming
    the field: `name` must be `rule`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be a whole number {rule}, got {value!r}")
    if value < least:
        raise ValueError(f"{name} must be {rule}, got {value}")
    return int(value)


def real_number(name: str, value: object) -> float:
    """`value` as a float if it is a real number (not a bool), else one sentence naming the field."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


@dataclass
class Completion:
    """One finished sample."""

    request_id: int
    sample: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token
    budgets: list[int]  # budget of the step that produced each token (0 = dense; the first is prefill)
    finish_reason: str  # stop | length
    top_logprobs: list[list[tuple[int, float]]] | None = None
    kv_lens: list[int] | None = None  # KV tokens the cache held at each token (eviction's retained set)
    policy: str | None = None  # the request's KV policy (its spec)
    # speculative decoding: per token, whether it was a draft the dense model kept (else drawn densely),
    # and the drafts this sample proposed; None / 0 otherwise
    accepted: list[bool] | None = None
    drafted: int = 0


def draft_acceptance(completions: Seq[Completion]) -> float | None:
    """Speculative samples: the share of their drafts the dense model kept (None: no drafts)."""
    drafted = sum(c.drafted for c in completions if c.accepted is not None)
    return sum(sum(c.accepted) for c in completions if c.accepted is not None) / drafted if drafted else None


class Status(enum.Enum):
    READY = 0  # prefilled (its first token sampled), waiting for a slot in the running batch
    RUNNING = 1
    FINISHED = 2
    PREEMPTED = 3  # its pages were taken back; waiting to be recomputed


@dataclass
class Request:
    """A prompt and its n samples, under one KV policy."""

    request_id: int
    prompt: list[int]
    params: SamplingParams
    policy: KVPolicy
    eos_ids: frozenset[int]


@dataclass(eq=False)
class Sequence:
    """One sample. `tokens` are the generated tokens the host has read; `pending` more were sampled by
    decode steps still in flight on the device (engine.py: a pipelined runner returns a step's tokens
    one step late), so `num_tokens` counts them: it is what the next decode step's position and pages
    follow. `seed`: the sample's own seed (from its request's seed, id and sample index), which seeds
    `generator` on the host path and keys the device path's draws (sampler.py)."""

    request: Request
    sample: int
    generator: torch.Generator | None
    seed: int = 0
    pages: list[int] = field(default_factory=list)  # block table: physical page of logical page i
    tokens: list[int] = field(default_factory=list)  # generated so far (read back)
    pending: int = 0  # sampled on the device, not read back yet
    logprobs: list[float] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    status: Status = Status.READY
    preemptions: int = 0
    cached: int = 0  # tokens in its KV cache (slots 0..cached-1 of its pages); the next goes to slot `cached`
    compactions: int = 0  # compressions of its cache so far (eviction; the static step re-sends its row)
    kv_lens: list[int] = field(default_factory=list)
    speculative: bool = False  # drawn by speculative cycles: `accepted` and `drafted` are recorded
    accepted: list[bool] = field(default_factory=list)  # (Completion.accepted)
    drafted: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt) + len(self.tokens) + self.pending

    @property
    def position(self) -> int:
        """RoPE position of the token its next decode step feeds (the last sampled one). Without
        eviction it equals `cached`; an eviction policy keeps the two apart."""
        return self.num_tokens - 1

    @property
    def policy(self) -> KVPolicy:
        return self.request.policy

    def budget_now(self, ahead: int = 0) -> int:
        """Budget of the next decode step (its query sits at position num_tokens - 1), or of the step
        `ahead` steps after it (a speculative cycle's later drafts)."""
        return self.request.policy.read_budget(self.num_tokens + ahead)

    def completion(self) -> Completion:
        return Completion(self.request.request_id, self.sample, self.request.prompt, self.tokens,
                          self.logprobs, self.budgets, self.finish_reason or "length",
                          self.top_logprobs, self.kv_lens, self.request.policy.spec(),
                          self._accepted(), self.drafted)

    def _accepted(self) -> list[bool] | None:
        """Per token, whether it was a kept draft; the prefill's first token was drawn densely. None for a
        sample of an engine that does not speculate."""
        if not self.speculative:
            return None
        return [False] * (len(self.tokens) - len(self.accepted)) + self.accepted
