"""Sparrow's sampler inside TRL's GRPOTrainer (stages/integrations/trl.py).

The fast tests need no TRL (the correction rule, the merged LoRA weights); the slow ones run TRL's
GRPOTrainer on SmolLM2-135M for two steps and check that what TRL trains on is our engine's sampling,
with its logprobs (against independent teacher-forced scoring), and that the engine's weights are the
trainer's after an optimizer step (LoRA and full fine-tuning).
"""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace

import pytest
import torch

from sparrow.stages.integrations.trl import MaskCorrection, merged_weights


def test_mask_correction_follows_trls_mask_modes():
    args = SimpleNamespace(vllm_importance_sampling_correction=True,
                           vllm_importance_sampling_mode="token_mask",
                           vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0)
    rule = MaskCorrection.from_trl(args)
    log_ratio = torch.log(torch.tensor([[1.0, 3.0, 0.4], [1.5, 1.0, 9.0]]))
    mask = torch.tensor([[True, True, True], [True, True, False]])
    assert rule.keep(log_ratio, mask).tolist() == [[True, False, False], [True, True, False]]
    seq = MaskCorrection("sequence_mask", None, 3.0)  # TRL's default mode and cap
    # row 0: 1 * 3 * 0.4 = 1.2 is kept; row 1: 1.5 * 1 = 1.5 (the padded 9 does not count)
    assert seq.keep(log_ratio, mask).tolist() == [[True, True, True], [True, True, False]]
    assert MaskCorrection.from_trl(SimpleNamespace(vllm_importance_sampling_correction=False)) is None
    with pytest.raises(ValueError, match="token_mask or sequence_mask"):
        MaskCorrection.from_trl(SimpleNamespace(**{**vars(args),
                                                   "vllm_importance_sampling_mode": "token_truncate"}))


