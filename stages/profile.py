"""The `sparrow profile` stage: sample trajectories (or take them from a rollouts file), then score every
generated token under dense attention and under each candidate budget, teacher forced.

Sampling and scoring are separate so that the trajectories come from whichever sampler the user names
(dense, a budget, a schedule, an eviction policy), as a run's rollouts would. The one sampler is the
rollout engine, each sample seeded from (seed, prompt row, sample), so `run_profile` over a prompt set gives
the rows `profile_trajectories` gives over the `sparrow rollout` artifact of the same prompts and seed.
Rows are long and narrow (one per token per budget): `summarize` is the one GROUP BY a user would type.
With `kv_compression` the budgets are KV budgets of that eviction policy, each replayed teacher forced.

Two LoRAs differ in where they apply. A trained learner's (`lora`, `sparrow rollout --lora`'s) is the
policy itself: merged into the weights for the whole run, so the samples, the dense scores and every
budget's sparse scores are the learner's. A sparse actor's (`adapter`, `sparrow distill`'s) adapts the
sparse side only, on top of the learner when both are given (train --distill-sparse's pair).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .attention import DEFAULT_DENSE_LAYERS, PAGE_SIZE, validate_budget
from .calibrate import PRIOR_THRESHOLD
from .core.definitions import DEFAULT_BIN_WIDTH, TAIL_QUANTILE
from .core.prompt_set import seed_rows
from .core.schedule import Schedule
from .core.sparsity import as_policy
from .core.trajectories import Trajectory
from .engine import Engine, EngineConfig, EngineStats, SamplingParams
from .engine.sequence import TEMPERATURE_FLOOR, below_temperature_floor
from .kv_policies import Dense, KVPolicy
from .model.loading import LoadedModel, resolve_config
from .model.lora import LoraWeights, lora_merged
from .model.names import model_name
from .scoring.mismatch import score_sequences


class Progress(Protocol):
    """A phase's count of `total` done; a sampling phase also gives the tokens generated so far."""

    def __call__(self, phase: str, done: int, total: int, tokens: int | None = None) -> None: ...


SAMPLING = ("samples", "max_new_tokens", "sampler", "top_p", "top_k", "seed", "batch_size", "speculate")
FLAGS = {"batch_size": "--max-num-seqs"}  # the options whose flag is not their name
SPECULATE_WITH_ADAPTER = ("--speculate verifies with the dense model, which --adapter's sparse actor is not: "
                          "drop one of them")
DRAFT_ALPHA_WITH_ADAPTER = ("--draft-alpha scores the drafts of exact speculative sampling, which verifies "
                            "with the dense model, not --adapter's sparse actor")


