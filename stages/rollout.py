"""The `sparrow rollout` stage: the engine (or vLLM, or Ray workers) over a prompt set, written as a
`rollouts` artifact: one row per sample with its tokens, sampled-token logprobs, the budget and the KV
tokens the cache held at each token, finish reason and the task's reward; the summary compares the KV
tokens held with what dense caches would hold. Our engine in this process journals its finished
prompts beside the output, so that a stopped run continues where it stopped (rollout_journal.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa

from sparrow.kernels.ops import Backend

from .attention import DEFAULT_DENSE_LAYERS, PAGE_SIZE
from .core.fingerprints import checkpoint_path, model_files_sha256, schedule_sha256
from .core.prompt_set import seed_rows
from .core.token_budgets import mean_sparse_budget
from .engine.config import DecodeStep, EngineConfig
from .engine.engine import Engine, EngineStats
from .engine.sequence import Completion, SamplingParams
from .kv_policies import BlockTopK, Dense, Eviction, KVPolicy
from .model.loading import LoadedModel
from .model.lora import LoraWeights, lora_merged
from .model.names import model_name
from .rollout_journal import (
    MANIFEST_KEY,
    Journal,
    Manifest,
    Resumed,
    RolloutInterrupted,
    adapter_sha256,
    prompts_sha256,
)
from .tasks.base import Task
from .tasks.reward_function import reward_provenance


@dataclass
class RolloutOptions:
    """How to run the engine over a prompt set; how to sample is `sampling` (n = samples per prompt)."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_batch: int = 16
    policy: KVPolicy = field(default_factory=Dense)  # how the KV cache is read or compressed
    dense_layers: tuple[int, ...] = DEFAULT_DENSE_LAYERS
    page_size: int = PAGE_SIZE
    kernels: Backend = Backend.AUTO
    lora: LoraWeights | None = field(default=None, repr=False)
    decode_step: DecodeStep = DecodeStep.AUTO  # see Engine: CUDA graphs on CUDA
    kv_pages: int | None = None  # KV page pool (None: every sample fits at full length; smaller preempts)
    gpu_memory_utilization: float = 0.9  # on CUDA, the share of device memory the engine may take
    max_prefill_tokens: int = 8192  # tokens per prefill forward (longer prompts are chunked)
    speculate: int = 0  # exact speculative decoding: drafts per cycle (0 = off; engine/speculative.py)


