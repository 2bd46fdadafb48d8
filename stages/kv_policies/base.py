"""The KV policy interface and the policies that evict nothing: `Dense` and `BlockTopK`."""

from __future__ import annotations

from collections.abc import Callable

BudgetFn = Callable[[int], int]  # cache length at which a token is produced -> budget (0 = dense)


class KVPolicy:
    """The interface. `read_budget` is block top-k's per-step budget (0 = read every cached token); the
    eviction bookkeeping below is the identity for policies that evict nothing."""

    name: str = ""
    evicts: bool = False
    window: int = 0  # post-RoPE queries per layer the policy needs at a compression (0: none)

    def read_budget(self, cache_len: int) -> int:
        """Budget of the decode step that produces the token at `cache_len` (its query sits at position
        cache_len - 1): the KV tokens block top-k reads; 0 = every cached token."""
        return 0

    def token_budget(self, cache_len: int) -> int:
        """The budget recorded for a token produced at `cache_len` (the rollouts' `budgets`; 0 = dense):
        block top-k's read budget, an eviction policy's KV budget."""
        return self.read_budget(cache_len)

    @property
    def sparse(self) -> bool:
        """Whether decoding under this policy can differ from dense decoding."""
        return False

    def cache_len(self, prompt_len: int, fed: int) -> int:
        """Tokens in a sample's cache after its prompt was prefilled and `fed` of its generated tokens
        were fed by decode steps (compressions included)."""
        return prompt_len + fed

    def compressions(self, prompt_len: int, fed: int) -> int:
        """The compressions a sample's cache went through by the time `fed` of its generated tokens were
        fed (those `cache_len` includes): what a recompute's replay rebuilds."""
        return 0

    def max_cache(self, prompt_len: int, max_new_tokens: int) -> int:
        """The most tokens a sample's cache ever holds (its last sampled token is never fed back)."""
        return prompt_len + max_new_tokens - 1

    def compression_due(self, cached: int, fed: int) -> bool:
        """Whether a cache of `cached` tokens, `fed` generated tokens after the prefill, is compressed
        before the next decode step."""
        return False

    def spec(self) -> str:
        """The text form `stages.core.sparsity.parse_sparsity` reads back (a schedule's needs its path)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec()!r})"


class Dense(KVPolicy):
    name = "dense"

    def spec(self) -> str:
        return "dense"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Dense)

    def __hash__(self) -> int:
        return hash("dense")


class BlockTopK(KVPolicy):
    """Block top-k selection at the budget of `budget_at` (an int, a `Schedule` or a budget function of
    the cache length). Every token stays cached; `label` is the spec text (a schedule's path);
    `schedule` the `Schedule` the policy was made of, if any (a run stores it)."""

    name = "block_topk"

    def __init__(self, budget_at: BudgetFn, label: str = "", schedule=None):
        self.budget_at, self.label, self.schedule = budget_at, label, schedule

    @property
    def sparse(self) -> bool:
        """False for a schedule dense in every bin (a plan whose cost model priced every budget above
        dense): it decodes as dense decoding does."""
        return self.schedule is None or any(self.schedule.budgets)

    def read_budget(self, cache_len: int) -> int:
        return int(self.budget_at(cache_len))

    def spec(self) -> str:
        return self.label or "block_topk"
