"""How many KV pages a workload needs, and how many fit in a device's memory (pure functions).

`Workload.pages` is the most pages its requests hold at once, every sample at full length, so a pool of
that size never preempts (with `prefix_copies`, also the CPU's prompt copies); `pool_pages` is a CUDA
pool as nano-vllm sizes it, capped by the workload (docs/engine.md, "Pool sizing").
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from ..kv_policies import Dense, KVPolicy

GiB = 2**30


class PoolTooSmall(RuntimeError):
    pass


def check_memory_utilization(fraction: object, name: str = "--gpu-memory-utilization") -> float:
    """`fraction` if it is a real number in (0, 1], else one sentence naming `name` (a flag or a field)."""
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
        raise ValueError(f"{name} must be a fraction in (0, 1], got {fraction!r}")
    if not 0 < fraction <= 1:
        raise ValueError(f"{name} must be a fraction in (0, 1], got {fraction:g}")
    return fraction


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@dataclass(frozen=True)
class Workload:
    """What a KV pool is sized for: (prompt tokens, samples, max new tokens, KV policy) per request."""

    requests: tuple[tuple[int, int, int, KVPolicy], ...]
    max_batch: int
    page_size: int
    prefix_copies: bool = False  # the CPU's cascade: a copy of each group's full prompt pages in the pool

    @classmethod
    def of(cls, requests: Sequence[tuple], max_batch: int, page_size: int,
           prefix_copies: bool = False) -> Workload:
        """`requests`: (prompt, samples, max new tokens[, policy]) each (default policy: dense)."""
        rows = tuple((int(r[0]), int(r[1]), int(r[2]), r[3] if len(r) > 3 else Dense()) for r in requests)
        return cls(rows, max_batch, page_size, prefix_copies)

    def _split(self, prompt: int, max_new: int, policy: KVPolicy) -> tuple[int, int]:
        """(full prompt pages a group shares, pages each sample owns at full length). A sample caches at
        most `policy.max_cache` tokens (prompt + max_new - 1 without eviction: its last sampled token is
        never fed back); an evicting sample whose cache reaches budget + buffer then owns that many."""
        shared = prompt // self.page_size
        own = pages_for(policy.max_cache(prompt, max_new), self.page_size) - shared
        if policy.evicts and prompt + max_new - 1 >= policy.capacity:
            own = max(own, pages_for(policy.capacity, self.page_size))
        return shared, own

    def one_sample(self) -> int:
        """Pages of the largest sample alone at full length: the least a pool must hold (alone, a sample
        owns its prompt's pages, so an evicting one compresses into them)."""
        return max((pages_for(k.max_cache(p, m), self.page_size) for p, _, m, k in self.requests), default=1)

    def longest(self) -> int:
        """The longest cache a sample holds plus one (prompt + max new tokens without eviction)."""
        return max((k.max_cache(p, m) + 1 for p, _, m, k in self.requests), default=1)

    @property
    def window(self) -> int:
        """The widest query window of the requests' eviction policies (0: none evicts)."""
        return max((k.window for _, _, _, k in self.requests if k.evicts), default=0)

    def pages(self) -> int:
        """The most pages the requests hold at once, every sample at full length (see the module)."""
        if not self.requests:
            return 1
        groups, owns, shares = 0, [], []
        for prompt, n, max_new, policy in self.requests:
            shared, own = self._split(prompt, max_new, policy)
            copied = self.prefix_copies and not policy.evicts
            copies = 2 if copied else 1
            running = min(n, self.max_batch)
            # the prompt's partial page stays while a sample that has not copied it waits for a slot
            waits = prompt % self.page_size and (n > self.max_batch or len(self.requests) > 1)
            slack = running if copied else 0  # the copy leaves each sample a page to grow into
            groups += copies * shared + int(waits) + running * own + slack
            owns.append(own + (1 if copied else 0))
            shares.append(copies * shared + int(waits))
        # at most max_batch samples run, from at most max_batch groups
        bound = self.max_batch * max(owns) + min(len(shares), self.max_batch) * max(shares)
        return max(min(groups, bound), self.one_sample())


def pool_pages(free_bytes: int, total_bytes: int, activation_bytes: int, page_bytes: int,
               workload: Workload, utilization: float = 0.9) -> int:
    """Pages of a device pool: what fits in `utilization` of the device's memory beyond what is in use
    (total - free: weights, other processes) and the activations' peak, capped by `workload.pages()`."""
    room = int(total_bytes * utilization) - (total_bytes - free_bytes) - activation_bytes
    fit = max(room, 0) // page_bytes
    one = workload.one_sample()
    if fit < one:
        raise PoolTooSmall(
            f"one sample of {workload.longest()} tokens needs {one * page_bytes / GiB:.2f} GiB of KV cache "
            f"but only {max(room, 0) / GiB:.2f} GiB remain of --gpu-memory-utilization {utilization:g} x "
            f"{total_bytes / GiB:.1f} GiB after {(total_bytes - free_bytes) / GiB:.1f} GiB in use and "
            f"{activation_bytes / GiB:.2f} GiB of activations (raise --gpu-memory-utilization, or lower "
            "--max-new-tokens or --max-num-batched-tokens)")
    return min(fit, workload.pages())
