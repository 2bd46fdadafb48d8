"""`sparrow distill` (DistillSparse, offline): the sparse actor's LoRA distilled toward the frozen dense
policy, teacher forced on trajectories, one adapter taught at every budget in turn (docs/distill.md)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import pyarrow as pa
import torch
from torch import Tensor

from sparrow.schemas import input_name, write_artifact

from .attention import DEFAULT_DENSE_LAYERS, PAGE_SIZE
from .core.definitions import DEFAULT_BIN_WIDTH, PRIOR_THRESHOLD, RESERVED_PAGES, TAIL_QUANTILE
from .core.prompt_set import PromptSet, seed_rows
from .core.schedule import Schedule
from .core.sparsity import BudgetFn, budget_fn
from .core.trajectories import RolloutsFile, Trajectory
from .model import loading
from .model.adapter import adapter_base, add_lora, load_lora_state, lora_state, save_adapter
from .model.head import POSITION_CHUNK, over_chunks, token_scores
from .model.llama import Transformer
from .model.loading import LoadedModel, resolve_config, resolve_dtype
from .model.lora import LoraWeights, adapters_disabled
from .profile import ProfileOptions, Progress, profile_trajectories, sample_trajectories, summarize
from .train.data import epoch_order
from .train.objective import k3
from .train.policy import completion_hidden
from .train.sparse_actor import JointSparseActor, SharedPromptSparse, actor_hidden

OBJECTIVES = ("kl", "k3")
PUBLISHED_LORA_ALPHA = 16.0
MAX_BUDGET_WEIGHT = 100.0
WORSE_BY = 1e-4  # an alpha drop below this is the rounding of scoring merged weights, not a worse actor


@dataclass
class DistillConfig:
    steps: int = 50
    batch_size: int = 8  # trajectories per step
    lora_rank: int = 16
    lora_alpha: float = PUBLISHED_LORA_ALPHA
    lr: float = 5e-4
    objective: str = "kl"
    temperature: float = 1.0  # the sampling temperature: logprobs and the KL use it (<= 0 counts as 1)
    seed: int = 0
    max_grad_norm: float = 1.0
    dense_layers: tuple[int, ...] = DEFAULT_DENSE_LAYERS
    page_size: int = PAGE_SIZE
    dense_cache_gib: float = 2.0  # keep the dense targets in memory up to this size, else recompute
    balance_budgets: bool = True  # weight each budget by 1 / its starting objective (module docstring)
    gradient_checkpointing: bool = False  # recompute each decoder layer in the backward pass

    def validate(self) -> DistillConfig:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        for name in ("steps", "batch_size", "lora_rank"):
            if getattr(self, name) < 1:
                flag = "--trajectories-per-step" if name == "batch_size" else f"--{name.replace('_', '-')}"
                raise ValueError(f"{flag} must be at least 1, got {getattr(self, name)}")
        for name in ("lr", "lora_alpha", "max_grad_norm"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        return self


# ---------------------------------------------------------------------------- objectives


def token_losses(objective: str, dense_logp: Tensor, actor_logp: Tensor, targets: Tensor) -> Tensor:
    """Per generated position: dense_logp / actor_logp [N, V] log-probabilities (dense has no grad),
    targets [N] the sampled tokens -> [N] loss terms."""
    if objective == "kl":
        return (dense_logp.exp() * (dense_logp - actor_logp)).sum(-1)
    if objective == "k3":
        pick = lambda lp: lp.gather(-1, targets[:, None]).squeeze(-1)
        return k3(pick(dense_logp) - pick(actor_logp))
    raise ValueError(f"unknown objective {objective!r}")


def kl_terms(model: Transformer, dense_hidden: Tensor, actor_hidden: Tensor, temperature: float,
             chunk: int = POSITION_CHUNK) -> Tensor:
    """[T] KL(dense || actor) per position from the two final hidden states [T, H] (the dense one without
    gradient), `token_losses("kl")` over chunks of positions."""
    temp = temperature if temperature > 0 else 1.0

    def terms(dense_h: Tensor, actor_h: Tensor) -> Tensor:
        actor = torch.log_softmax(model.logits(actor_h) / temp, -1)
        with torch.no_grad():
            dense = torch.log_softmax(model.logits(dense_h) / temp, -1)
        return (dense.exp() * (dense - actor)).sum(-1)

    return over_chunks(terms, dense_hidden.detach(), actor_hidden, chunk=chunk)[0]


def sampled_logprobs(model: Transformer, hidden: Tensor, tokens: Sequence[int], temperature: float) -> Tensor:
    """[T] logprobs of `tokens` from the final hidden states [T, H], over chunks of positions."""
    targets = torch.tensor(list(tokens), device=hidden.device)
    return token_scores(model.logits, hidden, targets, temperature, entropy=False).logp


# ---------------------------------------------------------------------------- training


@dataclass
class DistillResult:
    history: list[dict]  # one row per step: step, loss, grad_norm, tokens, seconds
    seconds: float  # training only (not sampling, not evaluation)
    before: pa.Table | None = None  # mismatch of the eval trajectories, plain actor
    after: pa.Table | None = None  # the same, distilled actor
    lora: LoraWeights | None = field(default=None, repr=False)
    comparison: list[dict] = field(default_factory=list)  # `tail_comparison` of before and after
    warnings: list[str] = field(default_factory=list)  # one sentence each, recorded in sparrow_distill.json


class Distiller:
    """Holds the model with the LoRA injected; `run()` trains it, `lora()` / `save()` give it back."""

    def __init__(self, loaded: LoadedModel, trajectories: Sequence[Trajectory],
                 budget_at: BudgetFn | Sequence[BudgetFn], cfg: DistillConfig,
                 init: dict[str, Tensor] | None = None, on_step: Callable[[dict], None] | None = None,
                 on_balance: Callable[[int, int], None] | None = None):
        """`on_balance` hears (done, total) of the budgets whose starting objective the balance weights
        measure (`_balance_weights`, a forward pass per budget before any step), from (0, total) on."""
        self.cfg = cfg.validate()
        self.loaded, self.model = loaded, loaded.model
        self.trajectories = [t for t in trajectories if t.completion]
        if not self.trajectories:
            raise ValueError("no trajectory has generated tokens, so there is nothing to distill on")
        self.budget_fns = [budget_at] if callable(budget_at) else list(budget_at)
        if not self.budget_fns:
            raise ValueError("give at least one budget to distill at")
        self.on_step = on_step or (lambda row: None)
        torch.manual_seed(cfg.seed)
        self.lora_config = add_lora(self.model, cfg.lora_rank, cfg.lora_alpha)
        self.model.gradient_checkpointing = cfg.gradient_checkpointing
        if init is not None:
            load_lora_state(self.model, init)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=0.0)
        tokens = sum(len(t.completion) for t in self.trajectories)
        weight = self.model.embed_tokens.weight
        per_token = self.model.cfg.hidden_size * weight.element_size() if cfg.objective == "kl" else 4
        self._cache_dense = tokens * per_token <= cfg.dense_cache_gib * 2**30
        self._dense: dict[int, Tensor] = {}
        self.weights = [1.0] * len(self.budget_fns)
        if cfg.balance_budgets and len(self.budget_fns) > 1:
            self.weights = self._balance_weights(on_balance or (lambda done, total: None))

    def _order(self, step: int) -> list[int]:
        """A step's trajectories; a batch larger than the data visits each once."""
        n, b = len(self.trajectories), self.cfg.batch_size
        return list(dict.fromkeys(epoch_order(n, self.cfg.seed, step, b)))

    @torch.no_grad()
    def dense_targets(self, idx: Sequence[int]) -> list[Tensor]:
        """The dense policy at each generated position, computed with the adapter disabled: its final
        hidden states [T, H] for kl (the dense logits are `model.logits` of them), the sampled tokens'
        logprobs [T] for k3."""
        missing = [i for i in idx if i not in self._dense]
        if missing:
            trajs = [self.trajectories[i] for i in missing]
            self.model.eval()
            with adapters_disabled(self.model):
                hidden = completion_hidden(self.model, [t.prompt for t in trajs],
                                           [t.completion for t in trajs])
            for row, (i, t) in enumerate(zip(missing, trajs)):
                h = hidden[row, : len(t.completion)].clone()
                if self.cfg.objective == "k3":
                    h = sampled_logprobs(self.model, h, t.completion, self.cfg.temperature)
                self._dense[i] = h
        out = [self._dense[i] for i in idx]
        if not self._cache_dense:
            self._dense.clear()
        return out

    def budgets_of(self, step: int, count: int) -> list[int]:
        """The budget (an index into the budget functions) of each of a step's `count` trajectory slots:
        the functions in turn."""
        m = len(self.budget_fns)
        return [(step * self.cfg.batch_size + k) % m for k in range(count)]

    def step_loss(self, idx: Sequence[int], normalizer: int, budgets: Sequence[int] | None = None,
                  backward: bool = True) -> float:
        """Forward (and backward) over the trajectories `idx` (trajectory idx[k] at budget function
        budgets[k], default the first), its terms weighted by `self.weights`, one shared prompt pass per
        prompt group; returns their share of the step's token-mean loss."""
        budgets = list(budgets) if budgets is not None else [0] * len(idx)
        groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for i, j in zip(idx, budgets, strict=True):
            groups.setdefault(tuple(self.trajectories[i].prompt), []).append((i, j))
        total = 0.0
        for prompt, pairs in groups.items():
            with torch.set_grad_enabled(backward):
                loss = self._group_loss(prompt, pairs) / normalizer
            if backward:
                loss.backward()
            total += float(loss.detach())
        return total

    def _group_loss(self, prompt: tuple[int, ...], pairs: list[tuple[int, int]]) -> Tensor:
        members = [i for i, _ in pairs]
        dense = self.dense_targets(members)
        comps = [self.trajectories[i].completion for i in members]
        hidden = actor_hidden(self.model, prompt, comps, [self.budget_fns[j] for _, j in pairs],
                              self.cfg.dense_layers, self.cfg.page_size)
        loss = hidden.new_zeros((), dtype=torch.float32)
        for row, ((_, j), c, d) in enumerate(zip(pairs, comps, dense)):
            actor = hidden[row, : len(c)]
            if self.cfg.objective == "k3":
                terms = k3(d - sampled_logprobs(self.model, actor, c, self.cfg.temperature))
            else:
                terms = kl_terms(self.model, d, actor, self.cfg.temperature)
            loss = loss + terms.sum() * self.weights[j]
        return loss

    def _balance_weights(self, progress: Callable[[int, int], None]) -> list[float]:
        """Per budget function: mean(o) / o_j, o_j the token-mean objective of the actor as it starts
        at budget j over the first 2 x batch_size trajectories of the batch order, at most
        MAX_BUDGET_WEIGHT (a budget that covers these trajectories' whole context is dense, o_j = 0).
        Called while the weights are still all 1."""
        self.model.eval()
        idx = list(dict.fromkeys(self._order(0) + self._order(1)))
        tokens = sum(len(self.trajectories[i].completion) for i in idx)
        m = len(self.budget_fns)
        progress(0, m)
        start = []
        for j in range(m):
            start.append(self.step_loss(idx, tokens, [j] * len(idx), backward=False))
            progress(j + 1, m)
        mean = sum(start) / len(start)
        if mean <= 0:
            return [1.0] * len(start)
        return [mean / max(o, mean / MAX_BUDGET_WEIGHT) for o in start]

    def train_step(self, step: int) -> dict:
        t0 = time.perf_counter()
        idx = self._order(step)
        normalizer = sum(len(self.trajectories[i].completion) for i in idx)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.step_loss(idx, normalizer, self.budgets_of(step, len(idx)))
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm))
        self.optimizer.step()
        self.model.eval()
        # named by the updates done, as a training run's rows are (step 1 is the first update)
        return {"step": step + 1, "loss": loss, "grad_norm": grad_norm, "tokens": normalizer,
                "seconds": time.perf_counter() - t0}

    def run(self) -> list[dict]:
        history = []
        for step in range(self.cfg.steps):
            row = self.train_step(step)
            history.append(row)
            self.on_step(row)
        return history

    def lora(self) -> LoraWeights:
        """The trained adapter as merge-ready weights (peft's names, our modules)."""
        return LoraWeights.from_state_dict(lora_state(self.model), self.cfg.lora_alpha, self.cfg.lora_rank)

    def save(self, folder, base_model: str, beside: Callable[[Path], None] | None = None) -> Path:
        return save_adapter(self.model, self.lora_config, folder, base_model, beside=beside)



