"""Sparrow's sampler inside TRL's `GRPOTrainer`, through its `rollout_func` hook (docs/trl.md).

    rollout = SparseRollout("schedule:run/schedule.parquet", bin_width=512)
    trainer = GRPOTrainer(model=model, reward_funcs=rollout.with_metrics(reward), args=config,
                          train_dataset=data, processing_class=tokenizer, rollout_func=rollout)

Decisions:
- TRL calls `rollout_func(prompts, trainer)` with this process's prompts, each already repeated
  `num_generations` times. They are tokenized as TRL's own generation tokenizes them (`tokenize_prompts`),
  which `sparrow rollout`/`train` also follow (`core.prompt_set`); consecutive copies of a prompt become
  one engine request of n samples (one prefill), one completion per prompt.
- The engine runs our decoder, built at the first call from the trainer's model (its config and weights,
  LoRA merged: base + delta of every peft layer, the trainer's model untouched). Its weights are copied
  again whenever `trainer.state.global_step` moved since the last copy, the check TRL makes before a vLLM
  generation, so every rollout samples with the weights of the latest optimizer step.
- Mismatch: our dense, teacher-forced scores of the sampled tokens with the same weights give alpha's
  top-20 lower bound per token (as `sparrow train` computes it), reported per position bin.
- TRL has no hook for a rollout function to log metrics; its public channel is the `log_metric` keyword
  it passes reward functions, so `with_metrics(reward)` wraps one reward function to log them.
- `speculate=K`: the sparsity only drafts and the dense model verifies (engine/speculative.py), so the
  completions are the dense policy's with its logprobs, and `sparrow/draft_acceptance` is logged instead
  of a mismatch there is none of.
- Sampling settings: GRPOConfig's max_completion_length, temperature, top_p and top_k, with
  `generation_kwargs` applied on top of them as TRL applies them to its own generation; of its keys
  max_new_tokens (transformers' name) or max_tokens (vLLM's), temperature, top_p and top_k are applied,
  and any other is refused rather than ignored. A temperature there is the sampling temperature, at which
  the dense scores behind the mismatch metrics and the correction are computed too. max_completion_length
  None is refused unless generation_kwargs gives the length: a completion "up to the context" would size
  every rollout by the model's whole context window.
- Correction: TRL corrects the sampler's mismatch only for vLLM. The trainer's own settings
  (`vllm_importance_sampling_correction`, a `*_mask` mode, `..._clip_min/max`) are applied here to
  our samples instead, as `env_mask`, the per-token loss mask a rollout function may return; the
  `*_truncate` modes need per-token weights, which a rollout function cannot return, and are refused.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import Tensor, nn

from ..core.definitions import TAIL_QUANTILE
from ..core.sparsity import Sparsity, as_policy
from ..core.token_budgets import dense_alpha_is_one, mean_sparse_budget, token_positions
from ..engine import Completion, Engine, EngineConfig, SamplingParams, draft_acceptance
from ..model.config import ModelConfig
from ..model.llama import Transformer, hf_to_ours
from ..model.loading import build_model, resolve_dtype
from ..train.objective import k3
from ..train.policy import completion_logprobs

TOP_LOGPROBS = 20
MASK_MODES = ("token_mask", "sequence_mask")
# generation_kwargs keys applied (transformers' and vLLM's names) -> SamplingParams' field
GENERATION_KWARGS = {"max_new_tokens": "max_new_tokens", "max_tokens": "max_new_tokens",
                     "temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}


def trl_sampling(args) -> SamplingParams:
    """The sampling a `GRPOConfig` asks for: its max_completion_length, temperature, top_p and top_k, with
    the supported keys of its `generation_kwargs` on top (one sentence for any other key, or a bad value)."""
    extra: Mapping = getattr(args, "generation_kwargs", None) or {}
    if not isinstance(extra, Mapping):
        raise ValueError(f"generation_kwargs must be a dict, got {type(extra).__name__}")
    unknown = [k for k in extra if k not in GENERATION_KWARGS]
    if unknown:
        raise ValueError(f"SparseRollout applies generation_kwargs' {', '.join(GENERATION_KWARGS)} only; "
                         f"remove {', '.join(map(repr, unknown))}")
    settings = {"max_new_tokens": args.max_completion_length, "temperature": args.temperature,
                "top_p": args.top_p, "top_k": args.top_k}
    given = {}
    for key, value in extra.items():
        name = GENERATION_KWARGS[key]
        if name in given and given[name][1] != value:
            raise ValueError(f"generation_kwargs gives {given[name][0]}={given[name][1]!r} and "
                             f"{key}={value!r}; give one")
        if isinstance(value, bool) or not isinstance(value, int | float) or \
                (name in ("max_new_tokens", "top_k") and not isinstance(value, int)):
            kind = "an integer" if name in ("max_new_tokens", "top_k") else "a number"
            raise ValueError(f"generation_kwargs[{key!r}] must be {kind}, got {value!r}")
        given[name] = (key, value)
        settings[name] = value
    if settings["max_new_tokens"] is None:
        raise ValueError("SparseRollout needs a completion length: set max_completion_length (or "
                         "generation_kwargs' max_new_tokens), as None would size every rollout by the "
                         "model's whole context")
    top_k = settings["top_k"]
    try:
        return SamplingParams(max_new_tokens=int(settings["max_new_tokens"]),
                              temperature=float(settings["temperature"]),
                              top_p=1.0 if settings["top_p"] is None else float(settings["top_p"]),
                              top_k=0 if top_k is None or top_k == -1 else int(top_k))  # -1: vLLM's off
    except ValueError as e:
        raise ValueError(f"GRPOConfig's sampling settings: {e}") from None


@dataclass(frozen=True)
class MaskCorrection:
    """TRL's masked importance sampling: a token (token_mask) or a whole sequence (sequence_mask, the ratio
    being exp of its summed token log-ratios) whose ratio p_dense / p_sampler falls outside [low, high]
    leaves the loss."""

    mode: str
    low: float | None
    high: float | None

    @classmethod
    def from_trl(cls, args) -> MaskCorrection | None:
        """The correction a `GRPOConfig` asks for (None: none)."""
        if not getattr(args, "vllm_importance_sampling_correction", False):
            return None
        mode = args.vllm_importance_sampling_mode
        if mode not in MASK_MODES:
            modes = " or ".join(MASK_MODES)
            raise ValueError(f"vllm_importance_sampling_mode={mode!r} reweights tokens, which a rollout "
                             f"function cannot do in TRL; SparseRollout applies {modes} (set one), or set "
                             "vllm_importance_sampling_correction=False")
        return cls(mode, args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max)

    def keep(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        """[N, T] bool: the tokens that stay in the loss (log_ratio = logp_dense - logp_sampler)."""
        d = torch.where(mask, log_ratio, 0.0)
        if self.mode == "sequence_mask":
            d = d.sum(1, keepdim=True).expand_as(d)
        ratio = d.exp()
        ok = torch.ones_like(mask)
        if self.low is not None:
            ok &= ratio >= self.low
        if self.high is not None:
            ok &= ratio <= self.high
        return ok & mask


@dataclass
class RolloutRecord:
    """One call of the rollout function: what TRL was given, with the mismatch of every token."""

    step: int  # trainer.state.global_step when it sampled
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]  # the sampler's, of each sampled token
    budgets: list[list[int]]  # the budget each token was sampled at (0: dense)
    logp_dense: list[list[float]]  # our dense teacher-forced logprobs with the same weights
    alpha_lb: list[list[float]]  # alpha's top-20 lower bound per token
    env_mask: list[list[int]] | None  # 1: the token stays in the loss (with a correction)
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # sync, generate, score


def merged_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(Hugging Face parameter name, the weight the model computes with) of a transformers model or a peft
    model around one: a LoRA layer's base weight plus the delta of its active adapters, nothing modified."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    tuners = {name: m for name, m in base.named_modules() if isinstance(m, BaseTunerLayer)}
    for name, m in tuners.items():
        layer = m.get_base_layer()
        weight = layer.weight
        if not m.merged and not m.disable_adapters:
            for adapter in m.active_adapters:
                if getattr(m, "use_dora", {}).get(adapter):
                    raise ValueError(f"{name}: a DoRA adapter rescales the weight; only plain LoRA is merged")
                weight = weight + m.get_delta_weight(adapter)
        yield f"{name}.weight", weight
        if getattr(layer, "bias", None) is not None:
            yield f"{name}.bias", layer.bias
    for name, p in base.named_parameters():
        owner = name.rsplit(".", 2)[0] if ".base_layer." in name else name.rsplit(".", 1)[0]
        if "lora_" in name or owner in tuners:
            continue
        yield name, p


class SparseRollout:
    """A `rollout_func` for TRL's `GRPOTrainer` that samples with Sparrow's engine under `sparsity` (a spec
    such as "budget:256" or "schedule:PATH", a `Schedule`, a `KVPolicy`; None: dense).

    `bin_width`: position bin of the per-bin tail metrics; `quantile`: the tail quantile; `dtype`: the
    engine's ("auto": float32 on a CPU, bfloat16 on CUDA); `gpu_memory_utilization`: on CUDA, the share of
    device memory the engine may take (TRL's default for a colocated vLLM; the trainer needs the rest);
    `ignore_eos`: sample exactly max_completion_length tokens (benches); `speculate` = K > 0: exact
    speculative sampling, `sparsity` drafting K tokens a cycle for the dense model to verify; `on_rollout`:
    called with each call's `RolloutRecord`."""

    def __init__(self, sparsity: Sparsity = None, *, bin_width: int = 2000, quantile: float = TAIL_QUANTILE,
                 dtype: str = "auto", gpu_memory_utilization: float = 0.3, ignore_eos: bool = False,
                 speculate: int = 0, on_rollout: Callable[[RolloutRecord], None] | None = None):
        if bin_width < 1 or not 0 < quantile < 1:
            raise ValueError("bin_width must be at least 1 and quantile in (0, 1)")
        self.policy = as_policy(sparsity)
        if self.policy.evicts:
            raise ValueError("SparseRollout samples with block top-k or dense attention; an eviction policy "
                             "drops KV tokens that the dense learner's scores need")
        if speculate < 0 or (speculate and not self.policy.sparse):
            raise ValueError(f"speculate must be 0 (off) or the drafts per cycle of a sparse policy, got "
                             f"{speculate} with {self.policy.name}")
        self.speculate = speculate
        self.bin_width, self.quantile, self.dtype = bin_width, quantile, dtype
        self.gpu_memory_utilization = gpu_memory_utilization
        self.ignore_eos, self.on_rollout = ignore_eos, on_rollout
        self.model: Transformer | None = None
        self.engine: Engine | None = None
        self.correction: MaskCorrection | None = None
        self.sampling: SamplingParams | None = None
        self.synced_step: int | None = None
        self.calls = 0
        self.last: RolloutRecord | None = None
        self._pending: dict[str, float] = {}

    # ------------------------------------------------------------------ TRL's hook

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        """TRL's `rollout_func(prompts, trainer)`: prompt_ids, completion_ids, logprobs (and env_mask with
        a correction), one completion per prompt, in prompt order."""
        if self.engine is None:
            self._start(trainer)
        t0 = time.perf_counter()
        if self.synced_step != trainer.state.global_step:
            self.sync(trainer)
        t1 = time.perf_counter()
        prompt_ids = [list(map(int, p)) for p in tokenize_prompts(prompts, trainer)]
        completions = self._generate(prompt_ids, trainer.args.seed)
        t2 = time.perf_counter()
        record = self._score(prompt_ids, completions, trainer)
        record.seconds = {"sync": t1 - t0, "generate": t2 - t1, "score": time.perf_counter() - t2}
        self.last, self._pending = record, dict(record.metrics)
        self.calls += 1
        if self.on_rollout is not None:
            self.on_rollout(record)
        out = {"prompt_ids": record.prompt_ids, "completion_ids": record.completion_ids,
               "logprobs": record.logprobs}
        if record.env_mask is not None:
            out["env_mask"] = record.env_mask
        return out

    def with_metrics(self, reward_fn: Callable) -> Callable:
        """`reward_fn` (a TRL reward function), also logging the last rollout's mismatch metrics through
        the `log_metric` keyword TRL passes reward functions; same name, same rewards."""

        @functools.wraps(reward_fn)
        def reward(*args, **kwargs):
            out = reward_fn(*args, **kwargs)
            log_metric = kwargs.get("log_metric")
            if log_metric is not None:
                for name, value in self._pending.items():
                    log_metric(name, value)
            self._pending = {}
            return out

        return reward

    # ------------------------------------------------------------------ weights

    def _start(self, trainer) -> None:
        """The engine, made at the first call from the trainer's model; the settings checked once."""
        args = trainer.args
        if getattr(trainer, "use_vllm", False):
            raise ValueError("SparseRollout generates instead of vLLM: set use_vllm=False")
        if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
            raise ValueError("SparseRollout samples single-turn completions; tools and environments are not "
                             "supported")
        if getattr(args, "min_p", None) is not None or getattr(args, "repetition_penalty", 1.0) != 1.0:
            raise ValueError("SparseRollout samples with temperature, top_p and top_k only; unset min_p and "
                             "repetition_penalty")
        self.sampling = trl_sampling(args)
        self.correction = MaskCorrection.from_trl(args)
        hf = trainer.accelerator.unwrap_model(trainer.model)
        base = hf.get_base_model() if hasattr(hf, "get_base_model") else hf
        cfg = ModelConfig.from_hf(base.config.to_dict(), "the trainer's model config")
        device = trainer.accelerator.device
        with torch.no_grad():
            state = {name: w.detach().to("cpu", torch.float32, copy=True) for name, w in merged_weights(hf)}
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        model = build_model(cfg, state).to(device=device, dtype=resolve_dtype(self.dtype, str(device)))
        self.model = model.eval().requires_grad_(False)
        eos = getattr(trainer, "eos_token_ids", None) or cfg.eos_token_ids
        batch = max(1, args.per_device_train_batch_size * args.steps_per_generation)
        config = EngineConfig(max_batch=batch, eos_ids=tuple(eos),
                              gpu_memory_utilization=self.gpu_memory_utilization, speculate=self.speculate)
        self.engine = Engine(self.model, self.policy, config)
        self.synced_step = trainer.state.global_step

    @torch.no_grad()
    def sync(self, trainer) -> None:
        """Copy the trainer's weights (LoRA merged) into the engine's model."""
        ours = dict(self.model.named_parameters())
        seen = set()
        for name, weight in merged_weights(trainer.accelerator.unwrap_model(trainer.model)):
            key = hf_to_ours(name)
            if key == "lm_head.weight" and self.model.cfg.tie_word_embeddings:
                continue
            if key not in ours:
                raise ValueError(f"the trainer's parameter {name} has no counterpart in Sparrow's decoder")
            ours[key].copy_(weight)
            seen.add(key)
        missing = sorted(set(ours) - seen)
        if missing:
            raise ValueError(f"the trainer's model gave no weight for {missing[0]} (and {len(missing) - 1} "
                             "more)")
        self.engine.update_weights()
        self.synced_step = trainer.state.global_step

    # ------------------------------------------------------------------ sampling and scoring

    def _generate(self, prompt_ids: list[list[int]], seed: int) -> list[Completion]:
        """One completion per prompt with the trainer's sampling (`trl_sampling`); consecutive copies of a
        prompt share one request (one prefill)."""
        runs: list[list] = []
        for p in prompt_ids:
            if runs and runs[-1][0] == p:
                runs[-1][1] += 1
            else:
                runs.append([p, 1])
        seed = int(np.random.SeedSequence([int(seed), self.calls]).generate_state(1)[0])
        params = [replace(self.sampling, seed=seed, n=n, ignore_eos=self.ignore_eos, logprobs=TOP_LOGPROBS)
                  for _, n in runs]
        groups = self.engine.generate([p for p, _ in runs], params)
        return [c for group in groups for c in group]

    def _score(self, prompt_ids: list[list[int]], completions: list[Completion], trainer) -> RolloutRecord:
        comps = [c.token_ids for c in completions]
        width = max(len(c) for c in comps)
        top_ids = torch.zeros(len(comps), width, TOP_LOGPROBS, dtype=torch.long)
        top_lp = torch.full((len(comps), width, TOP_LOGPROBS), float("-inf"))
        for i, c in enumerate(completions):
            pairs = torch.tensor(c.top_logprobs, dtype=torch.float64)  # [T, 20, (id, logp)]
            top_ids[i, : len(pairs)], top_lp[i, : len(pairs)] = pairs[..., 0].long(), pairs[..., 1].float()
        with torch.inference_mode():
            scores = completion_logprobs(self.model, prompt_ids, comps, self.sampling.temperature,
                                         extra_ids=top_ids, entropy=False)
        mask = scores.mask.cpu()
        logp = scores.logp.float().cpu()
        rollout_lp = pad([c.logprobs for c in completions], width)
        budgets = pad([c.budgets for c in completions], width)
        alpha = torch.minimum(scores.extra_logp.float().cpu().exp(), top_lp.exp()).sum(-1).clamp(max=1.0)
        positions = torch.from_numpy(token_positions([len(p) for p in prompt_ids], width))
        alpha = torch.where(mask, dense_alpha_is_one(alpha, budgets, positions), 0.0)
        keep = None if self.correction is None else self.correction.keep(logp - rollout_lp, mask)
        rows = lambda x: [x[i, : len(c)].tolist() for i, c in enumerate(comps)]
        record = RolloutRecord(
            step=trainer.state.global_step, prompt_ids=prompt_ids, completion_ids=[list(c) for c in comps],
            logprobs=[list(c.logprobs) for c in completions], budgets=[list(c.budgets) for c in completions],
            logp_dense=rows(logp), alpha_lb=rows(alpha), env_mask=None if keep is None else rows(keep.int()))
        record.metrics = self.metrics(alpha[mask], positions[mask], (logp - rollout_lp)[mask], budgets[mask],
                                      None if keep is None else keep[mask])
        # TRL's completions/mean_length counts only the tokens a returned env_mask keeps
        record.metrics["sparrow/completions/mean_length"] = float(np.mean([len(c) for c in comps]))
        acceptance = draft_acceptance(completions)
        if acceptance is not None:
            record.metrics["sparrow/draft_acceptance"] = acceptance
        return record

    def metrics(self, alpha: Tensor, positions: Tensor, log_ratio: Tensor, budgets: Tensor,
                keep: Tensor | None) -> dict[str, float]:
        """The mismatch metrics of one rollout's tokens, named as TRL names its own ("sparrow/...");
        mean_budget is over the sparse tokens (budget > 0), as `sparrow rollout` and `sparrow train` say it,
        and left out when every token was produced densely (TRL averages what is logged: no null)."""
        q = f"p{100 * self.quantile:g}"
        out = {"sparrow/alpha_lb_mean": float(alpha.mean()),
               f"sparrow/alpha_lb_{q}": float(torch.quantile(alpha, self.quantile)),
               "sparrow/mismatch_kl": float(k3(log_ratio).mean())}
        if (budget := mean_sparse_budget(budgets)) is not None:
            out["sparrow/mean_budget"] = budget
        bins = positions // self.bin_width
        for b in sorted(set(bins.tolist())):
            out[f"sparrow/alpha_lb_{q}/bin_{b}"] = float(torch.quantile(alpha[bins == b], self.quantile))
        if keep is not None:
            out["sparrow/masked_fraction"] = float((~keep).float().mean())
        return out


def pad(rows: Sequence[Sequence[float]], width: int) -> Tensor:
    """Ragged rows -> [N, width] float32, right-padded with 0."""
    return torch.tensor([list(r) + [0] * (width - len(r)) for r in rows], dtype=torch.float32)


def tokenize_prompts(prompts: list, trainer) -> list[list[int]]:
    """The prompts' token ids as TRL's GRPOTrainer makes them for generation: a conversation through the
    chat template with the generation prompt (the trainer's template and its kwargs), even after a final
    assistant message, which is closed rather than continued; text by the tokenizer with its special
    tokens (a BOS where it adds one)."""
    from trl.data_utils import is_conversational

    tokenizer = trainer.processing_class
    if is_conversational({"prompt": prompts[0]}):
        out = tokenizer.apply_chat_template(
            conversation=prompts, chat_template=getattr(trainer, "chat_template", None),
            add_generation_prompt=True, tokenize=True, return_dict=True,
            **(getattr(trainer, "chat_template_kwargs", None) or {}))
        return out["input_ids"]
    return tokenizer(text=prompts)["input_ids"]


__all__ = ["MaskCorrection", "RolloutRecord", "SparseRollout", "merged_weights", "tokenize_prompts",
           "trl_sampling"]
