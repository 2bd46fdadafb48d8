"""`Engine`: paged KV cache + continuous batching + block top-k sparse decode, over our decoder.

    engine = Engine(model, sparsity=Schedule(...) | 512 | None, max_batch=16)
    results = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=1024, temperature=1.0))

One engine step is either a prefill (new prompts, dense, padded into one batch, and preempted samples
being recomputed) or a decode step (one token for every running sample). The n samples of a prompt
share one prefill: its pages are shared through the block tables (reference counted) and a sample
copies the partial last page when it first writes to it. Pages are allocated as sequences grow and a
full pool preempts the latest admitted sample, which is recomputed later with the keys, values,
centroids and page selections it had (up to float rounding; scheduler.py), so its tokens stay the same.
Each decode step uses, per sample, the budget of the sparsity schedule at the cache length at which
the token is produced (`budget_at(num_tokens)`, query at position num_tokens - 1), so the rollout's
logprobs are exactly those teacher-forced sparse scoring gives (`stages.mismatch.score_sequences`).
On a CPU the kernels are the C++ ops of kernels/cpu_attention.py where they build, else their batched
torch references (fp32 or bf16 weights and cache), the dense attention of samples sharing a prompt is
cascaded (the prompt's pages read once per step, kernels/cascade_decode.py), the linears run on
prepacked weights (our C++ product in bf16 and fp32, oneDNN's otherwise; packed_linears.py) and the
norms and rotary embedding as C++ ops (cpu_layers.py); with our product, a decode layer is two C++ ops
around the attention (cpu_decode.py); on CUDA the Triton kernels, and the decode step is
replayed from CUDA graphs over static buffers (static_decode.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from sparrow.kernels import cpu_attention
from sparrow.kernels.cascade_decode import suffix_pages
from sparrow.kernels.ops import GatherWorkspace, use_triton

from ..attention import DEFAULT_DENSE_LAYERS, PAGE_SIZE
from ..model.llama import Transformer
from ..sparsity import Sparsity, budget_fn
from .allocator import tune_cpu_allocator
from .attention import Cascade, DecodeAttention, PrefillAttention, Recompute
from .block_manager import BlockManager
from .cpu_decode import FusedCpuDecode
from .cpu_layers import CpuLayerOps, cpu_layers_available
from .kv_cache import PagedKVCache, SharedPrefix
from .packed_linears import PackedLinears, packing_available
from .sampler import sample_tokens
from .scheduler import Scheduler, pages_needed, prefill_tokens
from .sequence import Completion, Request, SamplingParams, Sequence
from .static_decode import StaticDecode, kept_pages

DECODE_GRAPHS = ("auto", "cuda", "eager", "off")


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    budget_sum: int = 0  # over decode tokens, dense counted as 0
    preemptions: int = 0
    recomputed_tokens: int = 0  # prefilled again after a preemption
    max_running: int = 0  # the largest decode batch
    prefill_s: float = 0.0
    decode_s: float = 0.0
    step_times: list[float] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s


class Engine:
    def __init__(self, model: Transformer, sparsity: Sparsity = None, *, max_batch: int = 16,
                 num_pages: int | None = None, page_size: int = PAGE_SIZE,
                 dense_layers: Seq[int] = DEFAULT_DENSE_LAYERS, eos_ids: Seq[int] | None = None,
                 max_prefill_tokens: int = 8192, impl: str = "auto", decode_graphs: str = "auto",
                 cascade: bool | None = None):
        """`num_pages`: size of the KV page pool (None: sized from the first requests for every sample
        at full length, so nothing is preempted; smaller pools preempt when they fill up).
        `decode_graphs`: "auto" (CUDA graphs on CUDA, the plain step on a CPU), "cuda" (CUDA graphs),
        "eager" (the graphs' static padded step without capture, any device) or "off".
        `cascade`: dense decode attention reads a prompt's shared pages once per step for all its
        samples, from a contiguous copy taken at prefill into pool pages (None: on the torch path,
        i.e. the CPU)."""
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if decode_graphs not in DECODE_GRAPHS:
            raise ValueError(f"decode_graphs must be one of {DECODE_GRAPHS}, got {decode_graphs!r}")
        self.model, self.cfg = model, model.cfg
        self.device = model.embed_tokens.weight.device
        if self.device.type == "cpu":
            tune_cpu_allocator()
        self.dtype = model.embed_tokens.weight.dtype
        self.page_size, self.dense_layers, self.impl = page_size, tuple(dense_layers), impl
        self.budget_at = budget_fn(sparsity, page_size)
        self.eos_ids = frozenset(self.cfg.eos_token_ids if eos_ids is None else eos_ids)
        self.max_batch, self.max_prefill_tokens = max_batch, max_prefill_tokens
        self.scale = 1.0 / math.sqrt(self.cfg.head_dim)
        self.num_pages = num_pages
        if decode_graphs == "auto":
            decode_graphs = "cuda" if self.device.type == "cuda" else "off"
        if decode_graphs == "cuda" and self.device.type != "cuda":
            raise ValueError("decode_graphs='cuda' needs the model on a CUDA device")
        self.decode_graphs = decode_graphs
        self.static: StaticDecode | None = None
        self.workspace = GatherWorkspace()  # the CPU path's K/V gather buffers, reused every step
        on_torch = not use_triton(impl, model.embed_tokens.weight)
        if cascade and not on_torch:
            raise ValueError("cascade attention runs on the torch path (the CPU), not the Triton kernels")
        self.cascade = on_torch if cascade is None else cascade
        self.prefixes: dict[int, SharedPrefix] = {}  # request id -> its shared prompt pages' K/V
        self._unfinished: dict[int, int] = {}  # request id -> samples not finished (while it has a prefix)
        own = impl == "auto"  # impl="torch": no C++ kernel anywhere in the step
        self.packed = PackedLinears(model, max_batch, own) if on_torch and packing_available(model) else None
        self.layer_ops = CpuLayerOps(model) if own and cpu_layers_available(model) else None
        self.fused = FusedCpuDecode(model, self.packed) if (
            self.packed is not None and self.packed.dot and self.layer_ops is not None
            and isinstance(model, Transformer)) else None
        self.cache: PagedKVCache | None = None
        self.scheduler: Scheduler | None = None
        self.stats = EngineStats()
        self._next_id = 0
        self._pending: list[Request] = []

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt: Seq[int], params: SamplingParams, request_id: int | None = None,
                    sparsity: Sparsity = "engine") -> int:
        """Queue a prompt (token ids) for `params.n` samples; `sparsity` overrides the engine's."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("every prompt needs at least one token")
        if len(prompt) + params.max_new_tokens > self.cfg.max_position_embeddings:
            raise ValueError(f"a prompt of {len(prompt)} tokens with max_new_tokens "
                             f"{params.max_new_tokens} exceeds the model's context of "
                             f"{self.cfg.max_position_embeddings}")
        if self.num_pages is not None:
            self._check_fits(len(prompt), params.max_new_tokens)
        rid = self._next_id if request_id is None else request_id
        self._next_id = max(self._next_id, rid + 1)
        fn = self.budget_at if sparsity == "engine" else budget_fn(sparsity, self.page_size)
        req = Request(rid, prompt, params, fn, frozenset() if params.ignore_eos else self.eos_ids)
        if self.scheduler is None:
            self._pending.append(req)
        else:
            self.scheduler.add(req)
        return rid

    def _check_fits(self, prompt_len: int, max_new: int) -> None:
        need = -(-(prompt_len + max_new - 1) // self.page_size)
        if need > self.num_pages:
            raise ValueError(f"a prompt of {prompt_len} tokens with max_new_tokens {max_new} needs {need} "
                             f"KV pages for one sample but the engine's pool has only {self.num_pages}")

    def _default_num_pages(self, reqs: list[Request]) -> int:
        """Room for the largest request's group, or for `max_batch` unshared sequences of the longest
        request when that is more; on CUDA no more than fits in 90% of the free device memory (then
        samples are preempted when the pool fills up), as long as one sample at full length fits."""
        need = [pages_needed(len(r.prompt), r.params.n, r.params.max_new_tokens, self.page_size)
                for r in reqs] or [(0, 1)]
        copy = 2 if self.cascade else 1  # the cascade's copy of the shared pages is in the pool too
        group = max(copy * s + r.params.n * o for r, (s, o) in zip(reqs, need))
        per_seq = max(s + o for s, o in need)
        seqs = sum(r.params.n for r in reqs)
        pages = max(group, min(self.max_batch, max(seqs, 1)) * per_seq)
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            page_bytes = PagedKVCache.bytes_per_page(self.cfg, self.page_size, self.dtype)
            fit = int(0.9 * free) // page_bytes
            if fit < per_seq:
                raise RuntimeError(f"the KV cache needs {per_seq * page_bytes / 2**30:.1f} GiB for one "
                                   f"sample but {free / 2**30:.1f} GiB of device memory are free")
            pages = min(pages, fit)
        return pages

    def _start(self) -> None:
        reqs = self._pending
        if self.num_pages is None:
            self.num_pages = self._default_num_pages(reqs)
        self.cache = PagedKVCache(self.cfg, self.num_pages, self.page_size, self.dtype, self.device)
        self.blocks = BlockManager(self.num_pages, self.page_size)
        self.scheduler = Scheduler(self.blocks, self.max_batch, self.max_prefill_tokens,
                                   self.cache.copy_pages, self._reclaim_prefix)
        for r in reqs:
            self.scheduler.add(r)
        if self.decode_graphs != "off":
            longest = max((len(r.prompt) + r.params.max_new_tokens for r in reqs), default=1)
            self.static = StaticDecode(self.model, self.cache, max_batch=self.max_batch,
                                       max_pages=self.blocks.pages_for(longest),
                                       dense_layers=self.dense_layers, scale=self.scale, impl=self.impl,
                                       capture=self.decode_graphs == "cuda", workspace=self.workspace)
        self._pending = []

    def has_work(self) -> bool:
        return bool(self._pending) or (self.scheduler is not None and self.scheduler.has_work())

    # ------------------------------------------------------------------ the loop

    @torch.inference_mode()
    def step(self) -> tuple[list[Completion], int]:
        """Run one prefill or decode step; returns (samples finished in it, tokens generated)."""
        if self.scheduler is None:
            self._start()
        kind, batch = self.scheduler.schedule()
        t0 = time.perf_counter()
        if kind == "prefill":
            seqs = self._prefill(batch)
            new = len(seqs)
        else:
            seqs = batch
            new = self._decode(batch) if batch else 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        if kind == "prefill":
            self.stats.prefill_s += dt
        else:
            self.stats.decode_s += dt
            self.stats.step_times.append(dt)
            self.stats.max_running = max(self.stats.max_running, len(batch))
        self.stats.preemptions = self.scheduler.preemptions
        self.stats.generated_tokens += new
        done = []
        for s in seqs:
            if s.finish_reason is not None:
                self.scheduler.finish(s)
                self._release_prefix(s.request.request_id)
                done.append(s.completion())
        return done, new

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams],
                 on_step: Callable[[int, int], None] | None = None,
                 request_ids: Seq[int] | None = None) -> list[list[Completion]]:
        """All samples of every prompt, in prompt order then sample order. `on_step(new_tokens,
        finished_samples)` is called after every engine step. `request_ids` (default: consecutive)
        name the prompts in the per-sample seeds, so a shard of a prompt set given its global prompt
        indices samples exactly what the whole set run in one engine samples for those prompts."""
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        base = self._next_id
        if request_ids is None:
            request_ids = [base + i for i in range(len(prompts))]
        if len(request_ids) != len(prompts) or len(set(request_ids)) != len(request_ids):
            raise ValueError("request_ids must name every prompt once")
        ids = [self.add_request(p, sp, rid) for p, sp, rid in zip(prompts, params, request_ids)]
        out: dict[int, list[Completion]] = {i: [] for i in ids}
        while self.has_work():
            done, new = self.step()
            for c in done:
                if c.request_id in out:
                    out[c.request_id].append(c)
            if on_step is not None:
                on_step(new, len(done))
        return [sorted(out[i], key=lambda c: c.sample) for i in ids]

    # ------------------------------------------------------------------ prefill

    def _generator(self, req: Request, sample: int) -> torch.Generator | None:
        if req.params.temperature <= 0:
            return None
        seed = int(np.random.SeedSequence([req.params.seed, req.request_id, sample]).generate_state(1)[0])
        return torch.Generator(device=self.device).manual_seed(seed)

    def _prefill(self, batch: list[Request | Sequence]) -> list[Sequence]:
        """Prefill new requests (their samples then share the prompt's pages and sample their first
        token) and recompute preempted samples (no sampling: their last token is fed next)."""
        P, blocks, dev = self.page_size, self.blocks, self.device
        rows = [prefill_tokens(x) for x in batch]
        plens = [len(x.prompt if isinstance(x, Request) else x.request.prompt) for x in batch]
        lens = [len(r) for r in rows]
        t_max = max(lens)
        pages = [[blocks.allocate() for _ in range(blocks.pages_for(n))] for n in lens]
        tokens = torch.zeros(len(batch), t_max, dtype=torch.long)
        table = np.zeros((len(batch), blocks.pages_for(t_max)), dtype=np.int64)
        for i, r in enumerate(rows):
            tokens[i, : lens[i]] = torch.tensor(r)
            table[i, : len(pages[i])] = pages[i]
        pos = np.arange(t_max)
        slot = table[:, pos // P] * P + pos % P  # [G, T]
        prompt = pos[None] < np.asarray(plens)[:, None]
        attn = PrefillAttention(self.cache, torch.from_numpy(prompt).to(dev),
                                torch.from_numpy(slot[prompt]).to(dev), self.impl,
                                self._recompute(batch, lens, plens, slot, table),
                                self._new_prefixes(batch, pages, plens))
        positions = torch.arange(t_max, device=dev).expand(len(batch), t_max)
        hidden = self.model.hidden_states(tokens.to(dev), positions=positions, attention=attn)
        self.stats.prefill_tokens += sum(lens)
        self.stats.recomputed_tokens += sum(n for x, n in zip(batch, lens) if isinstance(x, Sequence))

        fresh = [i for i, x in enumerate(batch) if isinstance(x, Request)]
        seqs: list[Sequence] = []
        for i in fresh:
            r = batch[i]
            for s in range(r.params.n):
                seq = Sequence(r, s, self._generator(r, s))
                seq.pages = [blocks.share(p) if s else p for p in pages[i]]
                seqs.append(seq)
        if seqs:
            last = hidden[torch.tensor(fresh, device=dev), torch.tensor([lens[i] - 1 for i in fresh],
                                                                        device=dev)]
            logits = self.model.logits(last)  # [fresh, V] fp32
            owner = torch.tensor([j for j, i in enumerate(fresh) for _ in range(batch[i].params.n)],
                                 device=dev)
            self._sample(seqs, logits[owner], [0] * len(seqs))
        again = [x for x in batch if isinstance(x, Sequence)]
        for seq, p in zip(again, (pages[i] for i, x in enumerate(batch) if isinstance(x, Sequence))):
            seq.pages = p
        self.scheduler.admit_prefilled(again + [s for s in seqs if s.finish_reason is None])
        return seqs

    def _new_prefixes(self, batch: list[Request | Sequence], pages: list[list[int]],
                      plens: list[int]) -> list[tuple[int, SharedPrefix]]:
        """Stores for the full prompt pages of the fresh requests in this prefill (cascade attention)."""
        if not self.cascade:
            return []
        out, P = [], self.page_size
        for i, x in enumerate(batch):
            m = plens[i] // P
            # the copy takes m pool pages in a row; only while that leaves each sample a page to grow
            # into (under pressure later, `_reclaim_prefix` gives them back before anyone is preempted)
            if not isinstance(x, Request) or m == 0 or self.blocks.num_free - m < x.params.n:
                continue
            run = self.blocks.allocate_run(m)
            if run is not None:
                prefix = SharedPrefix.in_pool(self.cache, pages[i][:m], run, self._pack_prefixes())
                self.prefixes[x.request_id] = prefix
                self._unfinished[x.request_id] = x.params.n
                out.append((i, prefix))
        return out

    def _pack_prefixes(self) -> bool:
        """Prefix copies in the AVX512-BF16 kernel's layouts: bf16 on a CPU that runs the kernel."""
        return (cpu_attention.supports(self.cfg.head_dim, self.page_size, self.dtype)
                and cpu_attention.available())

    def _release_prefix(self, request_id: int) -> None:
        if request_id in self._unfinished:
            self._unfinished[request_id] -= 1
            if self._unfinished[request_id] == 0:
                self._drop_prefix(request_id)

    def _drop_prefix(self, request_id: int) -> None:
        del self._unfinished[request_id]
        self.blocks.free_pages(list(self.prefixes.pop(request_id).run))

    def _reclaim_prefix(self) -> bool:
        """Give the newest prefix copy's pages back to the pool (its samples decode without cascade
        from then on, reading the same keys from their own block tables); False if there is none."""
        if not self.prefixes:
            return False
        self._drop_prefix(next(reversed(self.prefixes)))
        return True

    def _cascade(self, seqs: list[Sequence]) -> Cascade | None:
        """Group the decode batch's samples by the shared prompt pages their block tables start with."""
        if not self.prefixes:
            return None
        groups: dict[int, list[int]] = {}
        first = [0] * len(seqs)
        for i, s in enumerate(seqs):
            prefix = self.prefixes.get(s.request.request_id)
            if prefix is not None and tuple(s.pages[: len(prefix.pages)]) == prefix.pages:
                groups.setdefault(s.request.request_id, []).append(i)
                first[i] = len(prefix.pages)
        if not groups:
            return None
        dev = self.device
        return Cascade([(torch.tensor(rows, device=dev), self.prefixes[rid]) for rid, rows in groups.items()],
                       suffix_pages(first, [len(s.pages) for s in seqs], self.cfg.num_kv_heads, dev))

    def _recompute(self, batch: list[Request | Sequence], lens: list[int], plens: list[int],
                   slot: np.ndarray, table: np.ndarray) -> Recompute | None:
        """The generated positions of recomputed rows: their writes in page-offset order and the
        budgets their decode steps had (`Sequence.budgets[j + 1]` for the token fed at plen + j)."""
        if all(isinstance(x, Request) for x in batch):
            return None
        dev, P = self.device, self.page_size
        budgets = np.zeros(slot.shape, dtype=np.int64)
        gen_rows, gen_cols = [], []
        for i, x in enumerate(batch):
            if isinstance(x, Sequence):
                budgets[i, plens[i]: lens[i]] = x.budgets[1: len(x.tokens)]
                gen_rows.append(np.full(lens[i] - plens[i], i))
                gen_cols.append(np.arange(plens[i], lens[i]))
        rows, cols = np.concatenate(gen_rows), np.concatenate(gen_cols)
        appended = []
        for off in range(P):
            at = cols % P == off
            if at.any():
                appended.append((torch.from_numpy(rows[at]).to(dev), torch.from_numpy(cols[at]).to(dev),
                                 torch.from_numpy(slot[rows[at], cols[at]]).to(dev)))
        positions = torch.arange(slot.shape[1], device=dev).expand(*slot.shape)
        sparse = torch.from_numpy(budgets).to(dev) if budgets.any() else None
        return Recompute(appended, sparse, positions, torch.from_numpy(table).to(dev),
                         frozenset(self.dense_layers))

    # ------------------------------------------------------------------ decode

    def _decode(self, seqs: list[Sequence]) -> int:
        P = self.page_size
        pos, slots, budgets = [], [], []
        for s in seqs:
            p = s.num_tokens - 1  # the last sampled token: its k/v go to its page, given by the scheduler
            pos.append(p)
            slots.append(s.pages[p // P] * P + p % P)
            budgets.append(s.budget_now())
        width = max(len(s.pages) for s in seqs)
        table = np.full((len(seqs), width), -1, dtype=np.int32)
        for i, s in enumerate(seqs):
            table[i, : len(s.pages)] = s.pages
        tokens = [s.tokens[-1] for s in seqs]
        if self.static is not None and self.static.fits(len(seqs), width):
            logits = self.static.run(tokens, pos, table, budgets, slots)
        else:
            logits = self._decode_eager(tokens, pos, table, budgets, slots, self._cascade(seqs))
        self._sample(seqs, logits, budgets)
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(seqs)
        self.stats.budget_sum += sum(budgets)
        return len(seqs)

    def _decode_eager(self, tokens: list[int], pos: list[int], table: np.ndarray, budgets: list[int],
                      slots: list[int], cascade: Cascade | None = None) -> torch.Tensor:
        """The decode step at this batch's own shapes -> logits [B, V] float32."""
        dev = self.device
        positions = torch.tensor(pos, device=dev)
        attn = DecodeAttention(
            self.cache, torch.from_numpy(table).to(dev), (positions + 1).to(torch.int32),
            torch.tensor(budgets, dtype=torch.int32, device=dev),
            torch.tensor(slots, dtype=torch.int64, device=dev),
            self.dense_layers, self.scale, self.impl, any_sparse=any(b > 0 for b in budgets),
            max_selected=kept_pages(budgets, self.page_size, table.shape[1]) if dev.type == "cuda" else None,
            workspace=self.workspace, cascade=cascade)
        if self.fused is not None and self.fused.ready():
            return self.fused.logits(tokens, pos, attn)
        with (self.packed.active() if self.packed is not None else nullcontext(),
              self.layer_ops.active() if self.layer_ops is not None else nullcontext()):
            hidden = self.model.hidden_states(torch.tensor(tokens, device=dev)[:, None],
                                              positions=positions[:, None], attention=attn)
            return self.model.logits(hidden[:, 0])

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, budgets: list[int]) -> None:
        k = max(s.request.params.logprobs for s in seqs)
        tokens, logps, top = sample_tokens(logits, [s.request.params for s in seqs],
                                           [s.generator for s in seqs], k)
        tokens, logps = tokens.tolist(), logps.tolist()
        for i, s in enumerate(seqs):
            s.tokens.append(tokens[i])
            s.logprobs.append(logps[i])
            s.budgets.append(budgets[i])
            n = s.request.params.logprobs
            if n:
                s.top_logprobs = s.top_logprobs or []
                s.top_logprobs.append(list(zip(top[1][i, :n].tolist(), top[0][i, :n].tolist())))
            if tokens[i] in s.request.eos_ids:
                s.finish_reason = "stop"
            elif len(s.tokens) >= s.request.params.max_new_tokens:
                s.finish_reason = "length"