@dataclass
class RolloutSummary:
    samples: int
    tokens: int
    seconds: float
    prefill_seconds: float
    decode_seconds: float
    mean_budget: float | None  # over sparse decode tokens (None: all dense)
    dense_fraction: float  # of generated tokens produced with dense attention (incl. the first)
    reward_mean: float | None
    stop_fraction: float
    reward_seconds: float | None = None  # scoring the rewards, after sampling (None: nothing was scored)
    preemptions: int = 0  # samples preempted (KV pool full) and recomputed
    kv_policy: str | None = None  # the policies of the samples ("; "-joined when several)
    kv_tokens_peak: int | None = None  # KV tokens the running samples held at the fullest decode step
    kv_tokens_mean: float | None = None  # ... on average over decode steps
    dense_kv_tokens_peak: int | None = None  # what dense caches would have held at those steps
    dense_kv_tokens_mean: float | None = None
    peak_pages: int | None = None  # pool pages in use at the fullest decode step
    compactions: int = 0  # compressions of evicting samples
    # speculative decoding: engine cycles, the samples' cycles (a sample in a cycle counts once), the tokens
    # those emitted, drafts proposed and drafts the dense model kept; None without it
    cycles: int | None = None
    sample_cycles: int | None = None
    cycle_tokens: int | None = None
    drafted_tokens: int | None = None
    accepted_drafts: int | None = None
    resumed_prompts: int | None = None  # prompts kept from the journal of an interrupted run (None: none)

    @property
    def acceptance(self) -> float | None:
        """Kept drafts / drafts proposed."""
        return self.accepted_drafts / self.drafted_tokens if self.drafted_tokens else None

    @property
    def tokens_per_cycle(self) -> float | None:
        """Tokens a sample's cycle emits on average: its kept drafts and the dense model's one (none after
        a kept stop token)."""
        if not self.sample_cycles:
            return None
        return self.cycle_tokens / self.sample_cycles

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def kv_saved(self) -> float | None:
        """1 - mean KV tokens held / mean dense KV tokens (the share of KV storage saved)."""
        if not self.kv_tokens_mean or not self.dense_kv_tokens_mean:
            return None
        return 1 - self.kv_tokens_mean / self.dense_kv_tokens_mean

    def metadata(self) -> dict[str, float | int | None]:
        """The summary as plain JSON values (None: not applicable), stored under "summary" in the
        rollouts artifact's metadata so that scripts read what `sparrow rollout` printed."""
        return {"samples": self.samples, "tokens": self.tokens, "seconds": round(self.seconds, 4),
                "prefill_seconds": round(self.prefill_seconds, 4),
                "decode_seconds": round(self.decode_seconds, 4),
                "reward_seconds": _rounded(self.reward_seconds),
                "tokens_per_s": round(self.tokens_per_s, 3), "mean_budget": self.mean_budget,
                "dense_fraction": self.dense_fraction, "stop_fraction": self.stop_fraction,
                "reward_mean": self.reward_mean, "preemptions": self.preemptions, "kv_policy": self.kv_policy,
                "kv_tokens_peak": self.kv_tokens_peak, "kv_tokens_mean": _rounded(self.kv_tokens_mean),
                "dense_kv_tokens_peak": self.dense_kv_tokens_peak,
                "dense_kv_tokens_mean": _rounded(self.dense_kv_tokens_mean),
                "kv_saved": _rounded(self.kv_saved), "peak_pages": self.peak_pages,
                "compactions": self.compactions,
                **({} if self.drafted_tokens is None else {
                    "speculative_cycles": self.cycles, "sample_cycles": self.sample_cycles,
                    "drafted_tokens": self.drafted_tokens,
                    "accepted_drafts": self.accepted_drafts, "acceptance": _rounded(self.acceptance),
                    "tokens_per_cycle": _rounded(self.tokens_per_cycle)}),
                **({} if self.resumed_prompts is None else {"resumed_prompts": self.resumed_prompts})}


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def run_rollouts(loaded: LoadedModel, rows: Seq[dict], opts: RolloutOptions,
                 on_step: Callable[[int, int], None] | None = None,
                 request_ids: Seq[int] | None = None,
                 on_scored: Scored | None = None) -> tuple[pa.Table, RolloutSummary]:
    """`rows`: prompts-artifact rows with `prompt_id` and `prompt_token_ids` (and optionally `task`,
    `answer`, `metadata` for the reward). `request_ids`: the rows' indices in the whole prompt set when
    `rows` is a shard of it (they seed the samples; default 0, 1, ...). `on_scored(done, total)`: the
    rewards' progress once sampling is done."""
    with Engine(loaded.model, opts.policy, engine_config(opts)) as engine, \
            lora_merged(loaded.model, opts.lora):
        results = engine.generate([r["prompt_token_ids"] for r in rows], opts.sampling, on_step,
                                  request_ids=seed_rows(rows, request_ids))
    out, items = sample_columns(rows, results, loaded.tokenizer)
    seconds = score_rewards(out, items, on_scored)
    return pa.table(out), summarize(out, engine.stats, seconds)


def engine_config(opts: RolloutOptions) -> EngineConfig:
    """The `EngineConfig` of rollout options."""
    return EngineConfig(max_batch=opts.max_batch, page_size=opts.page_size, dense_layers=opts.dense_layers,
                        kernels=opts.kernels, decode_step=opts.decode_step, num_pages=opts.kv_pages,
                        gpu_memory_utilization=opts.gpu_memory_utilization,
                        max_prefill_tokens=opts.max_prefill_tokens, speculate=opts.speculate)


Scored = Callable[[int, int], None]  # (samples scored, samples to score)


@dataclass(frozen=True)
class RewardItem:
    """A sample to reward: its row in the columns and what its task's scorer reads."""

    index: int
    task: str
    text: str
    answer: str | None
    metadata: str | dict | None