def reads_sparsely(lengths: Iterable[tuple[int, int]], budget_fns: Sequence[BudgetFn]) -> bool:
    """Whether a taught budget reads some generated position of these (prompt, completion) lengths
    sparsely. The first token comes from the dense prefill; token j >= 1 is produced at cache length n + j,
    where block top-k at budget b keeps every page while the cache holds at most b tokens
    (attention/block_topk.py). Where none is read sparsely the actor is the dense policy."""
    return any(0 < int(f(n + j)) < n + j for n, t in lengths for j in range(1, t) for f in budget_fns)


def check_sparse(lengths: Sequence[tuple[int, int]], budget_fns: Sequence[BudgetFn], taught: str,
                 source: str, page_size: int = PAGE_SIZE) -> None:
    """Refuse, before any training, trajectories (`source`: "every ...", as (prompt, completion) lengths,
    or the longest they may be) that the taught budgets cover whole: the actor would start equal to the
    dense policy, with a zero objective, and AdamW would turn its float-noise gradient into full steps away
    from dense."""
    if not lengths or reads_sparsely(lengths, budget_fns):
        return
    longest = max(n + max(t - 1, 0) for n, t in lengths)
    smallest = RESERVED_PAGES * page_size
    fix = (f"give a --budget or --train-budgets below {longest}, or longer trajectories" if longest > smallest
           else f"give longer trajectories (even the smallest budget, {smallest}, covers these)")
    raise ValueError(f"{source} fits within the budget the actor is taught at ({taught}): the longest "
                     f"reaches at most {longest} tokens of context, so the sparse actor reads every cached "
                     f"token and equals the dense policy, with nothing to distill; {fix}")


