"""`ModelRunner`: what runs the model for the engine on one device: the KV pool, prefill, decode, sampling.

The engine decides what runs and hands the runner rows to prefill and samples to decode; the runner owns
the KV pool, the static decode step (static_decode.py) and the sampler call, with the kernels of one ops
object chosen when it is built. This class is the shared path; `CpuRunner` (cpu/) and `GpuRunner` (gpu/)
add their device's machinery through the hooks it calls. Prefill is chunked to `max_prefill_tokens`
per forward. With a static step decode results come back a step late (`lag`); the plain step samples on
the host and returns them at once.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from sparrow.kernels.ops import ops_for

from ..attention.kv_cache import PagedKVCache
from ..attention.paged import (
    DecodeAttention,
    DecodeBatch,
    KeyTap,
    PrefillAttention,
    QueryCapture,
    Recompute,
    VerifyAttention,
)
from ..model.llama import Transformer
from .block_manager import BlockManager
from .compaction import QueryWindows, compact, write_retained
from .config import DecodeStep, EngineConfig
from .memory import Workload, pages_for
from .sampler import logprobs_at_temperature, sample_by_position, sample_tokens
from .scheduler import Step
from .sequence import Sequence as Sample
from .static_decode import SCORE, Select, StaticDecode, StepOutput, kept_pages


@dataclass
class PrefillRow:
    """One row of a prefill: a fresh prompt (`budgets` None; its last position's logits are sampled) or a
    preempted sample's recompute (its prompt and generated tokens but the last; `budgets[j]`: the budget
    of the decode step that fed generated token j). `pages`: its block table, every page allocated."""

    tokens: list[int]
    prompt_len: int
    pages: list[int]
    budgets: list[int] | None = None
    request_id: int = -1
    samples: int = 1  # of a fresh prompt, which will share its pages
    window: int = 0  # an eviction policy's observation window: the prompt's last queries to keep


Segment = tuple[int, int, int]  # (row, first position, end position) of one forward


def plan_forwards(lengths: Sequence[int], cap: int) -> list[list[Segment]]:
    """The forwards of a prefill: rows of at most `cap` tokens go whole, in order, several to a forward
    while (rows x the longest) <= cap; a longer row goes alone, in chunks of `cap` tokens."""
    forwards: list[list[Segment]] = []
    group: list[Segment] = []
    for i, n in enumerate(lengths):
        if n > cap:
            if group:
                forwards.append(group)
                group = []
            forwards += [[(i, s, min(s + cap, n))] for s in range(0, n, cap)]
            continue
        if group and (len(group) + 1) * max(n, max(e for _, _, e in group)) > cap:
            forwards.append(group)
            group = []
        group.append((i, 0, n))
    if group:
        forwards.append(group)
    return forwards


def fed_tokens(seq: Sample, start: int) -> list[int]:
    """The sample's tokens from position `start` to its last (without copying a long prompt)."""
    prompt = len(seq.request.prompt)
    return seq.tokens[start - prompt:] if start >= prompt else (seq.request.prompt + seq.tokens)[start:]


