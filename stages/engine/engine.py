"""`Engine`: paged KV cache, continuous batching and block top-k sparse decode (or KV eviction) over our
decoder, after nano-vllm.

    with Engine(model, policy, EngineConfig(max_batch=16)) as engine:
        results = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=1024, temperature=1.0))

The engine keeps requests, the scheduler's queues, the pages and the stats, and knows no device: its
runner (runner.py, cpu/, gpu/) runs the model. The design, what holds bit for bit on which device, and
the pipelined decode loop: docs/engine.md.
"""

from __future__ import annotations

import numbers
import operator
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np
import torch

from sparrow.kernels.ops import TRITON, ops_for

from ..core.definitions import DEFAULT_DENSE_LAYERS
from ..kv_policies import BlockTopK, Dense, KVPolicy
from ..model.llama import Transformer
from .block_manager import BlockManager
from .config import DecodeStep, EngineConfig
from .memory import Workload
from .runner import ModelRunner, PrefillRow
from .scheduler import Scheduler, prefill_tokens
from .sequence import Completion, Request, SamplingParams, Sequence, Status
from .speculative import Emitted, run_cycle
from .static_decode import StepOutput

__all__ = ["DecodeStep", "Engine", "EngineConfig", "EngineStats", "make_runner"]


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
    dropped_tokens: int = 0  # sampled past a stop the pipelined loop noticed a step late
    # speculative decoding (`speculative`: the engine ran it): samples' cycles (one per sample per cycle;
    # decode_steps counts the cycles), the tokens they emitted, drafts proposed, and kept by the dense
    # verification
    speculative: bool = False
    sample_cycles: int = 0
    cycle_tokens: int = 0
    drafted_tokens: int = 0
    accepted_drafts: int = 0
    verify_times: list[float] = field(default_factory=list)  # seconds of each cycle's dense verification
    compactions: int = 0  # compressions of evicting samples
    peak_pages: int = 0  # the most pool pages in use at a decode step
    # KV tokens the decode steps' samples held (their caches, new tokens included) and what dense
    # caches would hold (position + 1 each): summed over steps, and the largest step
    kv_tokens_sum: int = 0
    kv_tokens_peak: int = 0
    dense_kv_tokens_sum: int = 0
    dense_kv_tokens_peak: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # per decode step: from the later of its launch and the previous step's results to its results (with
    # a pipelined runner that is the device's step time whenever the host keeps up)
    step_times: list[float] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s


def check_policy(policy: object) -> None:
    if policy is not None and not isinstance(policy, KVPolicy):
        raise TypeError(f"the engine's policy must be a KVPolicy or None (dense), got {policy!r}; make one "
                        "with sparrow.stages.core.sparsity.as_policy")


def check_params(params: object, whose: str) -> None:
    if not isinstance(params, SamplingParams):
        raise TypeError(f"{whose} sampling parameters must be a SamplingParams, got {type(params).__name__}")


def make_runner(model: Transformer, config: EngineConfig) -> ModelRunner:
    """The runner for the model's device: `GpuRunner` on CUDA, and for the Triton kernels on CPU tensors
    (Backend.TRITON, under TRITON_INTERPRET=1), `CpuRunner` on a CPU otherwise."""
    device = model.embed_tokens.weight.device
    if device.type == "cuda" or ops_for(device, config.kernels) is TRITON:
        from .gpu.runner import GpuRunner

        return GpuRunner(model, config)
    if device.type == "cpu":
        from .cpu.runner import CpuRunner

        return CpuRunner(model, config)
    return ModelRunner(model, config)