def regression_warning(rows: Sequence[dict], folder: Path, shown: int = 3) -> str | None:
    """One sentence naming the bins and budgets of `tail_comparison` where the adapter made the sparse actor
    worse (`worse_after`), or None. The adapter is written all the same, with this sentence in its record:
    it may be worse in some cells and better in others, and whether to sample with it is the user's call."""
    worse = [r for r in rows if r["worse_after"]]
    if not worse:
        return None
    cells = "; ".join(f"bin {r['bin']} budget {r['budget']}: tail {r['tail_before']:.4g} -> "
                      f"{r['tail_after']:.4g}, mean {r['mean_before']:.4g} -> {r['mean_after']:.4g}"
                      for r in worse[:shown]) + ("; ..." if len(worse) > shown else "")
    return (f"the distilled actor is worse than the plain one in {len(worse)} of {len(rows)} bins and "
            f"budgets of the eval ({cells}), so sampling with --adapter {folder} there is farther from the "
            "dense policy than sampling without it; distill with fewer --steps, a lower --lr or more "
            "trajectories, or leave the adapter out")


def tail_comparison(before: pa.Table, after: pa.Table, quantile: float, threshold: float) -> list[dict]:
    """Per bin and budget: tokens, tail and mean alpha before and after distillation, whether the tail after
    clears `threshold`, and whether the distilled actor is worse there (`_worse`)."""
    a = {(r["bin"], r["budget"]): r for r in summarize(before, quantile, threshold).to_pylist()}
    b = {(r["bin"], r["budget"]): r for r in summarize(after, quantile, threshold).to_pylist()}
    return [{"bin": k[0], "budget": k[1], "tokens": a[k]["tokens"],
             "tail_before": a[k]["tail_alpha"], "tail_after": b[k]["tail_alpha"],
             "mean_before": a[k]["mean_alpha"], "mean_after": b[k]["mean_alpha"],
             "above_after": bool(b[k]["tail_alpha"] >= threshold), "worse_after": _worse(a[k], b[k])}
            for k in sorted(a) if k in b]