@dataclass
class ProfileOptions:
    budgets: list[int]
    samples: int = 4
    max_new_tokens: int = 256
    sampler: str = "dense"  # the sampler's spec as given (dense, budget:B, schedule:FILE, snapkv:B, rkv:B)
    bin_width: int = DEFAULT_BIN_WIDTH
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    batch_size: int = 16  # samples decoded together (the engine's max_batch; --max-num-seqs)
    speculate: int = 0  # K > 0: the sparse sampler drafts K tokens a cycle and dense verifies (dense samples)
    draft_alpha: bool = False  # also each budget's alpha for a speculative draft (column alpha_draft)
    score_tokens: int = 16384  # tokens per teacher-forced scoring batch
    dense_layers: tuple[int, ...] = DEFAULT_DENSE_LAYERS
    page_size: int = PAGE_SIZE
    policy: KVPolicy | None = field(default=None, repr=False)  # the sampler (None: read from `sampler`)
    schedule: Schedule | None = field(default=None, repr=False)  # without `policy`: schedule:FILE's schedule
    adapter: LoraWeights | None = field(default=None, repr=False)  # the sparse actor's LoRA (distill)
    lora: LoraWeights | None = field(default=None, repr=False)  # a learner's LoRA, merged on both sides
    gpu_memory_utilization: float = 0.9  # on CUDA, the share of device memory the engine may take
    kv_compression: str | None = None  # snapkv | rkv: the budgets are that eviction policy's KV budgets
    kv_window: int | None = None  # None: the policy's default (or, by the CLI, the sampler's own)
    kv_buffer: int | None = None
    kv_sink: int | None = None

    def modes(self) -> list:
        """The scored modes, one per budget: the budget (block top-k) or the eviction policy at it."""
        if self.kv_compression is None:
            return list(self.budgets)
        from .kv_policies import EVICTION_POLICIES

        options = {k: v for k, v in (("window", self.kv_window), ("buffer", self.kv_buffer),
                                     ("sink", self.kv_sink)) if v is not None}
        return [EVICTION_POLICIES[self.kv_compression](b, **options) for b in self.budgets]

    def validate(self) -> None:
        if not self.budgets:
            raise ValueError("--budgets is empty")
        repeated = sorted({b for b in self.budgets if self.budgets.count(b) > 1})
        if repeated:
            raise ValueError(f"--budgets lists {', '.join(map(str, repeated))} more than once; give each "
                             "budget once")
        if self.kv_compression is not None:
            from .kv_policies import EVICTION_POLICIES

            if self.kv_compression not in EVICTION_POLICIES:
                raise ValueError(f"--kv-compression must be one of {', '.join(EVICTION_POLICIES)}, got "
                                 f"{self.kv_compression!r}")
            for b, policy in zip(self.budgets, self.modes()):
                policy.validate(label=f"--budgets {b} under --kv-compression {self.kv_compression}")
        for b in self.budgets if self.kv_compression is None else ():
            try:
                validate_budget(b, self.page_size)
            except ValueError as e:
                raise ValueError(f"--budgets: {e}") from None
        for name in ("samples", "max_new_tokens", "bin_width", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{FLAGS.get(name, '--' + name.replace('_', '-'))} must be at least 1, "
                                 f"got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if below_temperature_floor(self.temperature):
            raise ValueError(f"--temperature {TEMPERATURE_FLOOR}, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        if self.sampler.startswith("budget:"):
            budget = self.sampler.split(":", 1)[1]
            if not budget.strip().isdigit():
                raise ValueError(f"--sampler {self.sampler}: the budget must be a whole number of tokens, "
                                 "as in budget:2048")
            try:
                validate_budget(int(budget), self.page_size)
            except ValueError as e:
                raise ValueError(f"--sampler {self.sampler}: {e}") from None
        elif self.sampler.split(":", 1)[0] in ("snapkv", "rkv"):
            from .kv_policies import parse_eviction

            try:
                parse_eviction(self.sampler)
            except ValueError as e:
                raise ValueError(f"--sampler {e}") from None
        elif self.sampler != "dense" and not self.sampler.startswith("schedule:"):
            raise ValueError(f"--sampler must be dense, budget:B, schedule:FILE, snapkv:B or rkv:B, got "
                             f"{self.sampler!r}")
        self._validate_speculate()
        self.validate_draft_alpha()

    def _validate_speculate(self) -> None:
        if self.speculate < 0:
            raise ValueError(f"--speculate must be >= 0 (drafts per cycle; 0 = off), got {self.speculate}")
        if not self.speculate:
            return
        if not self.sampler.startswith(("budget:", "schedule:")):
            raise ValueError(f"--speculate drafts with the block top-k sampler (--sampler budget:B or "
                             f"schedule:FILE), not --sampler {self.sampler}")
        if self.adapter is not None:
            raise ValueError(SPECULATE_WITH_ADAPTER)

    def validate_draft_alpha(self) -> None:
        """--draft-alpha scores block top-k drafts of the model itself: not an adapter's or an eviction's."""
        if self.draft_alpha and self.kv_compression is not None:
            raise ValueError("--draft-alpha scores block top-k drafts, not --kv-compression's eviction")
        if self.draft_alpha and self.adapter is not None:
            raise ValueError(DRAFT_ALPHA_WITH_ADAPTER)

    def sampler_policy(self) -> KVPolicy:
        """The sampler's KV policy: `policy`, else the one `sampler` names."""
        if self.policy is not None:
            return self.policy
        spec = self.schedule if self.sampler.startswith("schedule:") else self.sampler
        return as_policy(spec, self.page_size)

    def metadata(self, sampled: bool = True) -> dict:
        """The options as artifact metadata; without `sampled` (given trajectories) the sampling
        options, which did not apply, are left out."""
        left_out = ("policy", "schedule", "adapter", "lora", "gpu_memory_utilization") + (
            () if sampled else SAMPLING)
        d = {k: v for k, v in asdict(self).items() if k not in left_out}
        d["budgets"] = json.dumps(self.budgets)
        d["dense_layers"] = json.dumps(list(self.dense_layers))
        if self.kv_compression is not None:
            d["kv_policies"] = json.dumps([m.spec() for m in self.modes()])
        return {k: v for k, v in d.items() if not (k.startswith("kv_") and v is None)}


@dataclass
class Speculation:
    """What exact speculative sampling did while the trajectories were sampled, from the engine's own
    counts (`EngineStats`), as `sparrow rollout`'s summary gives them (stages/rollout.py): cycles, the
    samples' cycles, the tokens those emitted, drafts proposed and drafts the dense verification kept."""

    cycles: int = 0
    sample_cycles: int = 0
    cycle_tokens: int = 0
    drafted_tokens: int = 0
    accepted_drafts: int = 0

    @classmethod
    def of(cls, stats: EngineStats) -> Speculation | None:
        """The counts of an engine run (None: it did not speculate)."""
        if not stats.speculative:
            return None
        return cls(stats.decode_steps, stats.sample_cycles, stats.cycle_tokens, stats.drafted_tokens,
                   stats.accepted_drafts)

    def __add__(self, other: Speculation) -> Speculation:
        """The counts of two runs (Ray shards) together."""
        return Speculation(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values())))

    @property
    def acceptance(self) -> float | None:
        """Kept drafts / drafts proposed."""
        return self.accepted_drafts / self.drafted_tokens if self.drafted_tokens else None

    @property
    def tokens_per_cycle(self) -> float | None:
        """Tokens a sample's cycle emitted on average (its kept drafts and the dense model's one)."""
        return self.cycle_tokens / self.sample_cycles if self.sample_cycles else None

    def metadata(self) -> dict:
        """The counts under the keys of `sparrow rollout`'s summary."""
        def rounded(x: float | None) -> float | None:
            return None if x is None else round(x, 4)

        return {"speculative_cycles": self.cycles, "sample_cycles": self.sample_cycles,
                "drafted_tokens": self.drafted_tokens, "accepted_drafts": self.accepted_drafts,
                "acceptance": rounded(self.acceptance), "tokens_per_cycle": rounded(self.tokens_per_cycle)}