def check_inputs(model: object, policy: object, config: object) -> None:
    """What `Engine` is built from, each wrong kind refused in one sentence before anything is set up:
    our decoder (not `load_model`'s `LoadedModel` around it, nor a transformers model), a `KVPolicy` or
    None (not a bare budget: `as_policy` reads one), an `EngineConfig` whose dense layers the model has."""
    if not isinstance(model, Transformer):
        wraps = isinstance(getattr(model, "model", None), Transformer)
        hint = (f"pass its decoder, the {type(model).__name__}'s .model" if wraps else
                "load one with sparrow.stages.model.loading.load_model(...).model")
        raise TypeError(f"Engine runs Sparrow's decoder (a stages.model.llama.Transformer), got "
                        f"{type(model).__name__}; {hint}")
    check_policy(policy)
    if not isinstance(config, EngineConfig):
        raise TypeError(f"Engine's config must be an EngineConfig, got {type(config).__name__}")
    layers = model.cfg.num_layers
    given = config.dense_layers != DEFAULT_DENSE_LAYERS  # the default: the first two, of those the model has
    if given and any(i >= layers for i in config.dense_layers):
        raise ValueError(f"dense_layers must be layer indices of the model, 0 to {layers - 1}, got "
                         f"{config.dense_layers}")


def token_ids(prompt: object, vocab_size: int, where: str) -> list[int]:
    """A prompt as the engine takes it, a flat sequence of token ids each in [0, vocab_size); text, a lone
    id, a 2-D array, a non-integer id (a bool included) or one outside the vocabulary is refused in one
    sentence naming the prompt (`where`), rather than truncated or failing inside the embedding."""
    if isinstance(prompt, (str, bytes)):
        raise TypeError(f"{where} is text ({str(prompt)[:40]!r}); the engine takes token ids: tokenize it "
                        "first, e.g. load_model(...).tokenizer(text).input_ids")
    ndim = getattr(prompt, "ndim", None)
    if ndim == 0 or (not isinstance(prompt, Seq) and not hasattr(prompt, "tolist")):
        raise TypeError(f"{where} is not a sequence of token ids (got {type(prompt).__name__} "
                        f"{prompt!r:.40}); generate takes a list of prompts, each a list of ids (one prompt: "
                        "[ids])")
    if ndim is not None and ndim > 1:
        raise TypeError(f"{where} is a {ndim}-D array of shape {tuple(prompt.shape)}, not one prompt's ids; "
                        "pass a [B, T] tensor as the prompt list itself, or its rows (a tokenizer's [1, T] "
                        "input_ids: input_ids[0])")
    ids = []
    for j, t in enumerate(prompt.tolist() if hasattr(prompt, "tolist") else prompt):
        try:
            if isinstance(t, (bool, np.bool_)):
                raise TypeError
            ids.append(operator.index(t))
        except TypeError:
            raise TypeError(f"{where} holds something other than whole token ids: {type(t).__name__} "
                            f"{t!r:.40} at index {j}; the engine takes token ids, one flat list per "
                            "prompt") from None
    if not ids:
        raise ValueError(f"{where} is empty; every prompt needs at least one token")
    bad = min(ids) if min(ids) < 0 else max(ids)
    if not 0 <= bad < vocab_size:
        raise ValueError(f"{where} has token id {bad}, but the model's vocabulary has {vocab_size} tokens "
                         f"(ids 0 to {vocab_size - 1}; were the ids made with another tokenizer?)")
    return ids


def check_request_ids(request_ids: Seq[object], count: int) -> list[int]:
    """Request ids seed their prompts' samples: whole numbers >= 0, one per prompt, none twice."""
    ids = list(request_ids)
    for rid in ids:
        if isinstance(rid, (bool, np.bool_)) or not isinstance(rid, numbers.Integral) or rid < 0:
            raise ValueError(f"request ids must be whole numbers >= 0 (they seed their prompts' samples), "
                             f"got {rid!r}")
    if len(ids) != count or len(set(ids)) != len(ids):
        raise ValueError("request_ids must name every prompt once")
    return [int(rid) for rid in ids]