def _worse(before: dict, after: dict) -> bool:
    """Whether the distilled actor's tail or mean alpha is below the plain actor's by more than WORSE_BY."""
    return bool(after["tail_alpha"] < before["tail_alpha"] - WORSE_BY
                or after["mean_alpha"] < before["mean_alpha"] - WORSE_BY)


def _renamed(progress: Progress, name: str, _phase: str, done: int, total: int, tokens: int | None = None
             ) -> None:
    """A phase's progress under the name distill shows it by."""
    progress(name, done, total, tokens)


@dataclass
class DistillJob:
    """One distillation: the trajectories and the budget functions taught, the eval trajectories and
    budgets scored before and after, and the adapter it starts from (None: the plain sparse actor)."""

    trajectories: Sequence[Trajectory]
    budget_at: BudgetFn | Sequence[BudgetFn]
    eval_trajectories: Sequence[Trajectory]
    eval_budgets: Sequence[int]
    bin_width: int = DEFAULT_BIN_WIDTH
    init: dict[str, Tensor] | None = None  # its peft state dict
    init_actor: LoraWeights | None = None  # its merge-ready weights


def evaluate(loaded: LoadedModel, job: DistillJob, actor: LoraWeights | None, cfg: DistillConfig,
             progress: Progress | None = None) -> pa.Table:
    """The mismatch table (one row per token per budget) of the actor (None: the plain sparse actor)
    against the plain dense policy, teacher forced on the job's eval trajectories. Injected adapters are
    disabled, so a model being distilled scores as its base plus `actor`."""
    opts = ProfileOptions(budgets=list(job.eval_budgets), bin_width=job.bin_width, adapter=actor,
                          temperature=cfg.temperature, dense_layers=tuple(cfg.dense_layers),
                          page_size=cfg.page_size)
    with adapters_disabled(loaded.model):
        return profile_trajectories(loaded, job.eval_trajectories, opts, progress)