OnSpeculation = Callable[[Speculation], None]


def run_profile(model: LoadedModel, prompt_ids: Sequence[str], prompts: Sequence[list[int]],
                opts: ProfileOptions, progress: Progress | None = None,
                on_speculation: OnSpeculation | None = None,
                request_ids: Sequence[int] | None = None) -> pa.Table:
    """Sample `opts.samples` trajectories per prompt through the engine (seeded by `request_ids`, the
    prompts' rows in their file; default 0, 1, ...); score each token under each budget.
    `on_speculation` gets the speculative counts of the sampling, under `opts.speculate`."""
    opts.validate()
    trajectories = sample_trajectories(model, prompt_ids, prompts, opts, progress, request_ids=request_ids,
                                       on_speculation=on_speculation)
    return profile_trajectories(model, trajectories, opts, progress)


def sample_trajectories(model: LoadedModel, prompt_ids: Sequence[str], prompts: Sequence[list[int]],
                        opts: ProfileOptions, progress: Progress | None = None,
                        request_ids: Sequence[int] | None = None,
                        on_speculation: OnSpeculation | None = None) -> list[Trajectory]:
    """The engine's samples under `opts.sampler`, in prompt order then sample order; `request_ids`:
    the prompts' indices in the whole set when these are a shard of it (they seed the samples). With
    `opts.lora` every sample is the learner's (its LoRA merged for the run). A sparse sampler is the
    sparse actor: with `opts.adapter`, the engine runs with it merged too (`stages.distill`); with
    `opts.speculate` it only drafts, and the samples are the dense model's (engine/speculative.py), whose
    counts go to `on_speculation`."""
    params = SamplingParams(max_new_tokens=opts.max_new_tokens, temperature=opts.temperature,
                            top_p=opts.top_p, top_k=opts.top_k, seed=opts.seed, n=opts.samples)
    total, done, tokens = len(prompts) * opts.samples, 0, 0

    def on_step(new_tokens: int, finished: int) -> None:
        nonlocal done, tokens
        done, tokens = done + finished, tokens + new_tokens
        progress("sampling", done, total, tokens)

    policy = opts.sampler_policy()
    actor = opts.adapter if not isinstance(policy, Dense) else None
    with lora_merged(model.model, opts.lora):
        engine = Engine(model.model, policy, EngineConfig(
            max_batch=opts.batch_size, page_size=opts.page_size, dense_layers=opts.dense_layers,
            gpu_memory_utilization=opts.gpu_memory_utilization, speculate=opts.speculate))
        with engine, lora_merged(model.model, actor):
            results = engine.generate(prompts, params, on_step if progress else None,
                                      request_ids=request_ids)
    speculation = Speculation.of(engine.stats)
    if on_speculation is not None and speculation is not None:
        on_speculation(speculation)
    return [Trajectory(pid, c.sample, list(p), c.token_ids)
            for pid, p, completions in zip(prompt_ids, prompts, results) for c in completions]