def rollout_columns(rows: Seq[dict], results: Seq[Seq[Completion]], tokenizer,
                    on_scored: Scored | None = None) -> dict[str, list]:
    """The rollouts artifact's columns from the completions of each prompt row, whichever sampler made
    them (our engine, or vLLM in backends/vllm_sampler.py): decoded text and the reward of the row's task
    (or of the reward the command named), with any extra fields a user's reward function returned."""
    return scored_columns(rows, results, tokenizer, on_scored)[0]


def scored_columns(rows: Seq[dict], results: Seq[Seq[Completion]], tokenizer, on_scored: Scored | None = None
                   ) -> tuple[dict[str, list], float | None]:
    """`rollout_columns`, and the seconds scoring took (None: nothing was scored)."""
    out, items = sample_columns(rows, results, tokenizer)
    return out, score_rewards(out, items, on_scored)


def sample_columns(rows: Seq[dict], results: Seq[Seq[Completion]], tokenizer
                   ) -> tuple[dict[str, list], list[RewardItem]]:
    """The columns with every reward still null, and the samples a scorer rewards (`score_rewards`)."""
    from .tasks import get_task, has_scorer

    out = {k: [] for k in ("prompt_id", "sample", "prompt_token_ids", "token_ids", "text", "logprobs",
                           "budgets", "finish_reason", "reward", "kv_policy", "kv_lens", "reward_extra",
                           "accepted", "drafted")}
    items = []
    for row, completions in zip(rows, results):
        scorer = get_task(row["task"]) if has_scorer(row.get("task")) else None
        for c in completions:
            text = tokenizer.decode(c.token_ids, skip_special_tokens=True) if tokenizer is not None else None
            if (item := _reward_item(row, scorer, len(out["reward"]), text, c.token_ids)) is not None:
                items.append(item)
            out["prompt_id"].append(row["prompt_id"])
            out["sample"].append(c.sample)
            out["prompt_token_ids"].append(c.prompt_token_ids)
            out["token_ids"].append(c.token_ids)
            out["text"].append(text)
            out["logprobs"].append([min(0.0, x) for x in c.logprobs])
            out["budgets"].append(c.budgets)
            out["finish_reason"].append(c.finish_reason)
            out["reward"].append(None)
            out["kv_policy"].append(c.policy)
            out["kv_lens"].append(c.kv_lens)
            out["reward_extra"].append(None)
            out["accepted"].append(c.accepted)
            out["drafted"].append(None if c.accepted is None else c.drafted)
    return out, items


def _reward_item(row: dict, scorer: Task | None, index: int, text: str | None,
                 token_ids: Seq[int] | None) -> RewardItem | None:
    """The sample at `index` of the columns to reward (its token ids in its metadata, for a user's TRL
    function), or None when its task has no scorer, it has no text, or its scorer needs the answer that the
    row lacks."""
    from .tasks import with_completion_ids

    if text is None or scorer is None or (row.get("answer") is None and scorer.needs_answer):
        return None
    return RewardItem(index, row["task"], text, row.get("answer"),
                      with_completion_ids(row.get("metadata"), token_ids))


def unscored_columns(rows: Seq[dict], results: Seq[Seq[Completion]], tokenizer) -> dict[str, list]:
    """The rollouts columns of the completions of each prompt row, every reward null (`score_table` scores
    them)."""
    return sample_columns(rows, results, tokenizer)[0]


def score_table(rows: Seq[dict], table: pa.Table, on_scored: Scored | None = None
                ) -> tuple[pa.Table, float | None]:
    """A rollouts table (of the rollouts schema) with its rewards, and a user's function's extra fields,
    scored from its text as `sample_columns` and `score_rewards` score them; `rows[k]` is the prompt row of
    the table's row k. The seconds scoring took too (None: nothing was scored)."""
    from .tasks import get_task, has_scorer

    n = table.num_rows
    out = {"prompt_id": table.column("prompt_id").to_pylist(), "reward": [None] * n,
           "reward_extra": [None] * n}
    items = []
    texts, token_ids = table.column("text").to_pylist(), table.column("token_ids").to_pylist()
    for index, (row, text, ids) in enumerate(zip(rows, texts, token_ids)):
        scorer = get_task(row["task"]) if has_scorer(row.get("task")) else None
        if (item := _reward_item(row, scorer, index, text, ids)) is not None:
            items.append(item)
    seconds = score_rewards(out, items, on_scored)
    for name in ("reward", "reward_extra"):
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(i), pa.array(out[name], table.schema.field(i).type))
    return table, seconds