def run_distill(loaded: LoadedModel, job: DistillJob, cfg: DistillConfig,
                on_step: Callable[[dict], None] | None = None,
                on_phase: Callable[[str], None] | None = None, progress: Progress | None = None
                ) -> tuple[Distiller, DistillResult]:
    """Score the eval trajectories with the actor as it starts, distill, score them again with the
    distilled actor (`progress` hears of the scoring as "scoring before" and "scoring after", and of the
    balance weights' starting objectives, where several budgets are taught, as "balance weights", a phase
    of its own). The model keeps the LoRA injected afterwards."""
    phase = on_phase or (lambda name: None)

    def scoring(name: str) -> Progress | None:
        return None if progress is None else partial(_renamed, progress, name)

    def balancing(done: int, total: int) -> None:
        if done == 0:
            phase("balance weights")
        if progress is not None:
            progress("balance weights", done, total)

    phase("scoring before")
    before = evaluate(loaded, job, job.init_actor, cfg, scoring("scoring before"))
    distiller = Distiller(loaded, job.trajectories, job.budget_at, cfg, job.init, on_step, balancing)
    phase("distilling")
    t0 = time.perf_counter()
    history = distiller.run()
    seconds = time.perf_counter() - t0
    phase("scoring after")
    lora = distiller.lora()
    after = evaluate(loaded, job, lora, cfg, scoring("scoring after"))
    return distiller, DistillResult(history, seconds, before, after, lora)


@dataclass
class DistillRun:
    """What `sparrow distill` reads, samples and writes, beside how it trains (`DistillConfig`)."""

    model: str
    output: Path
    sparsity: Schedule | int  # the sparse actor's, which samples the training trajectories
    sampler: str  # its spec, as the artifacts store it
    eval_budgets: list[int]
    train_budgets: list[int] | None = None  # None: the sampling sparsity itself (per position)
    prompts: Path | None = None  # sampled by the sparse actor, or
    rollouts: RolloutsFile | None = None  # trajectories sampled before
    rollouts_path: Path | None = None
    eval_prompts: Path | None = None  # dense eval trajectories (None: the training ones, in-sample)
    prompt_sets: dict[Path, PromptSet] | None = None  # prompts and eval_prompts read before (None: read here)
    init_adapter: Path | None = None
    init: tuple[dict[str, Tensor], LoraWeights] | None = None  # its state dict and merge-ready weights
    samples: int = 4
    max_new_tokens: int = 64
    raw_prompts: bool = False
    bin_width: int = DEFAULT_BIN_WIDTH
    device: str = "cpu"
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    gradient_checkpointing: bool | None = None  # None: on when the model is on a CUDA device
    quantile: float = TAIL_QUANTILE  # the tail of the before/after comparison
    threshold: float = PRIOR_THRESHOLD  # what its `above_after` marks

    @property
    def taught(self) -> str | None:
        """The training budgets as the summary names them (None: the sampler's)."""
        return ",".join(map(str, self.train_budgets)) if self.train_budgets else None