def profile_trajectories(model: LoadedModel, trajectories: Sequence[Trajectory], opts: ProfileOptions,
                         progress: Progress | None = None) -> pa.Table:
    """Score every generated token of the given trajectories (any sampler's) under dense attention and
    each of `opts.budgets`, teacher forced, at `opts.temperature`; both sides run with `opts.lora` (a
    learner's) merged, the sparse modes are the sparse actor (with `opts.adapter` merged on top, see
    `stages.distill`), dense is the model's own weights."""
    opts.validate()
    with lora_merged(model.model, opts.lora):
        return _score_trajectories(model, trajectories, opts, progress)


def _score_trajectories(model: LoadedModel, trajectories: Sequence[Trajectory], opts: ProfileOptions,
                        progress: Progress | None = None) -> pa.Table:
    jobs = [t for t in trajectories if t.completion]
    lengths = [len(t.prompt) + len(t.completion) for t in jobs]
    order = sorted(range(len(jobs)), key=lambda i: lengths[i])
    columns: dict[str, list[np.ndarray]] = {}
    done = 0
    modes = opts.modes()
    if progress:
        progress("scoring", 0, len(jobs))
    for group in _batches_by_tokens(order, lengths, opts.score_tokens):
        scored = score_sequences(model.model, [jobs[i].prompt for i in group],
                                 [jobs[i].completion for i in group], modes, opts.temperature,
                                 opts.dense_layers, opts.page_size, actor=opts.adapter,
                                 drafts=opts.draft_alpha)
        for budget, mode in zip(opts.budgets, modes):
            alpha, logp_sparse = scored.sparse[mode]
            _append_rows(columns, [jobs[group[s]] for s in scored.seq], scored, budget, alpha,
                         logp_sparse, opts.bin_width, scored.draft.get(mode))
        done += len(group)
        if progress:
            progress("scoring", done, len(jobs))
    return _to_table(columns)