def test_merged_weights_are_the_lora_merged_model(tmp_path):
    from peft import LoraConfig, get_peft_model

    from tiny_models import tiny_qwen3

    hf = tiny_qwen3(tmp_path / "tiny")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    model = get_peft_model(hf, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # a trained adapter, not peft's zero init
    ours = {n: w.detach().clone() for n, w in merged_weights(model)}
    reference = dict(model.merge_and_unload().named_parameters())
    assert ours.keys() == reference.keys()
    for name, w in reference.items():
        torch.testing.assert_close(ours[name], w, rtol=0, atol=1e-6)


def test_speculation_needs_a_sparse_policy_to_draft_with():
    from sparrow.stages.integrations.trl import SparseRollout

    for sparsity, k in ((None, 2), ("budget:64", -1)):
        with pytest.raises(ValueError, match="drafts per cycle of a sparse policy"):
            SparseRollout(sparsity, speculate=k)
    assert SparseRollout("budget:64", speculate=2).speculate == 2


# ---------------------------------------------------------------- TRL's GRPOTrainer, two steps


def _run_trl(lora: bool, tmp_path, speculate: int = 0):
    """Two GRPO steps on SmolLM2-135M with our sampler at budget 48 (with `speculate`: drafting for the
    dense model); -> (trainer, rollout records, the training micro-batches TRL computed the loss on, the
    weight checks made at each later rollout)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from sparrow.stages.integrations.trl import SparseRollout
    from sparrow.stages.model.loading import embedded_checkpoint

    folder = str(embedded_checkpoint("smollm2-135m"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    filler = "The grass is green. The sky is blue. The sun is yellow. " * 12
    prompts = [[{"role": "user", "content": f"{filler}Remember: the code is {c}. {filler}What is the code?"}]
               for c in (4242, 1717)]
    data = Dataset.from_dict({"prompt": prompts, "answer": ["4242", "1717"]})

    def reward(completions, answer, **_):  # the code found, else a little for length: never a flat group
        return [float(a in c[0]["content"]) + len(c[0]["content"]) / 100 for c, a in zip(completions, answer)]

    records, checks, batches = [], [], []
    holder = {}

    def on_rollout(record):
        records.append(record)
        if record.step > 0:  # after an optimizer step: the engine's weights against the trainer's now
            trainer = holder["trainer"]
            engine = dict(rollout.model.named_parameters())
            from sparrow.stages.model.llama import hf_to_ours

            diffs = {n: float((engine[hf_to_ours(n)] - w.detach()).abs().max())
                     for n, w in merged_weights(trainer.model) if hf_to_ours(n) in engine}
            moved = max(float((w.detach() - initial[n]).abs().max())
                        for n, w in merged_weights(trainer.model))
            checks.append((max(diffs.values()), moved, len(diffs)))

    class Recording(GRPOTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            batches.append({k: inputs[k].detach().clone() for k in
                            ("completion_ids", "completion_mask", "sampling_per_token_logps", "tool_mask")
                            if k in inputs})
            return super().compute_loss(model, inputs, *args, **kwargs)

    rollout = SparseRollout("budget:48", bin_width=128, speculate=speculate, on_rollout=on_rollout)
    config = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, seed=0, per_device_train_batch_size=4,
                        num_generations=2, max_completion_length=6, learning_rate=1e-3 if lora else 1e-5,
                        beta=0.0, vllm_importance_sampling_mode="token_mask",
                        vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0,
                        use_cpu=True, report_to="none", save_strategy="no", logging_steps=1,
                        disable_tqdm=True)
    peft = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                      task_type="CAUSAL_LM") if lora else None
    trainer = Recording(model=model, reward_funcs=rollout.with_metrics(reward), args=config,
                        train_dataset=data,
                        processing_class=tokenizer, peft_config=peft, rollout_func=rollout)
    holder["trainer"] = trainer
    initial = {n: w.detach().clone() for n, w in merged_weights(trainer.model)}
    trainer.train()
    return trainer, records, batches, checks


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    pytest.importorskip("trl")
    return _run_trl(True, tmp_path_factory.mktemp("trl-lora"))


@pytest.mark.slow
def test_trl_trains_on_our_engines_completions_and_logprobs(lora_run):
    trainer, records, batches, _ = lora_run
    assert len(records) == 2 and len(batches) >= 2
    ours = {}
    for r in records:
        for ids, lp, keep in zip(r.completion_ids, r.logprobs, r.env_mask):
            ours[tuple(ids)] = (lp, keep)
    seen = set()
    for b in batches:
        for i in range(b["completion_ids"].shape[0]):
            n = int(b["completion_mask"][i].sum())
            ids = tuple(b["completion_ids"][i, :n].tolist())
            assert ids in ours, "TRL trained on a completion our engine did not sample"
            lp, keep = ours[ids]
            torch.testing.assert_close(b["sampling_per_token_logps"][i, :n], torch.tensor(lp), rtol=0,
                                       atol=1e-6)
            assert b["tool_mask"][i, :n].tolist() == keep  # the correction's mask is TRL's loss mask
            seen.add(ids)
    assert seen == set(ours)
    logged = [row for row in trainer.state.log_history if "sparrow/alpha_lb_p5" in row]
    assert len(logged) == 2 and all("sparrow/masked_fraction" in row for row in logged)
    assert all(any(k.startswith("sparrow/alpha_lb_p5/bin_") for k in row) for row in logged)


@pytest.mark.slow
def test_engine_logprobs_match_independent_teacher_forced_scoring(lora_run):
    """The first rollout sampled with the initial weights (peft's LoRA starts at zero): its logprobs are
    block top-k's, as our teacher-forced sparse scoring replays them, and the dense scores behind the
    mismatch metrics are transformers' own logits."""

    from sparrow.stages.model.loading import load_model
    from sparrow.stages.scoring.mismatch import score_sequences

    _, records, _, _ = lora_run
    r = records[0]
    assert r.step == 0 and max(max(b) for b in r.budgets) == 48
    base = load_model("smollm2-135m").model
    scored = score_sequences(base, r.prompt_ids, r.completion_ids, [48])
    sparse_logp = torch.tensor(scored.sparse[48][1])
    torch.testing.assert_close(torch.tensor([x for lp in r.logprobs for x in lp]), sparse_logp, rtol=0,
                               atol=2e-3)
    _assert_transformers_dense(r, r.logp_dense)
    assert any(a < 0.999 for alpha in r.alpha_lb for a in alpha)  # budget 48 is sparse at these lengths


@pytest.mark.slow
def test_engine_weights_follow_lora_steps(lora_run):
    _, _, _, checks = lora_run
    assert len(checks) == 1
    diff, moved, n = checks[0]
    assert n > 100 and moved > 0 and diff == 0.0


@pytest.mark.slow
def test_engine_weights_follow_full_fine_tuning():
    pytest.importorskip("trl")
    with tempfile.TemporaryDirectory() as d:
        from pathlib import Path

        _, records, _, checks = _run_trl(False, Path(d))
    assert len(records) == 2 and len(checks) == 1
    diff, moved, n = checks[0]
    assert n > 100 and moved > 0 and diff == 0.0


@pytest.mark.slow
def test_speculative_rollouts_give_trl_the_dense_models_logprobs(tmp_path):
    """speculate=2: budget 48 drafts, the dense model verifies; what TRL trains on carries transformers'
    dense logprobs (the first rollout, LoRA still zero) and each step logs the drafts' acceptance."""
    pytest.importorskip("trl")
    trainer, records, batches, _ = _run_trl(True, tmp_path, speculate=2)
    r = records[0]
    assert r.step == 0 and all(set(b) == {0} for b in r.budgets)
    _assert_transformers_dense(r, r.logprobs)
    logged = [row for row in trainer.state.log_history if "sparrow/draft_acceptance" in row]
    assert len(logged) == 2 and all(0 <= row["sparrow/draft_acceptance"] <= 1 for row in logged)
    assert all(abs(row["sparrow/mismatch_kl"]) < 1e-4 for row in logged)


def _assert_transformers_dense(record, logprobs) -> None:
    """`logprobs` (per completion of `record`): transformers' own dense ones for its tokens, within 2e-3."""
    from transformers import AutoModelForCausalLM

    from sparrow.stages.model.loading import embedded_checkpoint

    hf = AutoModelForCausalLM.from_pretrained(str(embedded_checkpoint("smollm2-135m")), dtype=torch.float32)
    for prompt, comp, lp in zip(record.prompt_ids, record.completion_ids, logprobs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + comp])).logits[0, len(prompt) - 1: -1]
        dense = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(comp)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lp), dense, rtol=0, atol=2e-3)


@pytest.mark.parametrize("flags, said", [
    (["--samples", "1"], "--samples must be at least 2, got 1"),
    (["--budget", "0"], "--budget: budget 0 is dense attention, not a block top-k budget"),
    (["--schedule", "nonexistent.parquet"], "--schedule: nonexistent.parquet does not exist"),
])
def test_the_trl_example_refuses_a_bad_flag_in_one_line_before_the_model_loads(tmp_path, flags, said):
    """examples/trl_grpo_sparse.py: argparse's one-line error and exit 2, not a traceback from TRL."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    script = Path(__file__).resolve().parents[1] / "examples" / "trl_grpo_sparse.py"
    proc = subprocess.run([sys.executable, str(script), *flags], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"trl_grpo_sparse.py: error: {said}")
    assert "Traceback" not in proc.stderr
