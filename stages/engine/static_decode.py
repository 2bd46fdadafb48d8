"""`StaticDecode`: a decode step over state that lives on the device, replayed from CUDA graphs.

The samples' state (next token, position, cache length, block table row, budget, temperature, seed) stays
in device buffers sized for the largest batch and block table; a step of B samples runs the graph of the
smallest batch bucket >= B (padding rows write nothing), keyed also by whether the sparse layers select
and how many pages they keep. The step samples on the device (sampler.py) and advances the state; the
host sends only what changed and reads each step's tokens from pinned memory a step later (`collect`).
Nothing inside the step waits on the device. With `capture=False` the same step runs eagerly on any
device, which is how the CPU tests hold it to teacher-forced scoring.

A speculative cycle's dense verification runs on the same buffers and graph pool (`score`): each fed
token is a row, a dense decode query at its position whose cache ends there, so rows of one sample read
the keys that the rows before them wrote in the same layer. It samples nothing and advances nothing.

A cycle's drafts may share one selection (`Select`): the first draft step keeps each sparse layer's pages
and the page its row moves into next, the later ones attend to those without scoring a page (the part of
a sparse step that reads every page's centroid and selects among them). A draft's distribution is then not
the lossy sampler's at that position, which speculation allows: the verification keeps the dense law
whatever drafted.
"""

from __future__ import annotations

import enum
import functools
import weakref
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from sparrow.kernels.ops import TORCH, TorchOps

from ..attention.kv_cache import PagedKVCache, pinned_copies, upload
from ..attention.paged import DecodeAttention, DecodeBatch, KeptPages
from ..model.llama import Transformer
from .sampler import redraw_truncated, sample_on_device
from .sequence import Sequence as Sample


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes with a graph of their own: 1, 2, 4, 8, then every 16, and max_batch."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch, 16)) + [max_batch]