def score_rewards(out: dict[str, list], items: Seq[RewardItem], on_scored: Scored | None = None
                  ) -> float | None:
    """Fill the reward (and a user's function's extra fields) of each item into `out`; the seconds it
    took (None: nothing to score). The items are judged in chunks of whole prompts, each at least as
    large as the reward pool, so that `on_scored` hears of a slow reward as it goes, code rewards still
    fill their pool and a batch reward (TRL's) still sees every sample of a prompt at once."""
    from .tasks import judge_batch, reward_workers
    from .tasks.extras import extra_json

    if not items:
        return None
    start, done = time.perf_counter(), 0
    if on_scored is not None:
        on_scored(0, len(items))
    for chunk in _prompt_chunks(items, out["prompt_id"], reward_workers()):
        judged = judge_batch([(it.task, it.text, it.answer, it.metadata) for it in chunk])
        for it, j in zip(chunk, judged):
            out["reward"][it.index] = j.reward
            out["reward_extra"][it.index] = extra_json(j.extra, it.task, out["prompt_id"][it.index],
                                                       it.metadata)
        done += len(chunk)
        if on_scored is not None:
            on_scored(done, len(items))
    return time.perf_counter() - start


def _prompt_chunks(items: Seq[RewardItem], prompt_ids: list, size: int) -> list[list[RewardItem]]:
    """`items` in order, cut only where the prompt changes, each chunk at least `size` items (but the
    last)."""
    chunks: list[list[RewardItem]] = []
    for it in items:
        full = bool(chunks) and len(chunks[-1]) >= size
        if not chunks or (full and prompt_ids[it.index] != prompt_ids[chunks[-1][-1].index]):
            chunks.append([])
        chunks[-1].append(it)
    return chunks


def summarize(out: dict, stats: EngineStats, reward_seconds: float | None = None) -> RolloutSummary:
    budgets = np.concatenate([np.asarray(b, dtype=np.int64) for b in out["budgets"]] or [np.zeros(0)])
    rewards = [r for r in out["reward"] if r is not None]
    n = len(out["sample"])
    policies = sorted({p for p in out.get("kv_policy", []) if p is not None})
    steps = getattr(stats, "decode_steps", 0)
    kv = {"peak_pages": stats.peak_pages} if steps else {}
    if steps:  # a speculative run counts its cycles' dense caches
        kv |= {"kv_tokens_peak": stats.kv_tokens_peak, "kv_tokens_mean": stats.kv_tokens_sum / steps,
               "dense_kv_tokens_peak": stats.dense_kv_tokens_peak,
               "dense_kv_tokens_mean": stats.dense_kv_tokens_sum / steps}
    return RolloutSummary(
        samples=n, tokens=int(budgets.size), seconds=stats.seconds, prefill_seconds=stats.prefill_s,
        decode_seconds=stats.decode_s, mean_budget=mean_sparse_budget(budgets),
        dense_fraction=float((budgets == 0).mean()) if budgets.size else 1.0,
        reward_mean=float(np.mean(rewards)) if rewards else None, reward_seconds=reward_seconds,
        stop_fraction=sum(f == "stop" for f in out["finish_reason"]) / max(n, 1),
        preemptions=stats.preemptions, kv_policy="; ".join(policies) or None,
        compactions=getattr(stats, "compactions", 0), **kv, **_speculation(stats))


def summary_columns(table: pa.Table) -> dict[str, list]:
    """The columns of a rollouts table that `summarize` counts."""
    return {k: table.column(k).to_pylist()
            for k in ("budgets", "reward", "finish_reason", "sample", "kv_policy")}


