"""The configuration of a training run: everything that defines it, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.definitions import DEFAULT_BIN_WIDTH
from ..core.sparsity import as_policy, parse_sparsity
from ..engine.sequence import MIN_TEMPERATURE, below_temperature_floor
from ..kv_policies import KVPolicy
from ..model.config import ModelConfig
from ..model.loading import canonical_dtype
from . import objective as grpo


@dataclass
class TrainConfig:
    """Everything that defines a run; a resumed run must agree on all of it but `steps` and the options a
    resume may change (run_dir.MAY_CHANGE: when to checkpoint and evaluate, the thread count)."""

    model: str
    steps: int = 20
    prompts_per_step: int = 4
    samples: int = 4
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0  # nucleus sampling of the rollouts (1 = off); logprobs stay the untruncated ones
    top_k: int = 0  # the k most likely tokens only (0 = off)
    ignore_eos: bool = False  # every sample generates max_new_tokens (fixed-length steps, for timing)
    lr: float = 1e-4
    lora_rank: int = 16  # 0 = full fine-tuning
    lora_alpha: float = 32.0
    correction: str = "tis"
    kl_coef: float = 0.0
    seed: int = 0
    micro_batch: int = 8
    ppo_epochs: int = 1
    max_grad_norm: float = 1.0
    checkpoint_every: int = 10
    eval_every: int = 5
    bin_width: int = DEFAULT_BIN_WIDTH
    sparsity: str = "dense"  # "dense" | "budget:B" | "schedule:<path>" | "snapkv:B,..." | "rkv:B,..."
    device: str = "cpu"  # cuda: the engine's Triton kernels and CUDA graphs
    dtype: str = "auto"  # the weights': auto = bfloat16 on cuda, float32 on a CPU (exact against scoring)
    random_weights: bool = False  # a shapes-only preset with random weights (timing the GPU path)
    gradient_checkpointing: bool = False  # recompute each layer in the update's backward (CLI: on for cuda)
    loss: dict = field(default_factory=dict)  # grpo.LossConfig overrides
    distill_sparse: bool = False  # DistillSparse: train a sparse-actor-only adapter jointly (stages.distill)
    distill_rank: int = 16
    distill_alpha: float = 16.0  # published
    distill_lr_ratio: float = 5.0  # published: the sparse adapter's lr = 5 x lr
    distill_kl_coef: float = 0.001  # published k3 coefficient
    raw_prompts: bool = False  # text prompts tokenized as they are, without the model's chat template
    oversample: int = 0  # k' > samples: roll out k' per prompt, keep the `samples` of highest mean alpha
    alpha_sequences: int = 4  # sequences per step whose alpha is computed exactly (exact_alpha.py); 0: none
    speculate: int = 0  # exact speculative rollouts: the run's sparsity drafts K tokens, dense verifies
    threads: int = 0  # torch's CPU threads (--threads, else torch's choice); 0: none recorded
    reward: str | None = None  # --reward (math | code) scores every prompt; None: each prompt's own task
    reward_fn: str | None = None  # --reward-fn path.py:function scores every prompt
    reward_kwargs: str | None = None  # --reward-kwargs, compact JSON (`reward_kwargs_text`)
    max_prompt_length: int | None = None  # a longer prompt is refused, cut or left out (prompt_length.py)
    truncation: str = "error"
    filter_overlong_prompts: bool = False
    # what the run reads, by content (filled by the Trainer; run_dir.py): a resume must read the same
    reward_fn_sha256: str = ""  # the --reward-fn file's
    prompts_sha256: str = ""
    eval_prompts_sha256: str = ""
    schedule_sha256: str = ""
    model_files_sha256: str = ""  # a --model checkpoint's files (core/fingerprints.py); "" for a preset

    def validate(self) -> None:
        positive = ("steps", "prompts_per_step", "max_new_tokens", "micro_batch", "ppo_epochs",
                    "checkpoint_every", "eval_every", "bin_width")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        self.dtype = canonical_dtype(self.dtype)
        if self.samples < 2:
            raise ValueError(f"--samples must be at least 2, got {self.samples}: GRPO's advantage is a "
                             "sample's reward against its group's, so a group of one sample learns nothing")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.temperature == 0:
            raise ValueError("--temperature must be above 0, got 0: greedy samples of a prompt are all the "
                             "same, so no group has a reward spread for GRPO's advantage to learn from")
        if below_temperature_floor(self.temperature):
            raise ValueError(f"--temperature must be at least {MIN_TEMPERATURE:g}, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if self.speculate < 0:
            raise ValueError(f"--speculate must be >= 0 (drafts per cycle; 0 = off), got {self.speculate}")
        if self.speculate and not self.sparsity.startswith(("budget:", "schedule:")):
            what = "dense attention; give --budget or --schedule" if self.sparsity == "dense" else \
                "--kv-compression's eviction"
            raise ValueError(f"--speculate drafts with block top-k attention (--budget or --schedule), not "
                             f"with {what}")
        if self.speculate and self.distill_sparse:
            raise ValueError("--speculate samples from the dense policy, so DistillSparse's sparse actor "
                             "would never roll out: drop one of --speculate and --distill-sparse")
        if self.speculate and self.oversample:
            raise ValueError("--oversample keeps the samples of highest sparse acceptance, which "
                             "--speculate's dense samples all share (1): drop one of --speculate and "
                             "--oversample")
        if self.alpha_sequences < 0:
            raise ValueError(f"--alpha-sequences must be >= 0 (0 = none), got {self.alpha_sequences}")
        if self.lora_rank < 0:
            raise ValueError(f"--lora-rank must be >= 0 (0 = full fine-tuning), got {self.lora_rank}")
        if self.kl_coef < 0:
            raise ValueError(f"--kl-coef must be >= 0, got {self.kl_coef}")
        if not self.max_grad_norm > 0:
            raise ValueError(f"--max-grad-norm must be positive, got {self.max_grad_norm}")
        if self.reward is not None and self.reward_fn is not None:
            raise ValueError("--reward and --reward-fn are two ways to score; give one of them")
        grpo.LossConfig(correction=self.correction, kl_coef=self.kl_coef, **self.loss).validate()
        if self.oversample and self.oversample <= self.samples:
            raise ValueError(f"--oversample must exceed --samples ({self.samples}) to select among the "
                             f"samples, got {self.oversample}")
        if self.distill_sparse:
            if self.sparsity == "dense":
                raise ValueError("--distill-sparse trains the sparse actor's adapter, so it needs a sparse "
                                 "sampler (--budget or --schedule)")
            if self.sparsity.split(":", 1)[0] in ("snapkv", "rkv"):
                raise ValueError("--distill-sparse trains a block top-k sparse actor (its teacher-forced "
                                 "passes select pages); it does not support --kv-compression")
            if not self.lora_rank:
                raise ValueError("--distill-sparse needs the learner to train a LoRA (not --full): the "
                                 "sparse adapter is a second peft adapter beside it")
            if self.top_p < 1 or self.top_k:
                raise ValueError("--distill-sparse's k3 estimator needs tokens drawn from the sparse actor's "
                                 "whole distribution, which --top-p/--top-k cut; leave them at 1 and 0")
            bounds = (("--distill-rank", self.distill_rank, self.distill_rank >= 1, ">= 1"),
                      ("--distill-lr-ratio", self.distill_lr_ratio, self.distill_lr_ratio > 0, "> 0"),
                      ("--distill-kl-coef", self.distill_kl_coef, self.distill_kl_coef >= 0, ">= 0"))
            for flag, value, ok, what in bounds:
                if not ok:
                    raise ValueError(f"{flag} must be {what}, got {value:g}")


def kv_policy(spec: str, model: ModelConfig) -> KVPolicy:
    """A stored sparsity spec (`TrainConfig.sparsity`) read back into the policy it names."""
    return as_policy(parse_sparsity(spec, model=model))