class Engine:
    def __init__(self, model: Transformer, policy: KVPolicy | None = None,
                 config: EngineConfig = EngineConfig()):
        """`model`: Sparrow's decoder (`load_model(...).model`); `policy`: the KV policy of every request
        (None: dense; `as_policy` makes one from a budget or spec) unless `generate` overrides it."""
        check_inputs(model, policy, config)
        self.config = config
        self.runner = make_runner(model, config)
        self.model, self.cfg = model, model.cfg
        self.page_size = config.page_size
        self.policy = Dense() if policy is None else policy
        self.eos_ids = frozenset(self.cfg.eos_token_ids if config.eos_ids is None else config.eos_ids)
        self.max_batch, self.max_prefill_tokens = config.max_batch, config.max_prefill_tokens
        self.fixed_pages = config.num_pages
        self.num_pages = config.num_pages  # the pool's pages once a run sized it
        self.blocks: BlockManager | None = None
        self.scheduler: Scheduler | None = None
        self.stats = EngineStats(speculative=config.speculate > 0)
        self._next_id = 0
        self._pending: list[Request] = []
        self._launched: deque[tuple[float, list[int], list[int]]] = deque()  # decode steps in flight: launch
        # time, the budgets and KV lengths their tokens record
        self._last_result = 0.0  # when the previous decode step's results were read
        self._finished: list[Completion] = []  # completed since the last step() returned
        self._new = 0  # tokens generated since the last step() returned

    # ------------------------------------------------------------------ lifetime

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Free the KV pool and the CUDA graphs now; requests in flight are dropped. The engine can run
        again afterwards (it allocates a new pool)."""
        self.runner.close()
        self.scheduler = self.blocks = None
        self._pending = []
        self._launched.clear()
        self._finished, self._new = [], 0
        self.num_pages = self.fixed_pages

    def abort(self) -> None:
        """Drop every request, queued or running, and the decode steps in flight (waited for, their tokens
        dropped): the engine is idle, its pool and CUDA graphs kept for the next run. `generate` calls it
        when it raises (an interrupt, a callback's exception), so the next run gives what a fresh engine
        gives. If the device fails while the steps are waited for, the pool is freed too (as `close`)."""
        try:
            self.runner.collect(keep=0)
            self.runner.forget_rows()
        except BaseException:
            self.runner.close()
            self.num_pages = self.fixed_pages
            raise
        finally:
            self.scheduler = self.blocks = None
            self._pending = []
            self._launched.clear()
            self._finished, self._new = [], 0

    def update_weights(self) -> None:
        """The model's weights changed (an optimizer step, a checkpoint load): the next steps sample
        with the new ones (packed copies are rebuilt, stale graphs captured again)."""
        self.runner.refresh_weights()

    @property
    def decode_step(self) -> DecodeStep:
        return self.runner.decode_step

    @property
    def budget_at(self):
        """The engine's block top-k budget function (None: its policy reads every cached token)."""
        return self.policy.budget_at if isinstance(self.policy, BlockTopK) else None

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt: Seq[int], params: SamplingParams, request_id: int | None = None,
                    policy: KVPolicy | None = None) -> int:
        """Queue a prompt (token ids) for `params.n` samples; `policy` overrides the engine's."""
        prompt = token_ids(prompt, self.cfg.vocab_size, "the prompt")
        check_params(params, "the prompt's")
        check_policy(policy)
        if request_id is not None:
            request_id = check_request_ids([request_id], 1)[0]
        policy = self.policy if policy is None else policy
        self._check_request(prompt, params, policy)
        return self._queue(prompt, params, request_id, policy)

    def _check_request(self, prompt: list[int], params: SamplingParams, policy: KVPolicy) -> None:
        """Refuse in one sentence a request this engine cannot run (nothing is queued): past the model's
        context, more top logprobs than the vocabulary has, a policy the engine cannot run, more pages than
        a fixed or running pool holds."""
        if params.logprobs > self.cfg.vocab_size:
            raise ValueError(f"logprobs must be at most the model's vocabulary of {self.cfg.vocab_size} "
                             f"tokens, got {params.logprobs}")
        if len(prompt) + params.max_new_tokens > self.cfg.max_position_embeddings:
            raise ValueError(f"a prompt of {len(prompt)} tokens with max_new_tokens "
                             f"{params.max_new_tokens} exceeds the model's context of "
                             f"{self.cfg.max_position_embeddings}")
        if policy.evicts and self.config.speculate:
            raise ValueError(f"speculative decoding drafts with dense or block top-k attention, not with "
                             f"{policy.name}'s eviction")
        if policy.evicts:
            policy.validate(self.cfg.max_position_embeddings)
        running = self._running()
        if self.fixed_pages is not None or running:
            self._check_fits(len(prompt), params.max_new_tokens, policy)
        if running and policy.evicts and policy.window > self.runner.cache.window:
            raise ValueError(f"a {policy.name} request can join a run only if the run started with one (its "
                             "pool then holds the query windows eviction reads); add it before the run")

    def _queue(self, prompt: list[int], params: SamplingParams, request_id: int | None,
               policy: KVPolicy) -> int:
        """Queue a checked request (`_check_request`) and return its id."""
        rid = self._next_id if request_id is None else request_id
        self._next_id = max(self._next_id, rid + 1)
        running = self._running()
        req = Request(rid, prompt, params, policy, frozenset() if params.ignore_eos else self.eos_ids)
        if running:
            self.scheduler.add(req)
        else:
            self._pending.append(req)
        return rid

    def _check_fits(self, prompt_len: int, max_new: int, policy: KVPolicy) -> None:
        need = Workload.of([(prompt_len, 1, max_new, policy)], 1, self.page_size).one_sample()
        if need > self.num_pages:
            raise ValueError(f"a prompt of {prompt_len} tokens with max_new_tokens {max_new} needs {need} "
                             f"KV pages for one sample but the engine's pool has only {self.num_pages}")

    def reserve(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams]) -> int:
        """Size the pool (and the static step's block table) now for a run of these requests; later runs
        keep it while it is large enough (one engine for runs of several sizes: give the largest).
        Returns the pool's pages."""
        if self._running():
            raise RuntimeError("reserve() sizes the pool of an idle engine")
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        work = self._workload([(len(p), sp, self.policy) for p, sp in zip(prompts, params)])
        self.num_pages = self.runner.reserve(work, self.fixed_pages)
        return self.num_pages

    def warm_up(self, batch: int, budgets) -> None:
        """Capture the decode graphs a run will use, for `batch` running samples at each of these budgets
        (0 = dense), after `reserve()`: nothing to do on the plain path. A bench's untimed setup (a run
        otherwise captures each graph at its first step, and keeps it for the engine's later runs)."""
        if self._running():
            raise RuntimeError("warm_up() prepares an idle engine")
        if self.runner.cache is None:
            raise RuntimeError("warm_up() needs the pool: call reserve() first")
        with torch.inference_mode():
            self.runner.warm_up(batch, budgets)

    def _workload(self, requests: list[tuple[int, SamplingParams, KVPolicy]]) -> Workload:
        return Workload.of([(n, sp.n, sp.max_new_tokens, policy) for n, sp, policy in requests],
                           self.max_batch, self.page_size)

    def _running(self) -> bool:
        """Whether a run is in progress (its scheduler has work, or decode steps are in flight)."""
        return self.scheduler is not None and (self.scheduler.has_work() or bool(self.runner.in_flight()))

    def _start(self) -> None:
        """A new run over the pending requests: the pool sized (or kept) for them, every page free."""
        reqs = self._pending
        work = self._workload([(len(r.prompt), r.params, r.policy) for r in reqs])
        self.num_pages = self.runner.reserve(work, self.fixed_pages)  # may refuse: the requests stay pending
        self._pending = []
        self.blocks = BlockManager(self.num_pages, self.page_size)
        self.runner.begin(self.blocks)
        self.scheduler = Scheduler(self.blocks, self.max_batch, self.max_prefill_tokens,
                                   self.config.speculate)
        for r in reqs:
            self.scheduler.add(r)

    def has_work(self) -> bool:
        return bool(self._pending) or self._running()

    # ------------------------------------------------------------------ the loop

    @torch.inference_mode()
    def step(self) -> tuple[list[Completion], int]:
        """Run one prefill or decode step; returns (samples finished, tokens generated) since the last
        call. With a pipelined runner a decode step's tokens come back with the next step, or when the
        run settles at its end."""
        t0 = time.perf_counter()
        if self.runner.in_flight() and (not self.scheduler.has_work() or self._must_settle()):
            self._settle()
        settled = time.perf_counter() - t0
        if self._pending and not self._running():
            self._start()
        if self.scheduler is None or not self.scheduler.has_work():
            self.stats.decode_s += settled
            return self._take()
        plan = self.scheduler.schedule()
        t1 = time.perf_counter()
        if plan.kind == "prefill":
            seqs = self._prefill(plan.batch)
            self.runner.synchronize()
            self.stats.prefill_s += time.perf_counter() - t1
            self.stats.decode_s += settled
            self.stats.generated_tokens += len(seqs)
            self._new += len(seqs)
            for s in seqs:
                if s.finish_reason is not None:
                    self._finish(s)
        else:
            self.runner.apply(plan)
            if self.config.speculate:
                self._speculate(plan.batch)
            else:
                self._decode(plan.batch, t1)
            self.stats.decode_s += settled + time.perf_counter() - t1
        self.stats.preemptions = self.scheduler.preemptions
        return self._take()

    def _take(self) -> tuple[list[Completion], int]:
        done, new = self._finished, self._new
        self._finished, self._new = [], 0
        return done, new

    def _must_settle(self) -> bool:
        """Whether the next schedule needs every token read back: it may admit (a free slot and someone
        waiting or ready) or preempt (fewer free pages than the running samples' next step needs)."""
        sch = self.scheduler
        if (sch.waiting or sch.ready) and len(sch.running) < self.max_batch:
            return True
        return sum(sch.page_need(s) for s in sch.running) > self.blocks.num_free

    def _settle(self) -> None:
        """Read back every decode step in flight."""
        for out in self.runner.collect(keep=0):
            self._apply(out)

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams],
                 on_step: Callable[[int, int], None] | None = None,
                 request_ids: Seq[int] | None = None,
                 policy: KVPolicy | None = None,
                 on_prompt: Callable[[int, list[Completion]], None] | None = None) -> list[list[Completion]]:
        """All samples of every prompt, in prompt order then sample order. `on_step(new_tokens,
        finished_samples)` is called after every engine step; `on_prompt(request_id, completions)` once
        for each prompt, as soon as all of its samples have finished (in sample order), before that
        step's `on_step`, and the engine keeps them no longer (their lists here are empty), so a long run
        holds each prompt's samples once. `request_ids` (default: consecutive, from 0
        when the engine is idle) name the prompts in the per-sample seeds, so a shard of a prompt set given
        its global prompt indices samples exactly what the whole set run in one engine samples for those
        prompts. `policy` overrides the engine's for these prompts. Called on an idle engine, it starts
        a run: `stats` then count this call's steps only. Every prompt is checked before any is queued,
        so a refusal changes nothing; if the run raises (an interrupt, a callback's exception), every
        request is dropped (`abort`) and the engine is idle again."""
        prompts, params, policy = self._checked(prompts, params, policy)
        idle = not self.has_work()
        base = 0 if idle else self._next_id
        if request_ids is None:
            request_ids = range(base, base + len(prompts))
        request_ids = check_request_ids(request_ids, len(prompts))
        if idle:
            self.stats = EngineStats(speculative=self.config.speculate > 0)
            self._next_id = 0
        try:
            return self._run(prompts, params, request_ids, policy, on_step, on_prompt)
        except BaseException:
            self.abort()
            raise

    def _run(self, prompts: list[list[int]], params: list[SamplingParams], request_ids: list[int],
             policy: KVPolicy, on_step: Callable[[int, int], None] | None,
             on_prompt: Callable[[int, list[Completion]], None] | None) -> list[list[Completion]]:
        """`generate`'s run over checked requests."""
        ids = [self._queue(p, sp, rid, policy) for p, sp, rid in zip(prompts, params, request_ids)]
        out: dict[int, list[Completion]] = {i: [] for i in ids}
        samples = {i: sp.n for i, sp in zip(ids, params)}
        while self.has_work():
            done, new = self.step()
            for c in done:
                if c.request_id in out:
                    out[c.request_id].append(c)
                    if on_prompt is not None and len(out[c.request_id]) == samples[c.request_id]:
                        on_prompt(c.request_id, sorted(out.pop(c.request_id), key=lambda x: x.sample))
            if on_step is not None:
                on_step(new, len(done))
        return [sorted(out.get(i, ()), key=lambda c: c.sample) for i in ids]

    def _checked(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams],
                 policy: KVPolicy | None) -> tuple[list[list[int]], list[SamplingParams], KVPolicy]:
        """Every prompt's ids, its params and the policy (None: the engine's) checked before any is queued
        (a bad prompt 3 leaves nothing of prompts 0-2 behind)."""
        if isinstance(prompts, (str, bytes)):
            raise TypeError("generate takes a list of prompts, each a list of token ids, not text; tokenize "
                            "it first, e.g. [load_model(...).tokenizer(text).input_ids]")
        object_array = getattr(prompts, "dtype", None) == np.dtype(object)  # a pandas column of id lists
        if getattr(prompts, "ndim", None) in (0, 1) and not object_array:
            raise TypeError(f"generate takes a list of prompts, got one {type(prompts).__name__} of token "
                            f"ids (shape {tuple(prompts.shape)}); one prompt goes in a list: [ids]")
        ids = [token_ids(p, self.cfg.vocab_size, f"prompt {i}") for i, p in enumerate(prompts)]
        if isinstance(params, SamplingParams):
            params = [params] * len(ids)
        else:
            params = list(params)
            if len(params) != len(ids):
                raise ValueError(f"generate got {len(params)} SamplingParams for {len(ids)} prompts; give "
                                 "one for all or one per prompt")
            for i, sp in enumerate(params):
                check_params(sp, f"prompt {i}'s")
        check_policy(policy)
        policy = self.policy if policy is None else policy
        for p, sp in zip(ids, params):
            self._check_request(p, sp, policy)
        return ids, params, policy

    # ------------------------------------------------------------------ prefill

    def _generator(self, req: Request, sample: int) -> torch.Generator | None:
        if req.params.temperature <= 0:
            return None
        seed = int(np.random.SeedSequence([req.params.seed, req.request_id, sample]).generate_state(1)[0])
        return torch.Generator(device=self.runner.device).manual_seed(seed)

    @staticmethod
    def _seed(req: Request, sample: int) -> int:
        """The sample's 64-bit seed for the device path's draws (as an int64)."""
        state = np.random.SeedSequence([req.params.seed, req.request_id, sample]).generate_state(1, np.uint64)
        return int(state.view(np.int64)[0])

    def _prefill(self, batch: list[Request | Sequence]) -> list[Sequence]:
        """Prefill new requests (their samples then share the prompt's pages and sample their first
        token) and recompute preempted samples (no sampling: their last token is fed next)."""
        blocks = self.blocks
        restored = [x for x in batch if isinstance(x, Sequence) and x.policy.evicts]
        batch = [x for x in batch if not (isinstance(x, Sequence) and x.policy.evicts)]
        rows = []
        for x in batch:
            tokens = prefill_tokens(x)
            pages = [blocks.allocate() for _ in range(blocks.pages_for(len(tokens)))]
            if isinstance(x, Request):
                rows.append(PrefillRow(tokens, len(x.prompt), pages, None, x.request_id, x.params.n,
                                       x.policy.window if x.policy.evicts else 0))
            else:
                rows.append(PrefillRow(tokens, len(x.request.prompt), pages, x.budgets[1: len(x.tokens)],
                                       x.request.request_id))
        logits = self.runner.prefill(rows) if rows else None  # [fresh requests, V], in batch order
        self.stats.prefill_tokens += sum(len(r.tokens) for r in rows)
        self.stats.recomputed_tokens += sum(len(r.tokens) for r in rows if r.budgets is not None)
        for seq in restored:  # an evicting sample: its retained cache, replayed (runner.restore)
            prompt_len, generated = len(seq.request.prompt), len(seq.tokens) - 1
            seq.cached = seq.policy.cache_len(prompt_len, generated)
            # a compression that was due when it was preempted is the replay's, never the scheduler's
            replayed = seq.policy.compressions(prompt_len, generated)
            self.scheduler.compactions += replayed - seq.compactions
            seq.compactions = replayed
            seq.pages = [blocks.allocate() for _ in range(blocks.pages_for(seq.cached))]
            self.runner.restore(seq, seq.pages)
            fed = len(seq.request.prompt) + len(seq.tokens) - 1
            self.stats.prefill_tokens += fed
            self.stats.recomputed_tokens += fed

        seqs: list[Sequence] = []
        owner = []  # the row of logits each fresh sample samples from
        fresh = [(x, row) for x, row in zip(batch, rows) if isinstance(x, Request)]
        for i, (req, row) in enumerate(fresh):
            for s in range(req.params.n):
                seq = Sequence(req, s, self._generator(req, s), self._seed(req, s), cached=len(req.prompt),
                               speculative=self.config.speculate > 0)
                seq.pages = [blocks.share(p) if s else p for p in row.pages]
                seqs.append(seq)
                owner.append(i)
        for start in range(0, len(seqs), self.max_batch):  # [max_batch, V] at a time: a prompt's samples
            # beyond the batch wait in `ready`, and all of them at once would hold [n, V] logits twice
            part = seqs[start:start + self.max_batch]
            rows_of = torch.tensor(owner[start:start + len(part)], device=logits.device)
            self._sample(part, logits[rows_of], [0] * len(part))
        again = [x for x in batch if isinstance(x, Sequence)]
        for seq, row in zip(again, (row for x, row in zip(batch, rows) if isinstance(x, Sequence))):
            seq.pages, seq.cached = row.pages, len(row.tokens)
        self.scheduler.admit_prefilled(again + restored + [s for s in seqs if s.finish_reason is None])
        return seqs

    # ------------------------------------------------------------------ decode

    def _decode(self, seqs: list[Sequence], started: float) -> None:
        """Launch a decode step of the running samples and read back what the runner's lag allows."""
        if not seqs:
            return
        if self.runner.in_flight() and not self.runner.pipelines(seqs):
            self._settle()  # a plain step feeds the samples' last tokens from the host
            seqs = [s for s in seqs if s.status == Status.RUNNING]
            if not seqs:
                return
        budgets = [s.budget_now() for s in seqs]
        # what the rollouts record of each token: the budget of its step (an evicting policy's KV budget),
        # and the KV tokens the cache holds (with the fed token)
        recorded = [s.policy.token_budget(s.num_tokens) for s in seqs]
        self.runner.launch_decode(seqs, budgets)
        held = dense = 0
        for s in seqs:
            s.cached += 1  # the fed token's keys and values
            held, dense = held + s.cached, dense + s.position + 1
        self._launched.append((started, recorded, [s.cached for s in seqs]))
        st = self.stats
        st.decode_steps += 1
        st.max_running = max(st.max_running, len(seqs))
        st.kv_tokens_sum, st.kv_tokens_peak = st.kv_tokens_sum + held, max(st.kv_tokens_peak, held)
        st.dense_kv_tokens_sum = st.dense_kv_tokens_sum + dense
        st.dense_kv_tokens_peak = max(st.dense_kv_tokens_peak, dense)
        st.peak_pages = max(st.peak_pages, self.blocks.used)
        st.compactions = self.scheduler.compactions
        lag = self.runner.lag
        for s in seqs:
            s.pending += 1
            if lag and len(s.tokens) + s.pending >= s.request.params.max_new_tokens:
                self.scheduler.finish(s)  # its last token is in flight: it leaves the batch now
        for out in self.runner.collect(keep=lag):
            self._apply(out)

    def _speculate(self, seqs: list[Sequence]) -> None:
        """One speculative cycle of the running samples (speculative.py): their emitted tokens recorded,
        stopping at a stop token."""
        if not seqs:
            return
        st = self.stats
        st.decode_steps += 1
        st.max_running = max(st.max_running, len(seqs))
        held = sum(s.cached + 1 for s in seqs)  # the dense caches with the fed token, as a decode step counts
        st.kv_tokens_sum, st.kv_tokens_peak = st.kv_tokens_sum + held, max(st.kv_tokens_peak, held)
        st.dense_kv_tokens_sum += held
        st.dense_kv_tokens_peak = max(st.dense_kv_tokens_peak, held)
        st.peak_pages = max(st.peak_pages, self.blocks.used)
        cycle = run_cycle(self.runner, self.blocks, seqs, self.config.speculate)
        st.verify_times.append(cycle.verify_seconds)
        for e in cycle.emitted:
            self._record_emitted(e)

    def _record_emitted(self, e: Emitted) -> None:
        s, st = e.seq, self.stats
        st.sample_cycles += 1
        st.drafted_tokens += e.drafted
        st.accepted_drafts += e.kept
        s.drafted += e.drafted
        for i, token in enumerate(e.tokens):
            self._record(s, token, e.logprobs[i], 0, e.kv_lens[i], e.tops[i])
            s.accepted.append(i < e.kept)
            st.cycle_tokens += 1
            st.decode_tokens += 1
            st.generated_tokens += 1
            self._new += 1
            if s.finish_reason is not None:
                self._finish(s)
                break

    def _apply(self, out: StepOutput) -> None:
        """One decode step's results: each sample's token recorded, unless the sample stopped at an
        earlier token (a token past a stop is dropped); finished samples completed."""
        now = time.perf_counter()
        started, recorded, kv_lens = self._launched.popleft()
        self.stats.step_times.append(now - max(started, self._last_result))
        self._last_result = now
        for i, s in enumerate(out.seqs):
            s.pending -= 1
            if s.finish_reason is not None:
                self.stats.dropped_tokens += 1
                continue
            top = None if out.top is None else (out.top[0][i], out.top[1][i])
            self._record(s, out.tokens[i], out.logprobs[i], recorded[i], kv_lens[i], top)
            self.stats.decode_tokens += 1
            self.stats.budget_sum += recorded[i]
            self.stats.generated_tokens += 1
            self._new += 1
            if s.finish_reason is not None:
                self._finish(s)

    def _finish(self, s: Sequence) -> None:
        if s.status != Status.FINISHED:
            self.scheduler.finish(s)
        self.runner.on_finish(s.request.request_id)
        self._finished.append(s.completion())

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, budgets: list[int]) -> None:
        tokens, logps, top = self.runner.sample(seqs, logits)
        for i, s in enumerate(seqs):
            self._record(s, tokens[i], logps[i], budgets[i], s.cached,
                         None if top is None else (top[0][i], top[1][i]))

    @staticmethod
    def _record(s: Sequence, token: int, logprob: float, budget: int, kv_len: int, top) -> None:
        """Append a sampled token (top: its row of top (values, ids); kv_len: the KV tokens its query
        read) and decide whether the sample stops."""
        s.tokens.append(token)
        s.logprobs.append(logprob)
        s.budgets.append(budget)
        s.kv_lens.append(kv_len)
        n = s.request.params.logprobs
        if n:
            s.top_logprobs = s.top_logprobs or []
            s.top_logprobs.append(list(zip(top[1][:n].tolist(), top[0][:n].tolist())))
        if token in s.request.eos_ids:
            s.finish_reason = "stop"
        elif len(s.tokens) >= s.request.params.max_new_tokens:
            s.finish_reason = "length"