def _speculation(stats) -> dict:
    if not getattr(stats, "speculative", False):
        return {}
    return {"cycles": stats.decode_steps, "sample_cycles": stats.sample_cycles,
            "cycle_tokens": stats.cycle_tokens, "drafted_tokens": stats.drafted_tokens,
            "accepted_drafts": stats.accepted_drafts}


@dataclass
class RolloutRun:
    """Where a run's rollouts go and what their artifact records beside the rows."""

    model: str
    prompts: Path
    sparsity: str  # how the run names its sparsity in the metadata
    output: Path
    device: str = "cpu"
    dtype: str = "float32"
    lora: Path | None = None
    workers: int = 0  # Ray workers (0: this process)
    ray_address: str | None = None
    reward: str | None = None  # --reward (math | code); None with reward_fn: each prompt's own task scorer
    reward_fn: str | None = None  # --reward-fn path.py:function, as given
    reward_kwargs: dict | None = None  # --reward-kwargs, passed to reward_fn's every call
    raw_prompts: bool = False  # text prompts tokenized as they are, without the chat template
    resume: bool = False  # continue the journal an interrupted run left (OUT.partial/)
    force: bool = False  # a journal that holds finished prompts is started over (without `resume`)
    checkpoint_interval: float = 60.0  # seconds between the journal's parts (0: as prompts finish)

    def metadata(self, sampling: SamplingParams, prompt_set, engine: str = "ours") -> dict:
        """What the artifact records of the run; `prompt_digests` for the prompts read as text or chat
        messages (`PromptSet.digests`), which `sparrow reward` checks a prompts file against. What scored
        the rewards is recorded under train's config keys (`reward_provenance`)."""
        from sparrow.schemas import input_path

        digests = prompt_set.digests()
        return {"model": model_name(self.model), "prompts": input_path(self.prompts),
                **({"max_prompts": prompt_set.max_prompts} if prompt_set.max_prompts else {}),
                **prompt_set.length_metadata(),
                **({"prompt_digests": digests} if digests else {}),
                "sparsity": self.sparsity, "samples": sampling.n, "max_new_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                "seed": sampling.seed, "ignore_eos": sampling.ignore_eos, "page_size": PAGE_SIZE,
                "device": self.device, "dtype": self.dtype, "engine": engine,
                "lora": input_path(self.lora) if self.lora else "", "raw_prompts": self.raw_prompts,
                **reward_provenance(self.reward, self.reward_fn, self.reward_kwargs)}


def prompt_rows(prompt_set, tokenizer, chat: bool, opts: RolloutOptions, model: str) -> list[dict]:
    """The prompt set's rows, text (and ids made by another model's tokenizer: `PromptSet.match_model`)
    tokenized (through the chat template when `chat`), checked against the model's vocabulary and context
    and, with `opts.kv_pages`, against the pool."""
    from .model.loading import resolve_config

    prompt_set.match_model(model, tokenizer, chat)
    if prompt_set.needs_tokenizer:
        cfg = resolve_config(model)
        prompt_set.tokenize(tokenizer, chat, model)
        prompt_set.check_fits(cfg.vocab_size, cfg.max_position_embeddings, opts.sampling.max_new_tokens)
    check_kv_pages(opts, prompt_set.rows)
    return prompt_set.rows


def check_kv_pages(opts: RolloutOptions, rows: list[dict]) -> None:
    """One sample of the longest prompt at full length (a compressed cache's longest, under eviction)
    must fit in a pool of `opts.kv_pages`."""
    from .engine.memory import PoolTooSmall, Workload

    if opts.kv_pages is None:
        return
    longest, new = max(len(r["prompt_token_ids"]) for r in rows), opts.sampling.max_new_tokens
    work = [(longest, 1, new) + ((opts.policy,) if isinstance(opts.policy, Eviction) else ())]
    need = Workload.of(work, 1, opts.page_size).one_sample()
    if need > opts.kv_pages:
        raise PoolTooSmall(f"--kv-pages {opts.kv_pages} is too small: one sample of the longest prompt "
                           f"({longest} tokens) with --max-new-tokens {new} needs {need} pages")