@dataclass
class DistillHooks:
    on_sampling: Callable[[], None] = lambda: None  # before any are sampled (not called when none are)
    on_sampled: Callable[[list[int]], None] = lambda lengths: None  # the training completions' lengths
    on_phase: Callable[[str], None] | None = None
    on_step: Callable[[dict], None] | None = None
    on_loading: Callable[[], None] = lambda: None  # just before the weights load
    progress: Progress | None = None  # (phase, done, total) of sampling and scoring


def distill_to_folder(run: DistillRun, cfg: DistillConfig, hooks: DistillHooks) -> tuple[Path, DistillResult]:
    """`sparrow distill`: the trajectories read (before any weights load) or sampled by the sparse actor
    as it starts, the eval trajectories sampled densely, the distillation, and its folder written."""
    model_cfg = resolve_config(run.model)
    fits = (model_cfg.vocab_size, model_cfg.max_position_embeddings, run.max_new_tokens)
    taught = run.train_budgets or [run.sparsity]
    budget_fns = [budget_fn(b) for b in taught]
    trajectories = None
    if run.rollouts is not None and not run.rollouts.needs_tokenizer:
        trajectories = run.rollouts.trajectories(None, *fits[:2])
    prompt_sets = run.prompt_sets or {path: PromptSet.read(path) for path in (run.prompts, run.eval_prompts)
                                      if path is not None}
    for prompt_set in prompt_sets.values():
        if prompt_set.needs_tokenizer_for(run.model):  # ids made for another tokenizer are made again
            prompt_set.match_model(run.model, loading.spec_tokenizer(run.model), not run.raw_prompts)
        prompt_set.check_fits(*fits)
    _check_covered(run, budget_fns, trajectories, prompt_sets)  # before any weights load, where known
    hooks.on_loading()
    loaded = loading.load_model(run.model, device=run.device, dtype=resolve_dtype(run.dtype, run.device))
    on_gpu = loaded.model.embed_tokens.weight.is_cuda
    cfg.gradient_checkpointing = on_gpu if run.gradient_checkpointing is None else run.gradient_checkpointing
    for prompt_set in prompt_sets.values():
        if prompt_set.needs_tokenizer:
            prompt_set.tokenize(loaded.tokenizer, not run.raw_prompts, run.model)
            prompt_set.check_fits(*fits)
    if run.prompts is None and trajectories is None:
        trajectories = run.rollouts.trajectories(loaded.tokenizer, *fits[:2])
    _check_covered(run, budget_fns, trajectories, prompt_sets)  # text tokenized: before any sampling
    init, init_actor = run.init or (None, None)
    sampling = dict(budgets=run.eval_budgets, samples=run.samples, max_new_tokens=run.max_new_tokens,
                    temperature=cfg.temperature, gpu_memory_utilization=run.gpu_memory_utilization,
                    batch_size=16)
    if prompt_sets:
        hooks.on_sampling()
    if run.prompts is not None:  # the sparse actor as it starts samples the training trajectories
        opts = ProfileOptions(sampler=run.sampler, seed=cfg.seed, adapter=init_actor,
                              schedule=None if isinstance(run.sparsity, int) else run.sparsity, **sampling)
        train_set = prompt_sets[run.prompts]
        trajectories = sample_trajectories(loaded, train_set.ids, train_set.tokens, opts, hooks.progress,
                                           request_ids=seed_rows(train_set.rows))
        hooks.on_sampled([len(t.completion) for t in trajectories])
        _check_covered(run, budget_fns, trajectories, prompt_sets)
    eval_trajectories = trajectories
    if run.eval_prompts is not None:  # the dense policy's: the same prefixes before and after
        opts = ProfileOptions(sampler="dense", seed=cfg.seed + 1, **sampling)
        eval_set = prompt_sets[run.eval_prompts]
        progress = hooks.progress
        eval_trajectories = sample_trajectories(
            loaded, eval_set.ids, eval_set.tokens, opts,
            None if progress is None else partial(_renamed, progress, "sampling eval"),
            request_ids=seed_rows(eval_set.rows))
    job = DistillJob(trajectories, budget_fns, eval_trajectories, run.eval_budgets, run.bin_width, init,
                     init_actor)
    distiller, result = run_distill(loaded, job, cfg, hooks.on_step, hooks.on_phase, hooks.progress)
    result.comparison = tail_comparison(result.before, result.after, run.quantile, run.threshold)
    result.warnings = [w for w in [regression_warning(result.comparison, run.output)] if w]
    return save_result(distiller, result, run), result