class ModelRunner:
    def __init__(self, model: Transformer, config: EngineConfig):
        self.model, self.cfg = model, model.cfg
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        config = config.for_device(self.device)
        self.config = config
        self.max_batch, self.page_size = config.max_batch, config.page_size
        self.dense_layers = config.dense_layers
        self.max_prefill_tokens, self.decode_step = config.max_prefill_tokens, config.decode_step
        self.ops = ops_for(self.device, config.kernels)
        self.scale = 1.0 / math.sqrt(self.cfg.head_dim)
        self.cache: PagedKVCache | None = None
        self.centroid_dtype = torch.float32  # of the pool's page centroids (kernels/CONTRACT.md)
        self.static: StaticDecode | None = None
        self.windows: QueryWindows | None = None
        self.fixed_pages = False  # the pool's size was given, not sized from a workload
        self._ready: deque[StepOutput] = deque()  # plain steps' results, not collected yet

    # ------------------------------------------------------------------ the pool

    def reserve(self, workload: Workload, num_pages: int | None = None) -> int:
        """Make the pool hold `num_pages` pages (None: what `workload` needs, or for a device pool what
        fits) and the static step's block table the workload's longest sample; returns the pool's pages.
        A pool sized from an earlier workload is kept if it is large enough, else replaced."""
        fixed = num_pages is not None
        if self.cache is None or (fixed and num_pages != self.cache.num_pages) or (
                not fixed and self._too_small(workload)) or self.cache.centroids.dtype != self.centroid_dtype:
            self.close()
            pages = num_pages if fixed else self._pool_size(workload)
            self.cache = PagedKVCache(self.cfg, pages, self.page_size, self.dtype, self.device,
                                      self.centroid_dtype)
        if workload.window > self.cache.window:  # eviction: the query ring (the static step writes it)
            self.static = None
            self.cache.add_query_ring(self.max_batch, workload.window)
        self.fixed_pages = fixed
        width = pages_for(workload.longest(), self.page_size)
        if self.decode_step != DecodeStep.PLAIN and (self.static is None or self.static.max_pages < width):
            self.static = None
            self.static = StaticDecode(self.model, self.cache, max_batch=self.max_batch, max_pages=width,
                                       attention=self._static_attention(),
                                       capture=self.decode_step == DecodeStep.GRAPHS, ops=self.ops,
                                       hidden=self._static_hidden(),
                                       score_queries=self.config.speculate + 1)
        return self.cache.num_pages

    def _too_small(self, workload: Workload) -> bool:
        return self.fixed_pages or self.cache.num_pages < self._pages_needed(workload)

    def _pool_size(self, workload: Workload) -> int:
        return self._pages_needed(workload)

    def _pages_needed(self, workload: Workload) -> int:
        """The pages a pool for `workload` holds so that nothing is preempted."""
        return workload.pages()

    def _static_hidden(self) -> Callable | None:
        """What computes the static step's hidden states (`static_decode.StaticDecode`'s `hidden`; None:
        the model's forward). A function or partial, never a bound method of the runner."""
        return None

    def _static_attention(self) -> Callable[[DecodeBatch], DecodeAttention]:
        """The static step's attention per batch (a partial, not a bound method: no reference cycle)."""
        return functools.partial(DecodeAttention, self.cache, dense_layers=self.dense_layers,
                                 scale=self.scale, ops=self.ops)

    def close(self) -> None:
        """Free the pool and the static step (its CUDA graphs with it); steps in flight are dropped."""
        self.static = None
        self.windows = None
        self.cache = None
        self._ready.clear()

    # ------------------------------------------------------------------ a run's hooks

    def begin(self, blocks: BlockManager) -> None:
        """A new run over `blocks`, every page free."""
        self.windows = QueryWindows(self.cache, self.max_batch) if self.cache.queries is not None else None

    def on_finish(self, request_id: int) -> None:
        """A sample of the request finished."""
        if self.windows is not None:
            self.windows.finished(request_id)

    def refresh_weights(self) -> None:
        """The model's weights changed in place (an optimizer step, a load): drop what was derived from
        them. The plain path derives nothing."""

    def synchronize(self) -> None:
        """Wait for the device (for timing)."""

    # ------------------------------------------------------------------ prefill

    def prefill(self, rows: list[PrefillRow]) -> Tensor | None:
        """Write every row's keys and values into its pages -> the logits [fresh rows, V] float32 of each
        fresh row's last position, in row order (None without fresh rows)."""
        last: dict[int, Tensor] = {}
        windows = {i: self.windows.prompt_window(r.request_id, r.window, r.samples)
                   for i, r in enumerate(rows) if r.window and r.budgets is None}
        for forward in plan_forwards([len(r.tokens) for r in rows], self.max_prefill_tokens):
            hidden = self._forward(rows, forward, self.cache, windows)
            for j, (i, start, end) in enumerate(forward):
                if rows[i].budgets is None and end == len(rows[i].tokens):
                    last[i] = hidden[j, end - start - 1]
        if not last:
            return None
        return self._head(torch.stack([last[i] for i in sorted(last)]))

    def verify(self, seqs: list[Sample], starts: list[int]) -> Tensor:
        """One dense forward over each sample's positions from `starts[i]` to its last token (a speculative
        cycle's fed tokens), attending to its earlier positions in its pages and rewriting the keys and
        values of its own -> log_softmax(logits / T) [all fed tokens, V] float32 (T = 1 for a greedy
        sample), sample after sample. Each fed token is a dense decode query whose cache ends at its
        position: on the static step (CUDA graphs on a GPU) as one row of a scoring step, else through
        `VerifyAttention`. The fed pages' centroids are left to the caller (the cycle's roll back)."""
        fed = [fed_tokens(s, start) for s, start in zip(seqs, starts)]
        if self.static is not None and self.static.fits(1, max(len(s.pages) for s in seqs)):
            return self.static.score(fed, starts, [s.pages for s in seqs],
                                     [s.request.params.temperature for s in seqs])
        params = [s.request.params for s, f in zip(seqs, fed) for _ in f]
        return logprobs_at_temperature(self._verify_forward(seqs, starts, fed), params)

    def _verify_forward(self, seqs: list[Sample], starts: list[int], fed: list[list[int]]) -> Tensor:
        """`verify`'s plain forward -> logits [all fed tokens, V] float32."""
        P, dev = self.page_size, self.device
        counts = [len(f) for f in fed]
        g, t = len(seqs), max(counts)
        tokens = torch.zeros(g, t, dtype=torch.long)
        positions = np.zeros((g, t), dtype=np.int64)
        valid = np.zeros((g, t), dtype=bool)
        width = max(len(s.pages) for s in seqs)
        table = np.full((g, width), -1, dtype=np.int64)
        for j, (s, start, f) in enumerate(zip(seqs, starts, fed)):
            n = len(f)
            tokens[j, :n] = torch.tensor(f)
            positions[j] = np.minimum(start + np.arange(t), start + n - 1)  # padding repeats the last
            valid[j, :n] = True
            table[j, : len(s.pages)] = s.pages
        slot = np.take_along_axis(table, positions // P, axis=1) * P + positions % P
        rows = np.repeat(np.arange(g), counts)  # one decode query per fed token, in row order
        groups = np.full(len(rows) + 1, len(rows), dtype=np.int32)  # a sample's rows read its pages once
        groups[: g + 1] = np.cumsum([0] + counts)
        queries = DecodeBatch(torch.from_numpy(table[rows].astype(np.int32)).to(dev),
                              torch.from_numpy(positions[valid] + 1).to(device=dev, dtype=torch.int32),
                              torch.zeros(len(rows), dtype=torch.int32, device=dev),
                              torch.full((len(rows),), -1, dtype=torch.int64, device=dev), False,
                              groups=torch.from_numpy(groups).to(dev), queries_per_group=t)
        mask = torch.from_numpy(valid).to(dev)
        attn = VerifyAttention(self.cache, mask, torch.from_numpy(slot[valid]).to(dev),
                               self._decode_attention(queries, [seqs[r] for r in rows]))
        hidden = self.model.hidden_states(tokens.to(dev), positions=torch.from_numpy(positions).to(dev),
                                          attention=attn)
        return self._head(hidden[mask])  # [sum(counts), V]

    def _forward(self, rows: list[PrefillRow], forward: list[Segment], cache: PagedKVCache,
                 windows: dict[int, Tensor] | None = None) -> Tensor:
        """One forward of the prefill -> hidden states [G, T, hidden]. `windows`: the query-window
        buffers of the rows whose policy evicts, by row."""
        P, dev = self.page_size, self.device
        g, t = len(forward), max(end - start for _, start, end in forward)
        tokens = torch.zeros(g, t, dtype=torch.long)
        positions = np.zeros((g, t), dtype=np.int64)
        table = np.zeros((g, max(pages_for(end, P) for _, _, end in forward)), dtype=np.int64)
        valid = np.zeros((g, t), dtype=bool)
        for j, (i, start, end) in enumerate(forward):
            row = rows[i]
            tokens[j, : end - start] = torch.tensor(row.tokens[start:end])
            positions[j] = start + np.arange(t)
            table[j, : pages_for(end, P)] = row.pages[: pages_for(end, P)]
            valid[j, : end - start] = positions[j, : end - start] < row.prompt_len
        slot = np.take_along_axis(table, positions // P, axis=1) * P + positions % P  # [G, T]
        continued = forward[0][1] > 0  # a later chunk of one row
        captures = []
        for j, (i, start, end) in enumerate(forward):
            if windows and i in windows:
                w = rows[i].window
                pos = np.arange(max(start, rows[i].prompt_len - w), end)
                if len(pos):
                    captures.append(QueryCapture(j, torch.from_numpy(pos - start).to(dev),
                                                 torch.from_numpy(pos % w).to(dev), windows[i]))
        attn = PrefillAttention(cache, torch.from_numpy(valid).to(dev), torch.from_numpy(slot[valid]).to(dev),
                                self.ops, self._recompute(rows, forward, positions, slot, table),
                                self._key_taps(forward),
                                torch.from_numpy(table).to(dev) if continued else None, captures)
        return self.model.hidden_states(tokens.to(dev), positions=torch.from_numpy(positions).to(dev),
                                        attention=attn)

    def _key_taps(self, forward: list[Segment]) -> list[KeyTap]:
        """What reads a prefill forward's keys and values per layer besides the pool (nothing here)."""
        return []

    def _recompute(self, rows: list[PrefillRow], forward: list[Segment], positions: np.ndarray,
                   slot: np.ndarray, table: np.ndarray) -> Recompute | None:
        """The generated positions of recomputed rows in this forward: their writes in page-offset order
        and the budgets their decode steps had."""
        dev, P = self.device, self.page_size
        budgets = np.zeros(slot.shape, dtype=np.int64)
        gen_rows, gen_cols = [], []
        for j, (i, start, end) in enumerate(forward):
            row = rows[i]
            if row.budgets is None or end <= row.prompt_len:
                continue
            pos = np.arange(max(start, row.prompt_len), end)
            budgets[j, pos - start] = np.asarray(row.budgets, dtype=np.int64)[pos - row.prompt_len]
            gen_rows.append(np.full(len(pos), j))
            gen_cols.append(pos - start)
        if not gen_rows:
            return None
        r, c = np.concatenate(gen_rows), np.concatenate(gen_cols)
        appended = []
        for off in range(P):
            at = positions[r, c] % P == off
            if at.any():
                appended.append((torch.from_numpy(r[at]).to(dev), torch.from_numpy(c[at]).to(dev),
                                 torch.from_numpy(slot[r[at], c[at]]).to(dev)))
        sparse = torch.from_numpy(budgets).to(dev) if budgets.any() else None
        return Recompute(appended, sparse, torch.from_numpy(positions).to(dev),
                         torch.from_numpy(table).to(dev), frozenset(self.dense_layers))

    # ------------------------------------------------------------------ decode

    @property
    def lag(self) -> int:
        """Decode steps the engine leaves in flight after launching one: 1 with a static step, else 0."""
        return 0 if self.decode_step == DecodeStep.PLAIN else 1

    def pipelines(self, seqs: list[Sample]) -> bool:
        """Whether a decode step of these samples runs on the static step (asynchronously): else it is a
        plain step, which feeds each sample's last token from the host."""
        return self.static is not None and self.static.fits(len(seqs), max(len(s.pages) for s in seqs))

    def launch_decode(self, seqs: list[Sample], budgets: list[int], select: Select = Select.EVERY) -> None:
        """Queue one decode step: each sample feeds its last token (on the static step: the token the
        device sampled for it, which the host may not have read yet) at its budget. `select`: on the
        static step, where the sparse layers' pages come from (the plain step selects at every step)."""
        if self.pipelines(seqs):
            self.static.launch(seqs, budgets, None if self.windows is None else self.windows.bases(seqs),
                               select)
            return
        if self.static is not None:
            self.static.forget_rows()  # the samples move on without it
        tokens, logps, top = self.sample(seqs, self.decode(seqs, budgets))
        self._ready.append(StepOutput(seqs, tokens, logps, top))

    def forget_rows(self) -> None:
        """The samples' state moved on the host (a speculative roll back): the static step's next launch
        uploads every row again."""
        if self.static is not None:
            self.static.forget_rows()

    def step_logprobs(self, batch: int) -> Tensor:
        """A copy of the last launched static step's log_softmax(logits / T) [batch, V] (queued on the
        device, taken before the next step overwrites it)."""
        return self.static.logp[:batch].clone()

    def warm_up(self, batch: int, budgets) -> None:
        """Capture (or compile) the static step for `batch` running samples at each of these budgets (a
        step whose rows all have that budget)."""
        if self.static is not None:
            selects = [Select.EVERY]
            if self.config.speculate and self.config.reuse_draft_pages:  # a cycle's first and later drafts
                selects = [Select.KEEP, Select.REUSE]
            for budget in sorted(set(budgets)):
                k = kept_pages([budget], self.page_size, self.static.max_pages)
                for select in selects:
                    self.static.prepare(min(batch, self.max_batch), k, select)
            if self.config.speculate:  # the verification's scoring step
                self.static.prepare(min(batch, self.max_batch), SCORE)

    def in_flight(self) -> int:
        """Launched decode steps whose results were not collected."""
        return len(self._ready) + (self.static.in_flight() if self.static is not None else 0)

    def collect(self, keep: int = 0) -> list[StepOutput]:
        """Results of the launched steps, oldest first, leaving at most `keep` static steps in flight
        (waits for the device to finish the others)."""
        out = list(self._ready)
        self._ready.clear()
        while self.static is not None and self.static.in_flight() > keep:
            out.append(self.static.collect())
        return out

    def decode(self, seqs: list[Sample], budgets: list[int]) -> Tensor:
        """One plain decode step: each sample feeds its last token at its budget -> logits [B, V] float32."""
        P = self.page_size
        pos, slots, lens = [], [], []
        for s in seqs:
            pos.append(s.position)  # the last sampled token's RoPE position
            c = s.cached  # its k/v go to slot `cached` of its pages (the scheduler gave it the page)
            slots.append(s.pages[c // P] * P + c % P)
            lens.append(c + 1)
        width = max(len(s.pages) for s in seqs)
        table = np.full((len(seqs), width), -1, dtype=np.int32)
        for i, s in enumerate(seqs):
            table[i, : len(s.pages)] = s.pages
        tokens = [s.tokens[-1] for s in seqs]
        queries = self.windows.indices(seqs) if self.windows is not None else None
        dev = self.device
        positions = torch.tensor(pos, device=dev)
        batch = DecodeBatch(torch.from_numpy(table).to(dev),
                            torch.tensor(lens, dtype=torch.int32, device=dev),
                            torch.tensor(budgets, dtype=torch.int32, device=dev),
                            torch.tensor(slots, dtype=torch.int64, device=dev), any(b > 0 for b in budgets),
                            self._max_selected(budgets, width),
                            None if queries is None else torch.tensor(queries, dtype=torch.int64, device=dev))
        return self._decode_logits(tokens, pos, positions, self._decode_attention(batch, seqs))

    def _max_selected(self, budgets: list[int], width: int) -> int | None:
        return None  # selection may read the kept pages' count back from the device

    def _decode_attention(self, batch: DecodeBatch, seqs: list[Sample]) -> DecodeAttention:
        return DecodeAttention(self.cache, batch, self.dense_layers, self.scale, self.ops)

    def _decode_logits(self, tokens: list[int], pos: list[int], positions: Tensor,
                       attention: DecodeAttention) -> Tensor:
        hidden = self.model.hidden_states(torch.tensor(tokens, device=self.device)[:, None],
                                          positions=positions[:, None], attention=attention)
        return self._head(hidden[:, 0])

    def _head(self, hidden: Tensor) -> Tensor:
        """Final hidden states [B, H] -> logits [B, V] float32: the model's fp32 head."""
        return self.model.logits(hidden)

    # ------------------------------------------------------------------ eviction

    def apply(self, step: Step) -> None:
        """Move the pages a decode step's plan moves: its compressions (compaction.py), then its copies
        on write (the compressions read pages just given up before anything writes them)."""
        if step.compactions:
            compact(self.cache, self.windows, step.compactions)
        self.cache.copy_pages(step.copy_src, step.copy_dst)

    def restore(self, seq: Sample, pages: list[int]) -> None:
        """A preempted evicting sample's cache, rebuilt into `pages` by replaying its eviction over its
        prompt and every generated token but the last (the next decode step feeds that one), with the
        query window its next compression reads."""
        from ..attention.eviction_replay import replay

        dev, policy = self.device, seq.policy
        fed = seq.tokens[:-1]
        with torch.inference_mode():
            state = replay(self.model, torch.tensor([seq.request.prompt], device=dev),
                           torch.tensor([fed], dtype=torch.long, device=dev), policy,
                           prefill_chunk=self.max_prefill_tokens).state
        write_retained(self.cache, pages, [k[0] for k in state.k], [v[0] for v in state.v])
        last = len(seq.request.prompt) + len(fed) - 1  # the position of the last query seen
        _, hq, seen, d = state.queries[0].shape
        ring = torch.arange(last - seen + 1, last + 1, device=dev) % policy.window
        window = torch.zeros(len(state.queries), policy.window, hq, d, dtype=self.cache.queries.dtype,
                             device=dev)
        for layer, q in enumerate(state.queries):
            window[layer, ring] = q[0].transpose(0, 1).to(window.dtype)  # [seen, Hq, D]
        self.windows.pending[seq] = window

    # ------------------------------------------------------------------ sampling

    def sample(self, seqs: list[Sample], logits: Tensor):
        """Each sample's next token from its row of logits -> (tokens, logprobs, top (values, ids) [B, k]
        or None), on the host: with its own generator on the plain path, with the device path's race
        keyed by its seed and the position of its last token when the runner has a static step."""
        k = max(s.request.params.logprobs for s in seqs)
        params = [s.request.params for s in seqs]
        if self.decode_step == DecodeStep.PLAIN:
            tokens, logps, top = sample_tokens(logits, params, [s.generator for s in seqs], k)
        else:
            tokens, logps, top = sample_by_position(logits, params, [s.seed for s in seqs],
                                                    [s.position for s in seqs], k, self.ops)
        return tokens.tolist(), logps.tolist(), top

    # ------------------------------------------------------------------ profiling

    def profile_forwards(self, longest: int, scratch: PagedKVCache, part: str = "both") -> None:
        """The largest forwards of a workload whose longest sample has `longest` tokens, on a scratch pool
        (its pages reused cyclically; what they hold is garbage): "prefill", the last prefill chunk of
        that sample (max_prefill_tokens queries attending to the whole prefix), and "decode", a dense
        decode step of max_batch rows at that length. A device runner measures their peak memory."""
        P, dev = self.page_size, self.device
        n = pages_for(longest, P)
        pages = [i % scratch.num_pages for i in range(n)]
        if part in ("prefill", "both"):
            chunk = min(self.max_prefill_tokens, longest)
            row = PrefillRow([0] * longest, longest, pages)
            hidden = self._forward([row], [(0, longest - chunk, longest)], scratch)
            self.model.logits(hidden[:, -1])
            del hidden
        if part in ("decode", "both"):
            b = self.max_batch
            batch = DecodeBatch(torch.tensor([pages] * b, dtype=torch.int32, device=dev),
                                torch.full((b,), longest, dtype=torch.int32, device=dev),
                                torch.zeros(b, dtype=torch.int32, device=dev),
                                torch.full((b,), -1, dtype=torch.int64, device=dev), False, None)
            attn = DecodeAttention(scratch, batch, self.dense_layers, self.scale, self.ops)
            hidden = self.model.hidden_states(torch.zeros(b, 1, dtype=torch.long, device=dev),
                                              positions=torch.full((b, 1), longest - 1, device=dev),
                                              attention=attn, kv_len=n * P)
            self.model.logits(hidden[:, 0])