def write_rollouts(run: RolloutRun, prompt_set, opts: RolloutOptions, chat: bool = True,
                   on_step: Callable[[int, int], None] | None = None,
                   on_loading: Callable[[int], None] | None = None,
                   on_scored: Scored | None = None,
                   on_tokenizing: Callable[[int], None] | None = None,
                   on_resume: Callable[[Resumed], None] | None = None) -> tuple[pa.Table, RolloutSummary]:
    """`run_rollouts` of the prompt set in this process, written to `run.output` with the summary in its
    metadata, its finished prompts journaled in `OUT.partial/` as it goes (`run_journaled`; none for
    stdout). The prompts are tokenized (`on_tokenizing(count)` first, when some need it) and checked
    against the pool and, with `run.resume`, against the journal (`on_resume` hears what it keeps) before
    the weights load (`on_loading(longest prompt's tokens)` is called just before, as the first engine step
    prefills such prompts before any progress); `on_scored` follows the rewards."""
    import torch

    from sparrow.schemas import ArtifactError, write_artifact
    from sparrow.schemas.locations import is_stdio

    from .model.loading import load_model
    from .tasks.tokenizers import load_model_tokenizer

    tokenizer = load_model_tokenizer(run.model) if prompt_set.needs_tokenizer_for(run.model) else None
    if tokenizer is not None and on_tokenizing is not None:
        on_tokenizing(len(prompt_set.rows))
    rows = prompt_rows(prompt_set, tokenizer, chat, opts, run.model)
    meta = run.metadata(opts.sampling, prompt_set)
    if is_stdio(run.output):
        if on_loading is not None:
            on_loading(max((len(r["prompt_token_ids"]) for r in rows), default=0))
        loaded = load_model(run.model, device=run.device, dtype=getattr(torch, run.dtype))
        table, summary = run_rollouts(loaded, rows, opts, on_step, on_scored=on_scored)
        write_artifact(table, run.output, "rollouts", metadata={**meta, "summary": summary.metadata()})
        return table, summary
    manifest = run_manifest(run, opts, rows)
    journal, notes = Journal.open(run.output, manifest, rows, run.resume, run.force, run.checkpoint_interval,
                                  meta)
    meta = {**meta, MANIFEST_KEY: manifest.record()}  # so that a --resume after the end finds it complete
    if on_resume is not None and run.resume:
        on_resume(Resumed(journal.folder, journal.kept_prompts, len(rows), notes,
                          journal.unscored_prompts))
    completed = False
    try:
        journal.start()
        loaded = None
        if journal.todo:
            if on_loading is not None:
                on_loading(max(len(rows[i]["prompt_token_ids"]) for i in journal.todo))
            loaded = load_model(run.model, device=run.device, dtype=getattr(torch, run.dtype))
        table, summary = run_journaled(loaded, journal, opts, on_step, on_scored)
        try:
            write_artifact(table, run.output, "rollouts", metadata={**meta, "summary": summary.metadata()})
        except ArtifactError as e:  # a full disk after the sampling: the journal holds every prompt
            raise ArtifactError(f"{e}; the journal {journal.folder}/ keeps all {len(rows)} prompts, so once "
                                "it can be written, run the same command with --resume") from None
        completed = True
    except RolloutInterrupted:
        raise
    except KeyboardInterrupt:
        raise journal.interrupted() from None
    finally:
        journal.close(completed)
    return table, summary