def _batches_by_tokens(order: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    groups, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > max_tokens:
            groups.append(current)
            current = []
        current.append(i)
    return groups + ([current] if current else [])


def _append_rows(columns: dict[str, list[np.ndarray]], jobs: list[Trajectory], scored, budget: int,
                 alpha: np.ndarray, logp_sparse: np.ndarray, bin_width: int,
                 alpha_draft: np.ndarray | None = None) -> None:
    log_ratio = scored.logp_dense - logp_sparse  # log r, r = p_dense / p_sparse
    n = len(alpha)
    parts = {
        "prompt_id": np.array([j.prompt_id for j in jobs], dtype=object),
        "sample": np.array([j.sample for j in jobs], dtype=np.int32),
        "position": scored.position.astype(np.int32),
        "bin": (scored.position // bin_width).astype(np.int32),
        "budget": np.full(n, budget, dtype=np.int32),
        "token_id": scored.token_id.astype(np.int32),
        "alpha": alpha.astype(np.float32),
        "logp_dense": np.minimum(scored.logp_dense, 0).astype(np.float32),
        "logp_sparse": np.minimum(logp_sparse, 0).astype(np.float32),
        "log_ratio": log_ratio.astype(np.float32),
        "k1": (-log_ratio).astype(np.float32),
        "k2": (0.5 * log_ratio**2).astype(np.float32),
        "k3": np.maximum(np.expm1(log_ratio) - log_ratio, 0).astype(np.float32),
        "entropy_dense": scored.entropy_dense.astype(np.float32),
    }
    if alpha_draft is not None:
        parts["alpha_draft"] = alpha_draft.astype(np.float32)
    for k, v in parts.items():
        columns.setdefault(k, []).append(v)


def _to_table(columns: dict[str, list[np.ndarray]]) -> pa.Table:
    if not columns:
        raise ValueError("no tokens were generated, so there is nothing to profile")
    return pa.table({k: pa.array(np.concatenate(v)) for k, v in columns.items()})


def summarize(mismatch: pa.Table, quantile: float = TAIL_QUANTILE,
              threshold: float = PRIOR_THRESHOLD) -> pa.Table:
    """Per bin and budget: tokens, mean alpha, the q-quantile of alpha, and whether it clears the
    threshold; with a draft alpha scored (--draft-alpha), its mean and q-quantile too (`mean_alpha_draft`,
    `tail_alpha_draft`). The same GROUP BY a user would type into `sparrow sql`; `above` is the lossy
    tail's."""
    con = duckdb.connect()
    con.register("mismatch", mismatch)
    draft = has_draft_alpha(mismatch)
    drafted = ("avg(alpha_draft) AS mean_alpha_draft, quantile_cont(alpha_draft::DOUBLE, ?) AS "
               "tail_alpha_draft," if draft else "")
    return con.sql(
        f"""SELECT bin, budget, count(*) AS tokens, avg(alpha) AS mean_alpha,
                   quantile_cont(alpha::DOUBLE, ?) AS tail_alpha, {drafted}
                   quantile_cont(alpha::DOUBLE, ?) >= ? AS above
            FROM mismatch GROUP BY bin, budget ORDER BY bin, budget""",
        params=[quantile, *([quantile] if draft else []), quantile, threshold],
    ).to_arrow_table()


def unevicted(mismatch: pa.Table, opts: ProfileOptions) -> list:
    """The scored eviction policies (under `opts.kv_compression`) that compressed no sequence of the
    mismatch table before its last generated token: a sequence of prompt P and G generated tokens feeds
    G - 1 of them when teacher forced, so a policy evicts something a token reads only when its first
    compression comes after fewer fed tokens (`Eviction.evicts_within`). Such a budget scores the
    dense cache, alpha 1, which says nothing about its eviction."""
    if opts.kv_compression is None or not mismatch.num_rows:
        return []
    first = mismatch.filter(pc.equal(mismatch.column("budget"), opts.budgets[0]))
    lengths = first.group_by(["prompt_id", "sample"]).aggregate([("position", "min"), ("position", "count")])
    sequences = list(zip(lengths.column("position_min").to_pylist(),
                         lengths.column("position_count").to_pylist()))
    return [mode for mode in opts.modes()
            if not any(mode.evicts_within(prompt, generated) for prompt, generated in sequences)]


def has_draft_alpha(mismatch: pa.Table) -> bool:
    """Whether a mismatch table holds a draft's alpha (profile --draft-alpha), not only its null column."""
    names = mismatch.column_names
    return "alpha_draft" in names and mismatch.column("alpha_draft").null_count < mismatch.num_rows


def profile_shard(loaded: LoadedModel, items: list, indices: list[int], opts: ProfileOptions,
                  sample: bool) -> tuple[pa.Table, Speculation | None]:
    """A Ray worker's share of `sparrow profile`: (prompt id, prompt ids, row in the file) triples sampled
    first, seeded by their rows, or trajectories -> its rows and, under --speculate, the sampling's
    speculative counts. The options carry the LoRAs' weights to the worker."""
    speculation: list[Speculation] = []
    if sample:
        ids, prompts, rows = ([item[k] for item in items] for k in range(3))
        items = sample_trajectories(loaded, ids, prompts, opts, request_ids=rows,
                                    on_speculation=speculation.append)
    return profile_trajectories(loaded, items, opts), (speculation[0] if speculation else None)


@dataclass
class ProfileRun:
    """The model a profile runs on and where its rows go: one mismatch artifact, or with `workers` a
    directory of one part per Ray worker (the driver then only tokenizes)."""

    model: str
    output: Path
    device: str = "cpu"
    dtype: str = "float32"
    random_weights: bool = False
    adapter: Path | None = None  # recorded; the adapter's weights travel in ProfileOptions.adapter
    workers: int = 0
    ray_address: str | None = None
    lora: Path | None = None  # recorded as `lora` (rollout's key); the weights travel in ProfileOptions.lora

    def metadata(self) -> dict:
        """What the artifact records of the run beside the options."""
        from sparrow.schemas import input_path

        adapter = {"adapter": input_path(self.adapter)} if self.adapter is not None else {}
        lora = {"lora": input_path(self.lora)} if self.lora is not None else {}
        return adapter | lora | {"dtype": self.dtype} | (
            {"random_weights": True} if self.random_weights else {})

    def load(self) -> LoadedModel | _TokenizerOnly:
        """The model, or with workers only its tokenizer (the weights load in the workers)."""
        import torch

        from .model.loading import load_model, spec_tokenizer

        if self.workers:
            return _TokenizerOnly(spec_tokenizer(self.model))
        return load_model(self.model, device=self.device, dtype=getattr(torch, self.dtype),
                          random_weights=self.random_weights)


@dataclass
class _TokenizerOnly:
    """What the profile needs of a LoadedModel in a driver whose workers hold the weights."""

    tokenizer: object


@dataclass
class Hooks:
    """What a caller sees of a profile run: phase progress in this process, finished Ray shards, and the
    moment the trajectories are ready (the model loaded, before any scoring)."""

    progress: Progress | None = None
    on_shard: Callable | None = None
    ready: Callable[[], None] | None = None
    loading: Callable[[], None] | None = None  # just before the weights load in this process
    speculation: OnSpeculation | None = None  # under --speculate: the sampling's counts, all shards together
    shards: Callable[[int], None] | None = None  # the Ray shards there will be, before they start


def profile_prompts(run: ProfileRun, prompt_set, source: Path, opts: ProfileOptions, chat: bool = True,
                    hooks: Hooks | None = None) -> pa.Table:
    """Sample and score the prompts of `prompt_set` (read from `source`), text through the chat template
    when `chat`; written to `run.output`, returns all rows."""
    from sparrow.schemas import input_path

    from .model.loading import spec_tokenizer

    cfg, hooks = resolve_config(run.model), hooks or Hooks()
    if prompt_set.needs_tokenizer_for(run.model):  # before weights: the tokenizer load_model returns
        tokenizer = spec_tokenizer(run.model)
        prompt_set.match_model(run.model, tokenizer, chat)
        if prompt_set.needs_tokenizer:
            prompt_set.tokenize(tokenizer, chat, run.model)
    prompt_set.check_fits(cfg.vocab_size, cfg.max_position_embeddings, opts.max_new_tokens)
    meta = opts.metadata() | {"prompts": input_path(source)} | run.metadata() | prompt_set.length_metadata()
    if prompt_set.max_prompts:
        meta["max_prompts"] = prompt_set.max_prompts
    seeds = seed_rows(prompt_set.rows)
    if run.workers:
        items = list(zip(prompt_set.ids, prompt_set.tokens, seeds))
        return _profile_on_ray(run, items, opts, True, meta, hooks)
    if hooks.loading:
        hooks.loading()
    loaded = run.load()
    counted: list[Speculation] = []
    table = run_profile(loaded, prompt_set.ids, prompt_set.tokens, opts, hooks.progress, counted.append,
                        request_ids=seeds)
    table = _write(table, run, meta | _speculation_meta(counted))
    if counted and hooks.speculation:
        hooks.speculation(counted[0])
    return table


def _speculation_meta(counted: list[Speculation]) -> dict:
    """The artifact's record of the speculative sampling (rollout's summary keys), when it ran."""
    return {"speculation": sum(counted[1:], counted[0]).metadata()} if counted else {}


def profile_rollouts(run: ProfileRun, given, source: Path, opts: ProfileOptions, hooks: Hooks | None = None
                     ) -> pa.Table:
    """Score the trajectories of a rollouts file (`given`, read from `source`); written to `run.output`,
    returns all rows."""
    from sparrow.schemas import input_path

    cfg, hooks = resolve_config(run.model), hooks or Hooks()
    from .model.loading import spec_tokenizer

    tokenizer = spec_tokenizer(run.model) if given.needs_tokenizer else None  # no weights read
    trajectories = given.trajectories(tokenizer, cfg.vocab_size, cfg.max_position_embeddings)  # checked
    # before any weights load
    if hooks.loading and not run.workers:
        hooks.loading()
    loaded = run.load()
    if hooks.ready:
        hooks.ready()
    meta = opts.metadata(sampled=False) | {"rollouts": input_path(source)} | run.metadata() | (
        {"sampler": given.sampler} if given.sampler else {}) | (
        {"speculate": given.speculate} if given.speculate else {}) | recorded_sampling(given.path)
    if run.workers:
        return _profile_on_ray(run, trajectories, opts, False, meta, hooks)
    return _write(profile_trajectories(loaded, trajectories, opts, hooks.progress), run, meta)


ROLLOUT_SAMPLING = ("top_p", "top_k", "max_new_tokens")  # how the given trajectories were drawn


def recorded_sampling(path: Path) -> dict:
    """The sampling options a rollouts artifact records (ROLLOUT_SAMPLING), kept in the profile's metadata
    as they were: they describe the trajectories it scores (another tool's file records none)."""
    from sparrow.schemas import artifact_kind, artifact_metadata

    if artifact_kind(path) != "rollouts":
        return {}
    meta = artifact_metadata(path)
    return {k: meta[k] for k in ROLLOUT_SAMPLING if meta.get(k) is not None}


def _write(table: pa.Table, run: ProfileRun, meta: dict) -> pa.Table:
    from sparrow.schemas import write_artifact

    write_artifact(table, run.output, "mismatch", metadata=meta | {"model": model_name(run.model)})
    return table


def _profile_on_ray(run: ProfileRun, items: list, opts: ProfileOptions, sample: bool, meta: dict,
                    hooks: Hooks) -> pa.Table:
    """The profile of `items` (prompts to sample, or trajectories) on a Ray pool, one mismatch part per
    shard under `run.output`, the speculative counts summed over the shards; returns all rows."""
    from sparrow.schemas import write_artifact_parts

    from .backends.ray_pool import RolloutPool

    workers = min(run.workers, len(items))  # a worker with no items would load the model for nothing
    if hooks.shards:
        hooks.shards(workers)
    pool = RolloutPool(run.model, workers, address=run.ray_address, device=run.device,
                       random_weights=run.random_weights, dtype=run.dtype)
    try:
        results = pool.map(profile_shard, items, opts, sample, on_shard=hooks.on_shard)
    finally:
        pool.close()
    counted = [r.value[1] for r in results if r.value[1] is not None]
    meta = meta | {"model": model_name(run.model)} | _speculation_meta(counted)
    tables = [r.value[0] for r in results]
    write_artifact_parts(tables, run.output, "mismatch",
                         [meta | {"part": r.shard, "parts": len(results), "worker_pid": r.worker_pid,
                                  "attempts": r.attempts} for r in results])
    if counted and hooks.speculation:
        hooks.speculation(sum(counted[1:], counted[0]))
    return pa.concat_tables(tables)