def _check_covered(run: DistillRun, budget_fns: Sequence[BudgetFn], trajectories: Sequence[Trajectory] | None,
                   prompt_sets: dict[Path, PromptSet]) -> None:
    """`check_sparse` of what is known so far: the trajectories read or sampled, else the prompts to
    sample, each at --max-new-tokens, once they are token ids."""
    taught = run.taught or run.sampler
    if trajectories is not None:
        source = (f"every trajectory sampled from --prompts {run.prompts}" if run.prompts is not None
                  else f"every trajectory of --rollouts {run.rollouts_path}")
        lengths = [(len(t.prompt), len(t.completion)) for t in trajectories if t.completion]
        check_sparse(lengths, budget_fns, taught, source)
    elif run.prompts is not None and not prompt_sets[run.prompts].needs_tokenizer:
        lengths = [(len(p), run.max_new_tokens) for p in prompt_sets[run.prompts].tokens]
        check_sparse(lengths, budget_fns, taught, f"every prompt of --prompts {run.prompts} with "
                     f"--max-new-tokens {run.max_new_tokens}")


def save_result(distiller: Distiller, result: DistillResult, run: DistillRun) -> Path:
    """OUTPUT/: the peft adapter (adapter_config.json + adapter_model.safetensors), sparrow_distill.json
    (the run, the configuration, the loss per step, training seconds) and mismatch/before.parquet,
    mismatch/after.parquet (`mismatch` artifacts of the eval trajectories, plain and distilled actor;
    `sparrow sql --run OUTPUT` sees both in one view, `sparrow plan-schedule` plans from either)."""
    cfg = distiller.cfg
    folder = Path(run.output)
    record = {"model": run.model, "sparsity": run.sampler, "objective": cfg.objective,
              "train_budgets": run.taught or run.sampler,
              "trajectories": input_name(run.rollouts_path or run.prompts),
              "eval": input_name(run.eval_prompts) if run.eval_prompts else "training",
              "bin_width": run.bin_width, "init_adapter": str(run.init_adapter) if run.init_adapter else None,
              "config": {**asdict(cfg), "dense_layers": list(cfg.dense_layers)},
              "budget_weights": distiller.weights, "training_seconds": result.seconds,
              "history": result.history, "comparison": result.comparison, "warnings": result.warnings}
    fitted = {str(path): fits for path, prompt_set in (run.prompt_sets or {}).items()
              if (fits := prompt_set.length_metadata())}
    if fitted:  # what --max-prompt-length, --truncation or --filter-overlong-prompts did, by prompt file
        record["prompt_lengths"] = fitted
    meta = {"model": run.model, "bin_width": run.bin_width, "temperature": cfg.temperature,
            "budgets": json.dumps(sorted({int(b) for b in result.before.column("budget").to_pylist()})),
            "dense_layers": json.dumps(list(cfg.dense_layers)), "page_size": cfg.page_size}
    start = {"actor": f"sparse actor + {run.init_adapter} (the starting adapter, before distillation)",
             "init_adapter": str(run.init_adapter)} if run.init_adapter else \
        {"actor": "plain sparse actor (before distillation)"}

    def beside(tmp: Path) -> None:  # written before the folder replaces the old one: it holds all or none
        (tmp / "sparrow_distill.json").write_text(json.dumps(record, indent=2, default=str))
        write_artifact(result.before, tmp / "mismatch" / "before.parquet", "mismatch", metadata=meta | start)
        write_artifact(result.after, tmp / "mismatch" / "after.parquet", "mismatch",
                       metadata=meta | {"actor": f"sparse actor + {folder}", "adapter": str(folder)}
                       | ({"warnings": "; ".join(result.warnings)} if result.warnings else {}))

    return distiller.save(folder, adapter_base(run.model), beside)  # what AutoPeftModelForCausalLM loads


__all__ = ["OBJECTIVES", "DistillConfig", "DistillHooks", "DistillJob", "DistillResult", "DistillRun",
           "Distiller", "JointSparseActor", "SharedPromptSparse", "actor_hidden", "check_sparse",
           "distill_to_folder", "evaluate", "kl_terms", "reads_sparsely", "regression_warning", "run_distill",
           "sampled_logprobs", "save_result", "tail_comparison", "token_losses"]