def run_manifest(run: RolloutRun, opts: RolloutOptions, rows: Seq[dict]) -> Manifest:
    """The identity of a run of these tokenized prompt rows, as its journal records it."""
    import torch

    s, policy = opts.sampling, opts.policy
    schedule = policy.schedule if isinstance(policy, BlockTopK) else None
    model_files = model_files_sha256(checkpoint_path(run.model))
    digest = prompts_sha256(rows, task=not (run.reward or run.reward_fn))  # a reward's name is no prompt's
    return Manifest(model=model_name(run.model), prompts=len(rows), prompts_sha256=digest,
                    samples=s.n, max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                    top_k=s.top_k, seed=s.seed, ignore_eos=s.ignore_eos, kv_policy=policy.spec(),
                    schedule_sha256=schedule_sha256(schedule), dense_layers=tuple(opts.dense_layers),
                    page_size=opts.page_size, speculate=opts.speculate, dtype=run.dtype, device=run.device,
                    adapter_sha256=adapter_sha256(opts.lora),
                    **reward_provenance(run.reward, run.reward_fn, run.reward_kwargs),
                    raw_prompts=run.raw_prompts, model_files_sha256=model_files,
                    threads=torch.get_num_threads(), max_batch=opts.max_batch, kv_pages=opts.kv_pages,
                    max_prefill_tokens=opts.max_prefill_tokens)


def run_journaled(loaded: LoadedModel | None, journal: Journal, opts: RolloutOptions,
                  on_step: Callable[[int, int], None] | None = None, on_scored: Scored | None = None
                  ) -> tuple[pa.Table, RolloutSummary]:
    """`run_rollouts` of the journal's prompts still to do (`loaded` may be None when there are none),
    seeded by their row indices, each prompt journaled once its samples finish, after the kept prompts that
    an interrupt journaled unscored are scored (not sampled again); the table holds every row (the kept
    ones too) in prompt order, and the summary counts them all, with the engine time of the kept parts
    and of this run."""
    todo, rows = journal.todo, journal.rows
    stats = EngineStats(speculative=opts.speculate > 0)
    journal.score_kept(score_table, on_scored)
    if todo:
        with Engine(loaded.model, opts.policy, engine_config(opts)) as engine, \
                lora_merged(loaded.model, opts.lora):
            columns = partial(unscored_columns, tokenizer=loaded.tokenizer)
            with journal.recording(lambda: engine.stats, columns, score_table, on_step, on_scored) as step:
                seeds = seed_rows([rows[i] for i in todo], todo)  # the journal names rows by position
                position = dict(zip(seeds, todo))
                engine.generate([rows[i]["prompt_token_ids"] for i in todo], opts.sampling, step,
                                request_ids=seeds,
                                on_prompt=lambda seed, done: journal.finished(position[seed], done))
        stats = engine.stats
    table, reward_seconds = journal.result()
    summary = summarize(summary_columns(table), journal.stats(stats), reward_seconds)
    return table, replace(summary, resumed_prompts=journal.kept_prompts or None)


def rollout_shard(loaded: LoadedModel, rows: list[dict], indices: list[int], opts: RolloutOptions
                  ) -> tuple[pa.Table, RolloutSummary]:
    """A Ray worker's share of `sparrow rollout`: its rows, seeded by their indices in the whole set."""
    return run_rollouts(loaded, rows, opts, request_ids=indices)


def write_rollouts_on_ray(run: RolloutRun, prompt_set, opts: RolloutOptions, chat: bool = True,
                          on_shard: Callable | None = None) -> tuple[RolloutSummary, int]:
    """Rollouts of the prompt set on `run.workers` Ray workers (this process only tokenizes), one part
    per shard under `run.output`; (summary, rows)."""
    from sparrow.schemas import write_artifact_parts

    from .backends.ray_pool import RolloutPool
    from .model.loading import spec_tokenizer

    tokenizer = spec_tokenizer(run.model) if prompt_set.needs_tokenizer_for(run.model) else None
    rows = prompt_rows(prompt_set, tokenizer, chat, opts, run.model)
    pool = RolloutPool(run.model, run.workers, address=run.ray_address, device=run.device, dtype=run.dtype)
    try:
        start = time.perf_counter()
        results = pool.map(rollout_shard, rows, opts, on_shard=on_shard)
        summary = merge_summaries(results, time.perf_counter() - start)
        meta = run.metadata(opts.sampling, prompt_set)
        parts_meta = [{**meta, "summary": summary.metadata(), "part": r.shard, "parts": len(results),
                       "part_summary": r.summary.metadata(), "worker_pid": r.worker_pid,
                       "attempts": r.attempts} for r in results]
        write_artifact_parts([r.table for r in results], run.output, "rollouts", parts_meta)
    finally:
        pool.close()
    return summary, sum(r.table.num_rows for r in results)