def kept_pages(budgets: Collection[int], page_size: int, max_pages: int) -> int:
    """K of the graph for these budgets: 0 = no selection (all dense), else the selected width."""
    if max(budgets) == 0:
        return 0
    if min(budgets) == 0:
        return max_pages  # a dense request in a sparse step keeps all of its pages
    return min(max(budgets) // page_size, max_pages)


SCORE = -1  # the K of a scoring step's graph (`StaticDecode.score`)


class Select(enum.Enum):
    """Where a sparse step's pages come from: its own selection (EVERY); its own, kept for the steps after
    it (KEEP); the pages the last KEEP step kept (REUSE: the same rows at the same budgets, else the step
    selects and keeps anew)."""

    EVERY = "every"
    KEEP = "keep"
    REUSE = "reuse"

_CAPTURED: weakref.WeakSet = weakref.WeakSet()  # the steps that hold captured graphs


def graphs_alive() -> bool:
    """Whether some step still holds captured graphs (whose cuBLAS calls may use a workspace that must
    then stay allocated)."""
    return any(step.graphs for step in list(_CAPTURED))


def release_device_memory() -> None:
    """Give back what a closed or dropped engine leaves cached: the allocator's free blocks and, once no
    step holds captured graphs (a graph replays its cuBLAS calls with the workspace they were captured
    with), cuBLAS's per-stream workspaces, allocated again at the next matmul."""
    if torch.cuda.is_current_stream_capturing():  # a collection during another step's capture: later
        return
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None and not graphs_alive():
        torch.cuda.synchronize()
        clear_workspaces()
    torch.cuda.empty_cache()


@functools.cache
def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream on which every engine's graphs warm up and are captured. cuBLAS keeps a
    workspace for each stream it has run on until the process ends: a new stream per capture would leave
    one behind per engine."""
    return torch.cuda.Stream(device)


@dataclass
class StepOutput:
    """What one decode step sampled, on the host: per row of `seqs`, the token and its logprob; `top`
    (values, ids) [B, k] CPU tensors when some sample asked for top logprobs."""

    seqs: list[Sample]
    tokens: list[int]
    logprobs: list[float]
    top: tuple[Tensor, Tensor] | None = None


@dataclass
class _Launched:
    seqs: list[Sample]
    tokens: Tensor  # host buffers the step's results are copied into
    logprobs: Tensor
    top: tuple[Tensor, Tensor] | None
    event: torch.cuda.Event | None


class StaticDecode:
    RING = 3  # host output buffers: the step in flight, the one being read, one spare

    def __init__(self, model: Transformer, cache: PagedKVCache, *, max_batch: int, max_pages: int,
                 attention: Callable[[DecodeBatch], DecodeAttention], capture: bool = True,
                 ops: TorchOps = TORCH,
                 hidden: Callable[[Tensor, Tensor, DecodeAttention, int], Tensor] | None = None,
                 score_queries: int = 1):
        """`max_pages`: block table width, enough for the longest sequence the engine will decode.
        `attention`: the runner's decode attention for a batch of static buffers (a plain function or
        partial, never a bound method of the runner, which holds this object). `ops`: the kernels of the
        sampler's race (kernels/race_sample.py). `hidden`: (tokens, positions, attention, kv_len) -> final
        hidden states [n, hidden], the runner's decode form (the GPU's fused layers); None: the model's
        forward. `score_queries`: the most fed tokens a sample verifies at once (K + 1 under speculation)."""
        if capture and cache.k.device.type != "cuda":
            raise ValueError("CUDA graphs need the model and cache on a CUDA device")
        dev = cache.k.device
        self.model, self.cache, self.capture, self.ops = model, cache, capture, ops
        self.device = dev
        self.max_pages, self.page_size = max_pages, cache.page_size
        self.attention, self.hidden, self.score_queries = attention, hidden, score_queries
        self.buckets = batch_buckets(max_batch)
        # a scoring step holds every running sample's fed tokens at once: one read of the weights
        self.score_buckets = batch_buckets(max_batch * score_queries)
        rows = self.score_buckets[-1]
        # the samples' state, one row each
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=dev)  # fed next
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=dev)  # of the token fed next
        self.cache_lens = torch.zeros(rows, dtype=torch.int32, device=dev)  # KV entries after its write
        self.block_table = torch.full((rows, max_pages), -1, dtype=torch.int32, device=dev)
        self.budgets = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.temperatures = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.seeds = torch.zeros(rows, dtype=torch.long, device=dev)
        # computed by the step
        self.slots = torch.full((rows,), -1, dtype=torch.int64, device=dev)
        self.logp = torch.zeros(rows, model.cfg.vocab_size, dtype=torch.float32, device=dev)
        self.sampled = torch.zeros(rows, dtype=torch.long, device=dev)
        self.sampled_logp = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.groups = torch.zeros(rows + 1, dtype=torch.int32, device=dev)  # a scoring step's (`score`)
        # eviction (compaction.py): each row's slot in the pool's query ring (its first row, -1: the trash
        # row, for padding and samples that evict nothing) and its window; the step writes its query at
        # base + position mod window
        self.trash = cache.queries.shape[1] - 1 if cache.queries is not None else None
        self.ring_base = self.ring_window = None
        if self.trash is not None:
            self.ring_base = torch.full((rows,), -1, dtype=torch.long, device=dev)
            self.ring_window = torch.ones(rows, dtype=torch.long, device=dev)
        self.graphs: dict[tuple[int, int, Select], torch.cuda.CUDAGraph] = {}
        self.kept: dict[int, Tensor] = {}  # K -> the pages a KEEP step of width K kept [L, rows, Hkv, K + 1]
        # the width and the rows' budgets of the last KEEP step, while its rows stay
        self._kept_for: tuple[int, list[int]] | None = None
        self.pool = None
        # the host's view: which sample each row holds and what of its block table the device has
        self.rows: list[Sample] = []
        self._sent: list[tuple[int, int, int, int]] = []  # per row: (pages sent, last page sent,
        # preemptions, compactions)
        self._budgets: list[int] | None = None
        pin = dev.type == "cuda"
        self._ring = [(torch.zeros(max_batch, dtype=torch.long, pin_memory=pin),
                       torch.zeros(max_batch, dtype=torch.float32, pin_memory=pin)) for _ in range(self.RING)]
        self._next = 0
        self._in_flight: deque[_Launched] = deque()

    def fits(self, batch: int, width: int) -> bool:
        return batch <= self.buckets[-1] and width <= self.max_pages

    def in_flight(self) -> int:
        """Steps launched whose results were not collected yet."""
        return len(self._in_flight)

    def forget_rows(self) -> None:
        """The device rows no longer hold the samples' state (a step ran elsewhere): the next step
        uploads every row. Only with nothing in flight."""
        assert not self._in_flight
        self.rows, self._sent, self._budgets, self._kept_for = [], [], None, None

    # ------------------------------------------------------------------ a step

    def launch(self, seqs: list[Sample], budgets: list[int], rings: list[int] | None = None,
               select: Select = Select.EVERY) -> None:
        """Queue one decode step of these samples at these budgets (no host sync); its results come
        back from `collect`. A sample that joins the batch must have its last token on the host.
        `rings`: with a query ring, each sample's slot in it (its first row, -1: none), from
        `compaction.QueryWindows.bases`. `select`: where the sparse layers' pages come from."""
        b = len(seqs)
        n = next(s for s in self.buckets if s >= b)
        k = kept_pages(budgets, self.page_size, self.max_pages)
        moved = self._sync_rows(seqs, rings)
        if moved or budgets != self._budgets:
            self.budgets[:b].copy_(self._upload(budgets, torch.int32))
            self.budgets[b:] = 0
            self._budgets = list(budgets)
        select = self._select(select, k, budgets)
        graph = self._graph(n, k, select) if self.capture else None
        if graph is None:
            self._step(n, k, select)
        else:
            graph.replay()
        self._after_step(seqs)
        tokens, logprobs = self._ring[self._next % self.RING]
        self._next += 1
        assert len(self._in_flight) < self.RING - 1, "collect() the steps in flight first"
        tokens[:b].copy_(self.sampled[:b], non_blocking=True)
        logprobs[:b].copy_(self.sampled_logp[:b], non_blocking=True)
        top = self._top_logprobs(seqs)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._in_flight.append(_Launched(seqs, tokens, logprobs, top, event))

    def collect(self) -> StepOutput:
        """The oldest step in flight's results (waits for that step only)."""
        step = self._in_flight.popleft()
        if step.event is not None:
            step.event.synchronize()
        b = len(step.seqs)
        return StepOutput(step.seqs, step.tokens[:b].tolist(), step.logprobs[:b].tolist(),
                          step.top)

    def _upload(self, values, dtype: torch.dtype) -> Tensor:
        return upload(self.device, values, dtype)

    def _select(self, select: Select, k: int, budgets: list[int]) -> Select:
        """`select` where it can run: pages are kept only when every row is sparse (a dense row would keep
        the whole table), and reused only when every row kept its pages at the budget it has now, in a
        step of the same width."""
        if select == Select.EVERY or min(budgets) == 0:
            return Select.EVERY
        if select == Select.REUSE and self._kept_for != (k, budgets):
            select = Select.KEEP
        if select == Select.KEEP:
            self._kept_for = (k, list(budgets))
            self._kept_pages(k)
        return select

    def _move_kept(self, src: list[int | None], perm: Tensor | None) -> None:
        """Rows moved to rows `src` came from (None: a new row): their kept pages move with them, and no
        pages are kept once a new row joins."""
        if self._kept_for is None or None in src:
            self._kept_for = None
            return
        k, budgets = self._kept_for
        self._kept_for = (k, [budgets[j] for j in src])
        if perm is not None:
            self.kept[k][:, : len(src)] = self.kept[k][:, perm]

    def _kept_pages(self, k: int) -> Tensor:
        """The kept pages of width K (allocated at first use, outside any capture)."""
        if k not in self.kept:
            cfg = self.model.cfg
            self.kept[k] = torch.full((cfg.num_layers, self.buckets[-1], cfg.num_kv_heads, k + 1), -1,
                                      dtype=torch.int32, device=self.device)
        return self.kept[k]

    def _sync_rows(self, seqs: list[Sample], rings: list[int] | None = None) -> bool:
        """Make the device rows hold these samples in this order -> whether rows changed. Rows that stay
        are gathered on the device (their state may be a step ahead of the host's); new rows are sent;
        rows whose cache was compacted since they were sent get their cache length and block table again
        (their token and position stay the device's)."""
        b = len(seqs)
        same = len(seqs) == len(self.rows) and all(
            s is r and s.preemptions == sent[2] for s, r, sent in zip(seqs, self.rows, self._sent))
        if same:
            self._send_compacted(seqs)
            self._send_new_pages(seqs)
            return False
        where = {id(s): i for i, s in enumerate(self.rows)}
        src, fresh = [], []
        for i, s in enumerate(seqs):
            j = where.get(id(s))
            if j is not None and self._sent[j][2] != s.preemptions:
                j = None  # preempted and recomputed since: new pages, new state
            src.append(j)
            if j is None:
                fresh.append(i)
        perm = None
        if any(j is not None and j != i for i, j in enumerate(src)):
            perm = self._upload([i if j is None else j for i, j in enumerate(src)], torch.long)
            for buf in (self.tokens, self.positions, self.cache_lens, self.block_table, self.temperatures,
                        self.seeds, self.ring_base, self.ring_window):
                if buf is not None:
                    buf[:b] = buf[perm]
        self._move_kept(src, perm)
        sent = [self._sent[j] if j is not None else None for j in src]
        if fresh:
            self._send_rows(seqs, fresh)
            for i in fresh:
                s = seqs[i]
                sent[i] = (len(s.pages), s.pages[-1], s.preemptions, s.compactions)
            if self.ring_base is not None:
                idx = self._upload(fresh, torch.long)
                self.ring_base[idx] = self._upload([rings[i] for i in fresh], torch.long)
                self.ring_window[idx] = self._upload([max(seqs[i].policy.window, 1) for i in fresh],
                                                     torch.long)
        self.tokens[b:] = 0
        self.positions[b:] = 0
        self.cache_lens[b:] = 0  # padding: no write, no attention
        if self.ring_base is not None:
            self.ring_base[b:] = -1
        self.rows, self._sent = list(seqs), sent
        self._send_compacted(seqs)
        self._send_new_pages(seqs)
        return True

    def _send_compacted(self, seqs: list[Sample]) -> None:
        """Rows whose cache was compacted since they were sent (compaction.py: fewer tokens, other pages):
        their cache length and whole block table row again, the rest of their state left as it is."""
        rows = [i for i, s in enumerate(seqs) if s.compactions != self._sent[i][3]]
        if not rows:
            return
        table = np.full((len(rows), self.max_pages), -1, dtype=np.int32)
        for j, i in enumerate(rows):
            s = seqs[i]
            table[j, : len(s.pages)] = s.pages
            self._sent[i] = (len(s.pages), s.pages[-1], s.preemptions, s.compactions)
        idx = self._upload(rows, torch.long)
        self.cache_lens[idx] = self._upload([seqs[i].cached + 1 for i in rows], torch.int32)
        self.block_table[idx] = self._upload(table, torch.int32)

    def _send_rows(self, seqs: list[Sample], rows: list[int]) -> None:
        """Upload the whole state of these rows from their samples (each with its last token read back)."""
        ints = np.zeros((len(rows), 4), dtype=np.int64)
        table = np.full((len(rows), self.max_pages), -1, dtype=np.int32)
        temps = np.zeros(len(rows), dtype=np.float32)
        for j, i in enumerate(rows):
            s = seqs[i]
            assert s.pending == 0, "a sample joins the device batch with its tokens read back"
            position = s.position  # of its last token, which it feeds next
            ints[j] = (s.tokens[-1], position, s.cached + 1, s.seed)  # the cache with the fed token
            table[j, : len(s.pages)] = s.pages
            temps[j] = s.request.params.temperature
        idx = self._upload(rows, torch.long)
        ints_d = self._upload(ints, torch.long)
        self.tokens[idx, 0] = ints_d[:, 0]
        self.positions[idx, 0] = ints_d[:, 1]
        self.cache_lens[idx] = ints_d[:, 2].int()
        self.seeds[idx] = ints_d[:, 3]
        self.temperatures[idx] = self._upload(temps, torch.float32)
        self.block_table[idx] = self._upload(table, torch.int32)

    def _send_new_pages(self, seqs: Sequence[Sample]) -> None:
        """Pages added to rows since they were sent (and a last page replaced by copy on write), in one
        scatter."""
        updates = []
        for i, s in enumerate(seqs):
            count, last, preempted, compactions = self._sent[i]
            pages = s.pages
            if len(pages) == count and pages[-1] == last:
                continue
            assert len(pages) >= count, "a row whose pages shrank must be sent again (forget_rows)"
            if pages[count - 1] != last:
                updates.append((i, count - 1, pages[count - 1]))
            updates += [(i, j, pages[j]) for j in range(count, len(pages))]
            self._sent[i] = (len(pages), pages[-1], preempted, compactions)
        if updates:
            u = self._upload(np.asarray(updates, dtype=np.int64).T, torch.long)
            self.block_table[u[0], u[1]] = u[2].int()

    # ------------------------------------------------------------------ scoring

    def score(self, fed: list[list[int]], starts: list[int], tables: list[list[int]],
              temperatures: list[float]) -> Tensor:
        """Dense scoring (a speculative cycle's verification), in one step: sample i feeds fed[i] at
        positions starts[i] on, through its block table tables[i]; each fed token is a row that writes its
        key and value and attends densely to its cache up to its own position, the rows of one sample in
        one group whose pages are read once (`DecodeBatch.groups`) -> log_softmax(logits / T) [all fed
        tokens, V] float32 (T = 1 for a greedy sample), sample after sample. The rows overwrite the
        samples' state: the next launch uploads it again."""
        assert not self._in_flight, "collect() the steps in flight first"
        assert max(map(len, fed)) <= self.score_queries, "more fed tokens than a scoring group holds"
        assert len(fed) <= self.buckets[-1], "more samples than a step holds"
        self.forget_rows()  # and no kept pages: the scoring rows write nothing there, but move the rows
        m = sum(map(len, fed))
        n = next(s for s in self.score_buckets if s >= m)
        self._send_scoring(n, fed, starts, tables, temperatures)
        graph = self._graph(n, SCORE, Select.EVERY) if self.capture else None
        if graph is None:
            self._score(n)
        else:
            graph.replay()
        return self.logp[:m].clone()

    def _send_scoring(self, n: int, fed: list[list[int]], starts: list[int], tables: list[list[int]],
                      temperatures: list[float]) -> None:
        counts = np.array([len(f) for f in fed])
        m, firsts = int(counts.sum()), np.cumsum(counts) - counts
        sample = np.repeat(np.arange(len(fed)), counts)  # each row's sample
        width = max(map(len, tables))
        per_sample = np.full((len(fed), width), -1, dtype=np.int32)
        for i, t in enumerate(tables):
            per_sample[i, : len(t)] = t
        ints = np.zeros((3, n), dtype=np.int64)  # padding rows: token 0 at 0, cache 0 (no write, no read)
        ints[0, :m] = np.concatenate(fed)
        ints[1, :m] = np.asarray(starts)[sample] + np.arange(m) - firsts[sample]
        ints[2, :m] = ints[1, :m] + 1
        temps = np.ones(n, dtype=np.float32)
        t = np.asarray(temperatures, dtype=np.float32)[sample]
        temps[:m] = np.where(t > 0, t, 1.0)
        # groups: each sample's rows, then padding rows in groups of their own, then empty groups
        groups = np.full(n + 1, n, dtype=np.int32)
        padding = np.arange(m, n, self.score_queries)
        groups[: len(fed) + len(padding)] = np.concatenate([firsts, padding])
        ints_d = self._upload(ints, torch.long)
        self.tokens[:n, 0], self.positions[:n, 0] = ints_d[0], ints_d[1]
        self.cache_lens[:n] = ints_d[2].int()
        self.block_table[:m, :width] = self._upload(per_sample[sample], torch.int32)
        self.temperatures[:n] = self._upload(temps, torch.float32)
        self.groups[: n + 1] = self._upload(groups, torch.int32)
        self.budgets[:n] = 0
        if self.ring_base is not None:
            self.ring_base[:n] = -1

    def _score(self, n: int) -> None:
        """The scoring step of bucket n: a dense step's logits as log-probs, nothing sampled or advanced."""
        logits = self._forward(n, 0, grouped=True)
        self.logp[:n] = torch.log_softmax(logits / self.temperatures[:n, None], dim=-1)

    # ------------------------------------------------------------------ the step's parts

    def _step(self, n: int, k: int, select: Select = Select.EVERY) -> None:
        """The step of bucket n with K = k: inputs from the state, the model, sampling, the state advanced."""
        logits = self._forward(n, k, select=select)
        cl = self.cache_lens[:n]
        tokens, chosen, _ = sample_on_device(logits, self.temperatures[:n], self.seeds[:n],
                                             self.positions[:n, 0], logp_out=self.logp[:n], ops=self.ops)
        self.sampled[:n] = tokens
        self.sampled_logp[:n] = chosen
        active = cl > 0
        self.tokens[:n, 0] = tokens
        self.positions[:n, 0] += active
        self.cache_lens[:n] += active.int()

    def _forward(self, n: int, k: int, grouped: bool = False, select: Select = Select.EVERY) -> Tensor:
        """The model over rows :n of the state with K = k (each row writes its key at the slot its cache
        length ends on; padding rows, cache length 0, write nothing) -> logits [n, V] float32. `grouped`:
        the rows are queries in `groups` (a scoring step)."""
        P, cl = self.page_size, self.cache_lens[:n]
        at = (cl.long() - 1).clamp(min=0)  # the cache index this step's k/v go to
        page = self.block_table[:n].gather(1, (at // P)[:, None])[:, 0].long()
        self.slots[:n] = torch.where(cl > 0, page * P + at % P, -1)
        queries = None
        if self.ring_base is not None:  # padding rows and samples that evict nothing: the trash row
            base = self.ring_base[:n]
            queries = torch.where((base >= 0) & (cl > 0), base + self.positions[:n, 0] % self.ring_window[:n],
                                  self.trash)
        groups = self.groups[: n + 1] if grouped else None
        kept = None if select == Select.EVERY else KeptPages(self.kept[k][:, :n], store=select == Select.KEEP)
        attn = self.attention(DecodeBatch(self.block_table[:n], cl, self.budgets[:n], self.slots[:n],
                                          any_sparse=k > 0, max_selected=k or None, query_index=queries,
                                          groups=groups, queries_per_group=self.score_queries, kept=kept))
        kv_len = self.max_pages * self.page_size
        if self.hidden is None:
            hidden = self.model.hidden_states(self.tokens[:n], positions=self.positions[:n], attention=attn,
                                              kv_len=kv_len)[:, 0]
        else:  # the runner's decode form (the GPU's fused layers)
            hidden = self.hidden(self.tokens[:n], self.positions[:n], attn, kv_len)
        if select == Select.KEEP:
            self._keep_next_page(kept.pages, cl, self.budgets[:n])
        return self.model.logits(hidden)

    def _keep_next_page(self, pages: Tensor, cache_lens: Tensor, budgets: Tensor) -> None:
        """Each row's next page into the column after its kept pages, in every layer at once, so that the
        drafts that cross into it attend to it (its positions past a step's cache are masked out).
        pages [L, n, Hkv, K + 1]; a sparse row keeps min(its pages, budget / P) pages, sorted, then -1."""
        P, width = self.page_size, pages.shape[3]
        have = (cache_lens.long() + P - 1) // P  # the pages of each row's cache; the next one's index
        kept = torch.minimum(have, budgets.long() // P).clamp(max=width - 1)
        nxt = torch.where((cache_lens > 0) & (have < self.max_pages), have, -1).int()
        pages[..., width - 1] = -1  # the column past a full row: another cycle's next page
        column = pages[..., :1]  # [L, n, Hkv, 1]
        at, page = (x[None, :, None, None].expand_as(column) for x in (kept, nxt))
        pages.scatter_(3, at, page)

    def _after_step(self, seqs: list[Sample]) -> None:
        """Rows with top-k/top-p: drawn again from the step's log-probs over their truncated sets, and
        their next input replaced (device ops after the graph, before the next step)."""
        rows = [i for i, s in enumerate(seqs) if s.request.params.temperature > 0
                and (s.request.params.top_k > 0 or s.request.params.top_p < 1)]
        if not rows:
            return
        r = self._upload(rows, torch.long)
        logp = self.logp[r]
        # the state has advanced: the query that produced these logits sat one position back
        tokens = redraw_truncated(logp, [seqs[i].request.params for i in rows], self.seeds[r],
                                  self.positions[r, 0] - 1, self.ops)
        self.sampled[r] = tokens
        self.sampled_logp[r] = logp.gather(-1, tokens[:, None])[:, 0]
        self.tokens[r, 0] = tokens

    def _top_logprobs(self, seqs: list[Sample]) -> tuple[Tensor, Tensor] | None:
        k = max(s.request.params.logprobs for s in seqs)
        if k == 0:
            return None
        top = self.logp[: len(seqs)].topk(k, dim=-1)
        values, ids = pinned_copies(top.values, top.indices)  # read after the step's event
        return values, ids

    # ------------------------------------------------------------------ graphs

    def prepare(self, batch: int, k: int, select: Select = Select.EVERY) -> None:
        """Capture the graph of `batch` rows with K = k now (run eagerly: run its step once on padding
        rows, which compiles its kernels), so that no later step pays for it. The rows' state is kept."""
        if k == SCORE:  # a scoring step of `batch` samples' full groups
            n = next(s for s in self.score_buckets if s >= batch * self.score_queries)
            if self.capture:
                self._graph(n, k, Select.EVERY)
            return  # eager scoring steps compile with the decode steps' kernels
        n = next(s for s in self.buckets if s >= batch)
        if self.capture:
            if select != Select.EVERY and k > 0:
                self._kept_pages(k)
            self._graph(n, k, select if k > 0 else Select.EVERY)
            return
        state = (self.tokens, self.positions, self.cache_lens)
        saved = [t.clone() for t in state]
        self.cache_lens.zero_()
        self._step(n, k)
        for t, s in zip(state, saved):
            t.copy_(s)

    def _graph(self, n: int, k: int, select: Select) -> torch.cuda.CUDAGraph:
        key = (n, k, select)
        if key not in self.graphs:
            state = (self.tokens, self.positions, self.cache_lens, self.budgets)
            saved = [t.clone() for t in state]
            self.cache_lens.zero_()  # warm-up and capture see only padding rows: they write nothing
            side = capture_stream(self.device)
            side.wait_stream(torch.cuda.current_stream())
            step = functools.partial(self._step, n, k, select)
            run = functools.partial(self._score, n) if k == SCORE else step
            with torch.cuda.stream(side):
                run()  # Triton compiles and cuBLAS sets up outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=side):
                run()
            self.pool = graph.pool()
            self.graphs[key] = graph
            if self not in _CAPTURED:  # a dropped step gives back what its engine's close() would
                _CAPTURED.add(self)
                weakref.finalize(self, release_device_memory).atexit = False
            for t, s in zip(state, saved):
                t.copy_(s)
        return self.graphs[key]

    def drop_graphs(self) -> None:
        """Forget the captured graphs (the weights they read were replaced); the next steps capture anew."""
        self.graphs.clear()
        self.pool = None
