"""The sparse actor of DistillSparse: the model plus a LoRA that only the sparse sampler runs, trained
jointly with GRPO (`JointSparseActor`) or offline (stages/distill.py) through `actor_hidden`, the
teacher-forced, differentiable form of sparse decoding for completions that share a prompt."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention import DEFAULT_DENSE_LAYERS, PAGE_SIZE, SparseAttention
from ..core.sparsity import BudgetFn
from ..model.adapter import TARGET_MODULES
from ..model.head import token_scores
from ..model.llama import AttentionContext, Transformer
from ..model.lora import LoraWeights
from ..scoring.mismatch import decode_budgets, pad_right
from .config import TrainConfig
from .experience import Experience
from .objective import LossConfig, policy_loss
from .policy import RecordingAttention, completion_mask


class SharedPromptSparse(SparseAttention):
    """Completions of one prompt attending to its recorded prompt keys/values and to themselves, with block
    top-k selection over the whole prefix (slot i = position i, prompt slots first): the teacher-forced form
    of sparse decoding for a group that shares its prompt, differentiable (no in-place cache)."""

    needs_gradients = True

    def __init__(self, prompt_kv: list[tuple[Tensor, Tensor]], budgets: Tensor,
                 dense_layers: Sequence[int] = DEFAULT_DENSE_LAYERS, page: int = PAGE_SIZE):
        super().__init__(budgets, dense_layers, page)
        self.prompt_kv = prompt_kv  # per layer ([1, Hkv, N, D], [1, Hkv, N, D])

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        pk, pv = self.prompt_kv[layer]
        b = q.shape[0]
        keys = torch.cat([pk.expand(b, -1, -1, -1), k], dim=2)
        values = torch.cat([pv.expand(b, -1, -1, -1), v], dim=2)
        if layer in self.dense_layers or not self.any_sparse:
            visible = torch.arange(keys.shape[2], device=q.device) <= ctx.positions[:, None, :, None]
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, enable_gqa=True)
        return self.attend(q, keys, values, ctx.positions)


def actor_hidden(model: Transformer, prompt: Sequence[int], completions: Sequence[Sequence[int]],
                 budget_at: BudgetFn | Sequence[BudgetFn], dense_layers: Sequence[int] = DEFAULT_DENSE_LAYERS,
                 page: int = PAGE_SIZE) -> Tensor:
    """[K, T, hidden]: the sparse actor's states that predict each completion token of K completions of
    one prompt (token 0 from the dense prefill's last position, token j from decode position n + j - 1
    at budget budget_at(n + j); one function for all, or one per completion), with whatever adapter the
    model carries, gradients kept."""
    device = model.embed_tokens.weight.device
    n, k = len(prompt), len(completions)
    recorder = RecordingAttention()
    prompt_h = model.hidden_states(torch.tensor([list(prompt)], device=device), attention=recorder)
    first = prompt_h[:, n - 1:n].expand(k, 1, -1)
    t = max(len(c) for c in completions)
    if t == 1:
        return first
    inputs = pad_right([c[:-1] for c in completions], device)  # [K, T - 1]
    positions = n + torch.arange(t - 1, device=device).expand(k, t - 1)
    fns = [budget_at] * k if callable(budget_at) else list(budget_at)
    starts = torch.full((1,), n, device=device)
    rows = {f: decode_budgets(positions[:1], starts, f) for f in set(fns)}  # one table per function
    budgets = torch.cat([rows[f] for f in fns])  # [K, T - 1]
    rest = model.hidden_states(inputs, positions=positions,
                               attention=SharedPromptSparse(recorder.kv, budgets, dense_layers, page))
    return torch.cat([first, rest], dim=1)


class JointSparseActor:
    """`sparrow train --distill-sparse`: a second peft adapter ("sparse") beside the learner's, which only
    the engine's sampling runs; after each learner update, one AdamW step on the sparse actor's PPO loss
    over the step's rollouts plus a k3 term toward the dense logprobs (docs/distill.md)."""

    ADAPTER = "sparse"

    def __init__(self, model: Transformer, cfg: TrainConfig, budget_at: BudgetFn):
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.model, self.kl_coef, self.budget_at = model, cfg.distill_kl_coef, budget_at
        self.temperature = cfg.temperature
        self.config = LoraConfig(r=cfg.distill_rank, lora_alpha=cfg.distill_alpha, lora_dropout=0.0,
                                 bias="none", target_modules=list(TARGET_MODULES), task_type="CAUSAL_LM")
        with warnings.catch_warnings():  # the second adapter beside the learner's is this design, not a slip
            warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
            inject_adapter_in_model(self.config, model, adapter_name=self.ADAPTER)
        self.layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        self._sparse_layers = {m for m in self.layers if self.ADAPTER in getattr(m, "lora_A", {})}
        lora = [(n, p) for n, p in model.named_parameters() if "lora_" in n]
        self.params = [p for n, p in lora if f".{self.ADAPTER}." in n]
        self.learner_params = [p for n, p in lora if ".default." in n]
        self.use("learner")
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr * cfg.distill_lr_ratio, weight_decay=0.0)

    def use(self, who: str) -> None:
        """"learner": the default adapter only (trainable); "actor": both, only the sparse one trainable."""
        names = ["default"] if who == "learner" else ["default", self.ADAPTER]
        for m in self.layers:
            m.set_adapter(names)
        for p in self.params:  # peft's set_adapter also sets requires_grad: state ours explicitly
            p.requires_grad_(who == "actor")
        for p in self.learner_params:
            p.requires_grad_(who == "learner")

    def weights(self) -> LoraWeights:
        """The sparse adapter as LoRA weights (a copy): what teacher-forced scoring merges for its sparse
        modes (`score_sequences(actor=...)`), with the learner's adapter left active."""
        modules = {name: (m.lora_A[self.ADAPTER].weight.detach().clone(),
                          m.lora_B[self.ADAPTER].weight.detach().clone())
                   for name, m in self.model.named_modules() if m in self._sparse_layers}
        return LoraWeights(modules, float(self.config.lora_alpha), int(self.config.r))

    @contextmanager
    def acting(self) -> Iterator[None]:
        self.use("actor")
        try:
            yield
        finally:
            self.use("learner")

    def update(self, exp: Experience, loss_cfg: LossConfig) -> dict[str, float]:
        """One step on the sparse adapter over the step's rollouts and the learner's scores."""
        completions, advantages, scores = exp.completions, exp.advantages, exp.scores
        cfg = replace(loss_cfg, kl_coef=self.kl_coef, loss_agg="token-mean")
        normalizer = max(int(scores.mask.sum()), 1)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, c in enumerate(completions):
            groups.setdefault(tuple(c.prompt_token_ids), []).append(i)
        sums: dict[str, float] = {}
        with self.acting():
            self.model.train()
            self.optimizer.zero_grad(set_to_none=True)
            for prompt, idx in groups.items():
                comps = [completions[i].token_ids for i in idx]
                hidden = actor_hidden(self.model, prompt, comps, self.budget_at)
                mask = completion_mask([len(c) for c in comps], hidden.device)  # [K, T]
                rows, cols = mask.nonzero(as_tuple=True)
                targets = pad_right(comps, hidden.device)[rows, cols]
                lp = token_scores(self.model.logits, hidden[rows, cols], targets, self.temperature,
                                  entropy=False).logp
                logp = hidden.new_zeros(mask.shape, dtype=lp.dtype).index_put((rows, cols), lp)  # [K, T]
                t, sel = logp.shape[1], torch.tensor(idx)
                loss, part = policy_loss(logp, scores.logp_rollout[sel, :t], advantages[sel],
                                         torch.ones_like(logp), scores.mask[sel, :t], cfg,
                                         ref_logp=scores.logp[sel, :t], normalizer=normalizer)
                loss.backward()
                for k, v in part.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, 1.0))
            self.optimizer.step()
        self.model.eval()
        return {"sparse_loss": sums.get("loss", 0.0), "sparse_policy_loss": sums.get("policy_loss", 0.0),
                "sparse_kl": sums.get("kl", 0.0), "sparse_grad_norm": grad_norm}


__all__ = ["JointSparseActor", "SharedPromptSparse", "actor_hidden"]