def write_rollouts_with_vllm(prompt_set, sampling: SamplingParams, run: RolloutRun, max_batch: int,
                             chat: bool = True, on_scored: Scored | None = None):
    """Dense sampling with vLLM into the same rollouts artifact (budget 0 for every token); the prompts
    are tokenized with the checkpoint's tokenizer when they are text. (table, summary, vLLM timing)."""
    from sparrow.schemas import write_artifact

    from .backends.vllm_sampler import VllmSampler, vllm_checkpoint
    from .model.loading import resolve_config, spec_tokenizer

    cfg, checkpoint = resolve_config(run.model), vllm_checkpoint(run.model)
    tokenizer = spec_tokenizer(str(checkpoint))
    prompt_set.match_model(run.model, tokenizer, chat)
    if prompt_set.needs_tokenizer:
        prompt_set.tokenize(tokenizer, chat, run.model)
        prompt_set.check_fits(cfg.vocab_size, cfg.max_position_embeddings, sampling.max_new_tokens)
    rows = prompt_set.rows
    longest = max(len(r["prompt_token_ids"]) for r in rows)
    sampler = VllmSampler(checkpoint, dtype=run.dtype, seed=sampling.seed, max_batch=max_batch,
                          max_model_len=min(cfg.max_position_embeddings, longest + sampling.max_new_tokens),
                          eos_ids=cfg.eos_token_ids)
    out, items = sample_columns(rows, sampler.generate([r["prompt_token_ids"] for r in rows], sampling),
                                tokenizer)
    reward_seconds = score_rewards(out, items, on_scored)
    t = sampler.timing
    summary = summarize(out, EngineStats(prefill_s=t.prefill_s, decode_s=t.seconds - t.prefill_s),
                        reward_seconds)
    table = pa.table(out)
    meta = run.metadata(sampling, prompt_set, engine="vllm") | {
        "top_p": 1.0, "top_k": 0, "seed_scope": "vLLM global seed (per-request seeds fail on the CPU)",
        "lora": "", "vllm_startup_seconds": round(t.startup_s, 2), "summary": summary.metadata()}
    write_artifact(table, run.output, "rollouts", metadata=meta)
    return table, summary, t


def merge_summaries(results: Seq, wall_seconds: float) -> RolloutSummary:
    """One summary over the shards' (table, summary) results: counts and reward over every part;
    `seconds` is the wall-clock time of the parallel run (so tokens/s is the pool's throughput) and
    prefill, decode and reward seconds are summed over workers. A part without rows (a worker given no
    prompts) counts nothing, whatever its columns' types."""
    tables = [r.table for r in results]
    cols = summary_columns(pa.concat_tables([t for t in tables if t.num_rows] or tables[:1]))
    scored = [r.summary.reward_seconds for r in results if r.summary.reward_seconds is not None]
    merged = summarize(cols, _Stats(sum(r.summary.prefill_seconds for r in results),
                                    sum(r.summary.decode_seconds for r in results),
                                    sum(r.summary.preemptions for r in results),
                                    sum(r.summary.compactions for r in results)),
                       sum(scored) if scored else None)
    # each worker has its own pool: the KV held is each pool's, so the peaks and means are the largest
    # worker's (a sum over pools that never ran at the same step would mean nothing)
    kv = {k: max((getattr(r.summary, k) for r in results if getattr(r.summary, k) is not None), default=None)
          for k in ("kv_tokens_peak", "kv_tokens_mean", "dense_kv_tokens_peak", "dense_kv_tokens_mean",
                    "peak_pages")}
    spec = {k: sum(getattr(r.summary, k) or 0 for r in results)
            for k in ("cycles", "sample_cycles", "cycle_tokens", "drafted_tokens", "accepted_drafts")
            } if any(r.summary.drafted_tokens is not None for r in results) else {}
    return replace(merged, seconds=wall_seconds, **kv, **spec)


@dataclass
class _Stats:
    prefill_s: float
    decode_s: float
    preemptions: int
    compactions: int = 0

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s
