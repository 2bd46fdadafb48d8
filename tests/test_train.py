"""`sparrow train`: the GRPO objective against a float64 reference written out by hand, the rollout
corrections, and the trainer end to end on a tiny Llama with SmolLM2's tokenizer (resume bit-exact, the
adapter readable by transformers + peft, the per-token logs, bad input)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import transformers

from sparrow.schemas import artifact_metadata, read_artifact, write_artifact
from sparrow.stages.core.schedule import Schedule
from sparrow.stages.model.loading import embedded_checkpoint, load_model
from sparrow.stages.tasks import TASKS, Task
from sparrow.stages.train import (
    CORRECTIONS,
    LossConfig,
    RunOptions,
    TrainConfig,
    Trainer,
    group_advantages,
    load_prompts,
    policy_loss,
    rollout_correction,
)
from sparrow.stages.train.detectors import collapse_reasons
from sparrow.stages.train.experience import rejection_generator

# ---------------------------------------------------------------------------- the objective


def reference_loss(logp_new, logp_old, log_ratio, adv, mask, cfg: LossConfig, ref=None):
    """The corrected, clipped GRPO loss token by token in float64 Python (no tensor ops)."""
    n, t = len(logp_new), len(logp_new[0])
    r = [[math.exp(log_ratio[i][j]) if mask[i][j] else 1.0 for j in range(t)] for i in range(n)]
    keep = [[bool(mask[i][j]) for j in range(t)] for i in range(n)]
    w = [[1.0] * t for _ in range(n)]
    if cfg.correction in ("veto", "sparse-rl"):
        for i in range(n):
            if any(keep[i][j] and r[i][j] < cfg.veto_threshold for j in range(t)):
                keep[i] = [False] * t
    for i in range(n):
        for j in range(t):
            if cfg.correction == "tis":
                w[i][j] = min(r[i][j], cfg.tis_cap)
            elif cfg.correction == "mis" and not cfg.mis_low <= r[i][j] <= cfg.mis_high:
                keep[i][j] = False
            elif cfg.correction == "sparse-rl":
                if not cfg.sparse_rl_low <= r[i][j] <= cfg.sparse_rl_high:
                    keep[i][j] = False
                w[i][j] = min(r[i][j], cfg.sparse_rl_high)
    if cfg.correction == "sparse-rl":
        kept = [w[i][j] for i in range(n) for j in range(t) if keep[i][j]]
        mean = sum(kept) / len(kept)
        w = [[x / mean for x in row] for row in w]
    kept = [sum(keep[i]) for i in range(n)]
    if cfg.loss_agg == "seq-mean-token-mean":  # each sequence's token mean, then the mean over sequences
        share = [[1.0 / (kept[i] * sum(k > 0 for k in kept)) if kept[i] else 0.0] * t for i in range(n)]
    else:
        share = [[1.0 / sum(kept)] * t for _ in range(n)]
    total = 0.0
    for i in range(n):
        for j in range(t):
            if not keep[i][j]:
                continue
            ratio = math.exp(logp_new[i][j] - logp_old[i][j])
            a = adv[i]
            pg = max(-a * ratio, -a * min(max(ratio, 1 - cfg.clip_low), 1 + cfg.clip_high))
            if a < 0:
                pg = min(pg, -a * cfg.dual_clip)
            term = pg * w[i][j]
            if ref is not None:
                d = ref[i][j] - logp_new[i][j]
                term += cfg.kl_coef * (math.exp(d) - 1 - d)
            total += term * share[i][j]
    return total


def _batch(seed=0, n=6, t=7):
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 3, 5, 1, 6, 7][:n]
    mask = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    logp_old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    logp_new = logp_old + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.4  # ratios beyond clip
    log_ratio = torch.randn(n, t, generator=g, dtype=torch.float64) * 0.5
    log_ratio[2, 1] = -12.0  # r < 1e-4: vetoes sequence 2
    adv = torch.tensor([1.3, -0.7, 0.4, -1.9, 0.0, 2.1], dtype=torch.float64)[:n]
    ref = logp_old + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.2
    return logp_new, logp_old, log_ratio, adv, mask, ref


@pytest.mark.parametrize("correction", ("none", "tis", "mis", "veto", "sparse-rl"))
@pytest.mark.parametrize("kl", [0.0, 0.1])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_loss_and_gradient_match_float64_reference(correction, kl, agg):
    logp_new, logp_old, log_ratio, adv, mask, ref = _batch()
    cfg = LossConfig(correction=correction, kl_coef=kl, loss_agg=agg).validate()
    corr = rollout_correction(log_ratio, mask, cfg)
    x = logp_new.clone().requires_grad_(True)
    loss, _ = policy_loss(x, logp_old, adv, corr.weights, corr.mask, cfg, ref_logp=ref if kl else None)
    loss.backward()
    loss = loss.detach()
    as_list = lambda a: a.tolist()
    want = reference_loss(as_list(logp_new), as_list(logp_old), as_list(log_ratio), as_list(adv),
                          as_list(mask), cfg, as_list(ref) if kl else None)
    assert abs(float(loss) - want) < 1e-12
    h = 1e-6  # central differences of the reference, token by token
    for i, j in [(0, 0), (0, 6), (1, 2), (3, 0), (5, 4), (2, 0)]:
        plus, minus = logp_new.clone(), logp_new.clone()
        plus[i, j] += h
        minus[i, j] -= h
        numeric = (reference_loss(as_list(plus), as_list(logp_old), as_list(log_ratio), as_list(adv),
                                  as_list(mask), cfg, as_list(ref) if kl else None)
                   - reference_loss(as_list(minus), as_list(logp_old), as_list(log_ratio), as_list(adv),
                                    as_list(mask), cfg, as_list(ref) if kl else None)) / (2 * h)
        assert abs(float(x.grad[i, j]) - numeric) < 1e-6, (i, j)


def test_clip_statistics_count_each_bound():
    """Token-mean clip fractions against a count by hand: the low bound cuts negative advantages whose
    ratio fell below 1 - clip_low, the high bound positive ones above 1 + clip_high, the dual clip
    negative advantages whose loss exceeds dual_clip x |A|."""
    cfg = LossConfig(correction="none")
    ratio = torch.tensor([[0.5, 0.9, 1.5, 4.0], [0.5, 0.9, 1.5, 4.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 4, dtype=torch.bool)
    _, stats = policy_loss(ratio.log(), torch.zeros_like(ratio), adv, torch.ones_like(ratio), mask, cfg)
    # positive advantage: 1.5 and 4.0 exceed 1.28 (high); negative: 0.5 is below 0.8 (low), 4.0 hits
    # the dual clip (4 > 3)
    assert stats["clip_fraction_high"] == pytest.approx(2 / 8)
    assert stats["clip_fraction_low"] == pytest.approx(1 / 8)
    assert stats["clip_fraction"] == pytest.approx(3 / 8)
    assert stats["dual_clip_fraction"] == pytest.approx(1 / 8)


def test_veto_drops_exactly_the_sequences_with_a_tiny_ratio():
    _, _, log_ratio, _, mask, _ = _batch()
    log_ratio[4, 6] = -20.0  # padding of sequence 4 (length 6): must not veto it
    log_ratio[5, 6] = -9.3  # r = 9e-5 at a real token: vetoes sequence 5
    for mode in ("veto", "sparse-rl"):
        corr = rollout_correction(log_ratio, mask, LossConfig(correction=mode))
        assert corr.vetoed.tolist() == [False, False, True, False, False, True]
        assert not corr.mask[2].any() and not corr.mask[5].any()
        assert bool((corr.weights[corr.vetoed] == 0).all())


def test_group_advantages_against_numpy():
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.5], [0.3, 0.3, 0.3, 0.3]])
    got = group_advantages(rewards, LossConfig())
    r = rewards.numpy().astype(np.float64)
    want = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)
    assert np.allclose(got.numpy(), want, atol=1e-6) and torch.isfinite(got).all()
    centred = group_advantages(rewards, LossConfig(scale_std=False))
    assert torch.equal(centred, rewards - rewards.mean(1, keepdim=True))
    assert torch.equal(group_advantages(rewards[:, :1], LossConfig()), torch.zeros(2, 1))


@pytest.mark.parametrize("bad,message", [(dict(correction="nope"), "--correction must be one of"),
                                         (dict(clip_low=0.0), "--epsilon must be between 0 and 1"),
                                         (dict(clip_high=0.0), "--epsilon-high must be positive"),
                                         (dict(dual_clip=1.0), "dual clip"),
                                         (dict(loss_agg="sum"), "--loss-agg must be one of")])
def test_loss_config_rejects_bad_values(bad, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**bad).validate()


# ---------------------------------------------------------------------------- the trainer, end to end


def _vowels_score(completion: str, answer: str, metadata) -> float:
    """Share of the completion's letters that are vowels: graded, so random text has variance."""
    letters = [ch for ch in completion.lower() if ch.isalpha()]
    return sum(ch in "aeiou" for ch in letters) / max(len(letters), 1)


VOWELS = Task("vowels", "math", "test task: use vowels", lambda *a, **k: iter(()), _vowels_score)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama on SmolLM2's vocabulary, saved with SmolLM2's tokenizer, and its HF twin."""
    tok = transformers.AutoTokenizer.from_pretrained(embedded_checkpoint())
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path), hf


def vowel_token_prompts(tokenizer, n: int, repeat: int) -> list[dict]:
    """Prompts rows of the vowels task as token ids only: "Write the number N. " `repeat` times."""
    return [{"prompt_id": f"vowels-{i}", "task": "vowels", "prompt": None,
             "prompt_token_ids": tokenizer(f"Write the number {i * 37}. " * repeat).input_ids,
             "answer": str(i * 37), "metadata": None} for i in range(n)]


def vowel_train_args(tiny_llama, tmp_path, monkeypatch, *extra: str) -> list[str]:
    """A one-step `sparrow train` of the vowels task on two token-id prompts, writing tmp_path/run."""
    monkeypatch.setitem(TASKS, "vowels", VOWELS)
    tok = load_model(tiny_llama[0]).tokenizer
    prompts = write_artifact(vowel_token_prompts(tok, 2, 2), tmp_path / "p.parquet", "prompts")
    return ["train", "--model", tiny_llama[0], "--prompts", str(prompts), "--steps", "1",
            "--prompts-per-step", "2", "--samples", "2", "--max-new-tokens", "4",
            "--lora-rank", "2", "--threads", "1", "-o", str(tmp_path / "run"), *extra]


@pytest.fixture()
def vowel_prompts(tmp_path, monkeypatch, tiny_llama):
    monkeypatch.setitem(TASKS, "vowels", VOWELS)
    tok = load_model(tiny_llama[0]).tokenizer
    rows = []
    for i in range(6):
        text = f"Write the number {i * 37}. " * 12  # about 100 tokens: budget 48 is sparse here
        rows.append({"prompt_id": f"vowels-{i}", "task": "vowels", "prompt": text,
                     "prompt_token_ids": tok(text).input_ids, "answer": str(i * 37), "metadata": None})
    return write_artifact(rows, tmp_path / "prompts.parquet", "prompts")


def _config(path, **kw) -> TrainConfig:
    base = dict(model=path, steps=3, prompts_per_step=2, samples=3, max_new_tokens=10, lora_rank=4,
                lr=5e-2, micro_batch=4, checkpoint_every=1, eval_every=2, correction="tis")
    return TrainConfig(**{**base, **kw})


def _train(path, prompts, run, **kw):
    loaded = load_model(path)
    rows = load_prompts(prompts, loaded.tokenizer)
    trainer = Trainer(_config(path, **kw.pop("cfg", {})), loaded, rows, run, eval_prompts=rows[:2],
                      options=RunOptions(**kw))
    return trainer, trainer.run()


TIMING = {"run_id", "seconds", "rollout_seconds", "scoring_seconds", "update_seconds", "tokens_per_second",
          "reward_seconds"}


def _metrics(run):
    return [{k: v for k, v in r.items() if k not in TIMING}
            for r in read_artifact(run / "metrics.parquet", "metrics").to_pylist()]


def test_shared_prompt_scoring_matches_transformers_logprobs_and_gradient(tiny_llama):
    """Groups of completions sharing a prompt (prompts of different lengths, completions of 1..9
    tokens): the logprobs, and the gradient of their sum, equal those of transformers run on each
    prompt + completion as one sequence."""
    from sparrow.stages.model.llama import hf_to_ours
    from sparrow.stages.train.policy import completion_logprobs

    path, hf = tiny_llama
    ours = load_model(path).model
    g = torch.Generator().manual_seed(0)
    prompts, comps = [], []
    for i, n in enumerate((37, 52, 5)):
        prompt = torch.randint(0, 1000, (n,), generator=g).tolist()
        for k in range(3):
            prompts.append(prompt)
            comps.append(torch.randint(0, 1000, (1 + (4 * i + 3 * k) % 9,), generator=g).tolist())
    got = completion_logprobs(ours, prompts, comps, temperature=0.7)
    got.logp.sum().backward()
    hf.zero_grad()
    want_sum = 0.0
    for b, (p, c) in enumerate(zip(prompts, comps)):
        logits = hf(torch.tensor([p + c])).logits[0, len(p) - 1 : -1].float() / 0.7
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
        assert (got.logp[b, : len(c)] - want).abs().max() < 1e-5
        assert (got.logp[b, len(c):] == 0).all() and got.mask[b].sum() == len(c)
        want_sum = want_sum + want.sum()
    want_sum.backward()
    grads = {hf_to_ours(k): p.grad for k, p in hf.named_parameters()}
    for name, p in ours.named_parameters():
        scale = grads[name].abs().max().clamp(min=1e-6)
        assert (p.grad - grads[name]).abs().max() / scale < 1e-4, name
    hf.zero_grad()


class Crash(RuntimeError):
    pass


def crash_in_update(n: int):
    """An on_phase hook that raises Crash when the trainer enters its n-th update."""
    updates = []

    def on_phase(phase):
        if phase == "update":
            updates.append(phase)
            if len(updates) == n:
                raise Crash

    return on_phase


def test_resume_after_a_crash_is_bit_exact(tiny_llama, vowel_prompts, tmp_path):
    path = tiny_llama[0]
    straight, summary = _train(path, vowel_prompts, tmp_path / "straight")
    assert summary["steps"] == 3 and any(r["grad_norm"] > 0 for r in _metrics(tmp_path / "straight"))
    with pytest.raises(Crash):
        _train(path, vowel_prompts, tmp_path / "resumed", on_phase=crash_in_update(3))
    assert len(_metrics(tmp_path / "resumed")) == 2  # steps 1 and 2 were logged and checkpointed
    resumed, _ = _train(path, vowel_prompts, tmp_path / "resumed", resume=True)
    assert _metrics(tmp_path / "resumed") == _metrics(tmp_path / "straight")
    a = {k: v for k, v in straight.model.named_parameters() if "lora_" in k}
    b = {k: v for k, v in resumed.model.named_parameters() if "lora_" in k}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = sorted(p.name for p in (tmp_path / "resumed" / "mismatch").iterdir())
    assert steps == ["step=00001.parquet", "step=00002.parquet", "step=00003.parquet"]


def test_adapter_loads_in_transformers_and_peft(tiny_llama, vowel_prompts, tmp_path):
    from peft import PeftModel

    path, hf = tiny_llama
    trainer, summary = _train(path, vowel_prompts, tmp_path / "run", cfg=dict(steps=2))
    peft_model = PeftModel.from_pretrained(hf, summary["adapter"]).eval()
    x = torch.randint(0, 1000, (2, 20))
    with torch.no_grad():
        want = peft_model(x).logits
        got = trainer.model(x)
    assert (want - got).abs().max() < 1e-4
    assert any(v.abs().sum() > 0 for k, v in trainer.model.named_parameters() if "lora_B" in k)


def test_dense_sampler_ratios_are_one_and_corrections_no_ops(tiny_llama, vowel_prompts, tmp_path):
    """Dense rollouts: the learner's recompute equals the engine's logprobs (r_t = 1 up to float
    rounding), so every correction keeps every token with weight 1, and the first PPO epoch's ratio
    is exactly 1."""
    loaded = load_model(tiny_llama[0])
    rows = load_prompts(vowel_prompts, loaded.tokenizer)
    trainer = Trainer(_config(tiny_llama[0], steps=1), loaded, rows, tmp_path / "run")
    exp = trainer.experience(0)
    flat, old = exp.completions, exp.scores
    log_ratio = old.log_ratio
    assert log_ratio[old.mask].abs().max() < 1e-5

    adv = torch.linspace(-1, 1, len(flat))
    variants = [dict(correction=mode) for mode in CORRECTIONS] + [
        dict(correction="none", rollout_is="sequence", rollout_is_batch_normalize=True),
        dict(correction="tis", rollout_rs="token_k1,seq_sum_k1,seq_mean_k3,seq_max_k2",
             rollout_rs_threshold="0.999_1.001,0.99_1.01,1e-4,1e-4"),
        dict(correction="sparrow", rejection="sequence"), dict(correction="icepop", bypass_mode=True)]
    for options in variants:
        corr = rollout_correction(log_ratio, old.mask, LossConfig(**options).validate(), advantages=adv,
                                  alpha=old.acceptance(), generator=rejection_generator(trainer.cfg.seed, 0))
        assert torch.equal(corr.mask, old.mask) and not corr.vetoed.any(), options
        assert (corr.weights[old.mask] - 1).abs().max() < 1e-4, options
    assert (old.logp_rollout - old.logp)[old.mask].abs().max() < 1e-5  # bypass's old policy
    from sparrow.stages.train.policy import completion_logprobs

    mb = trainer.cfg.micro_batch  # the update recomputes in the scoring pass's micro-batches
    for s in range(0, len(flat), mb):
        part = flat[s:s + mb]
        prompts, comps = [c.prompt_token_ids for c in part], [c.token_ids for c in part]
        new = completion_logprobs(trainer.model, prompts, comps)
        assert torch.equal(new.logp.detach(), old.logp[s:s + mb, : new.logp.shape[1]])


def test_per_token_logs(tiny_llama, vowel_prompts, tmp_path):
    _train(tiny_llama[0], vowel_prompts, tmp_path / "run", cfg=dict(steps=1, sparsity="budget:48",
                                                                    ignore_eos=True))
    table = read_artifact(tmp_path / "run" / "mismatch" / "step=00001.parquet", "train_mismatch").to_pylist()
    assert len(table) == 2 * 3 * 10  # every generated token, all samples of full length
    assert {r["budget"] for r in table} == {0, 48}  # the first token of a sample comes from the prefill
    assert all(0 <= r["alpha_top20_lb"] <= 1 for r in table)
    metrics = _metrics(tmp_path / "run")[0]
    assert metrics["mean_budget"] > 0 and metrics["alpha_lb_p5"] <= metrics["alpha_lb_mean"]
    # exact alpha on the subsample (4 of the 6 sequences, every token of each): never below the top-20 bound
    exact = [r for r in table if r["alpha"] is not None]
    assert len(exact) == 4 * 10 and len({r["sample"] + 10 * int(r["prompt_id"].split("-")[1])
                                         for r in exact}) == 4
    assert all(r["alpha"] >= r["alpha_top20_lb"] - 1e-4 for r in exact)
    p5 = float(np.quantile([r["alpha"] for r in exact], 0.05))  # one position bin here
    assert metrics["alpha_p5"] == pytest.approx(p5, abs=1e-5) and metrics["alpha_p5_by_bin"] == [
        pytest.approx(p5, abs=1e-5)]
    # step 0: both samplers scored the base policy; the gap is theirs
    meta = artifact_metadata(tmp_path / "run" / "metrics.parquet")
    gap = float(meta["initial_eval_reward"]) - float(meta["initial_eval_reward_sparse"])
    assert float(meta["initial_sampler_gap"]) == pytest.approx(gap)
    # what calibrate-threshold reads from a run directory: the schedule it sampled with, the label
    assert Schedule.from_artifact(tmp_path / "run" / "schedule.parquet") == Schedule((0,), (48,))
    table = read_artifact(tmp_path / "run" / "metrics.parquet", "metrics")
    label = artifact_metadata(table)["label"]
    assert label == ("collapsed" if collapse_reasons(table) else "stable")


def test_bad_input(tiny_llama, vowel_prompts, tmp_path):
    path = tiny_llama[0]
    rows = read_artifact(vowel_prompts, "prompts").to_pylist()
    no_answer = write_artifact([{**rows[0], "answer": None}], tmp_path / "a.parquet", "prompts")
    with pytest.raises(ValueError, match="has no answer"):
        load_prompts(no_answer)
    unknown = write_artifact([{**rows[0], "task": "nope"}], tmp_path / "b.parquet", "prompts")
    with pytest.raises(ValueError, match="has task 'nope', which has no scorer"):
        load_prompts(unknown)
    _train(path, vowel_prompts, tmp_path / "run", cfg=dict(steps=1))
    before = (tmp_path / "run" / "metrics.parquet").read_bytes()
    with pytest.raises(ValueError, match="already holds a run"):
        _train(path, vowel_prompts, tmp_path / "run", cfg=dict(steps=1))
    with pytest.raises(ValueError, match="trained with --lr 0.05, not 0.1"):
        _train(path, vowel_prompts, tmp_path / "run", cfg=dict(steps=2, lr=0.1), resume=True)
    assert (tmp_path / "run" / "metrics.parquet").read_bytes() == before


def test_cli_train_and_resume(tiny_llama, vowel_prompts, tmp_path):
    from typer.testing import CliRunner

    from sparrow.cli.app import app

    run = tmp_path / "run"
    args = ["train", "--model", tiny_llama[0], "--prompts", str(vowel_prompts), "--eval-prompts",
            str(vowel_prompts), "--steps", "2", "--prompts-per-step", "2", "--samples", "2",
            "--max-new-tokens", "6", "--lora-rank", "2", "--budget", "48", "--checkpoint-every", "1",
            "-o", str(run)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert (run / "adapter" / "adapter_config.json").exists()
    assert len(read_artifact(run / "metrics.parquet", "metrics")) == 2
    again = CliRunner().invoke(app, args)  # an existing run without --resume: refused, nothing written
    assert again.exit_code != 0 and "already holds a run" in again.output
    more = CliRunner().invoke(app, [*args[:-2], "--steps", "3", "--resume", "-o", str(run)])
    assert more.exit_code == 0, more.output
    assert len(read_artifact(run / "metrics.parquet", "metrics")) == 3
    rolled = CliRunner().invoke(app, ["rollout", "--model", tiny_llama[0], "--prompts", str(vowel_prompts),
                                      "--adapter", str(run / "adapter"), "--max-new-tokens", "3",
                                      "-o", str(tmp_path / "r.parquet")])
    assert rolled.exit_code == 0, rolled.output
    # the tiny model's adapter on SmolLM2: refused before any weights load, nothing written
    other = CliRunner().invoke(app, ["rollout", "--model", "smollm2-135m", "--prompts", str(vowel_prompts),
                                     "--adapter", str(run / "adapter"), "-o", str(tmp_path / "x.parquet")])
    assert other.exit_code != 0 and "an adapter for another base model" in other.output
    assert not (tmp_path / "x.parquet").exists()


def test_cli_train_with_speculative_rollouts_is_on_policy(tiny_llama, vowel_prompts, tmp_path):
    """--speculate: the rollouts are the dense policy's, so the rollout logprobs equal the learner's
    recompute and no mismatch is left to correct; each step logs the drafts' acceptance."""
    from typer.testing import CliRunner

    from sparrow.cli.app import app

    run = tmp_path / "run"
    args = ["train", "--model", tiny_llama[0], "--prompts", str(vowel_prompts), "--steps", "2",
            "--prompts-per-step", "2", "--samples", "2", "--max-new-tokens", "8", "--lora-rank", "2",
            "--budget", "48", "--speculate", "3", "--temperature", "1", "-o", str(run)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = read_artifact(run / "metrics.parquet", "metrics").to_pylist()
    for row in rows:
        assert 0 <= row["draft_acceptance"] <= 1
        assert row["mismatch_kl"] < 1e-6 and row["mean_budget"] is None  # every token the dense policy's
        assert 0 < row["alpha_mean"] <= 1  # the sparse policy's exact alpha on the dense samples
    # no exactly scored tokens: the drafts' alpha is unknown, not the dense sampler's 1
    unscored = CliRunner().invoke(app, [*args[:-2], "--steps", "1", "--alpha-sequences", "0",
                                        "-o", str(tmp_path / "unscored")])
    assert unscored.exit_code == 0, unscored.output
    row = read_artifact(tmp_path / "unscored" / "metrics.parquet", "metrics").to_pylist()[0]
    assert row["alpha_mean"] is None and row["alpha_p5"] is None
    refused = CliRunner().invoke(app, [*args[:-2], "--distill-sparse", "-o", str(tmp_path / "x")])
    assert refused.exit_code != 0 and "drop one of --speculate and --distill-sparse" in refused.output


def test_a_schedule_dense_in_every_bin_trains_as_a_dense_run(tiny_llama, vowel_prompts, tmp_path):
    """plan-schedule writes an all-dense schedule where its cost model prices every budget above dense: a
    run on it decodes as a dense run, so its evaluations under 'the run's sampler' would repeat the dense
    ones: none is run (two initial passes, not four) and no step logs a sparse accuracy."""
    from typer.testing import CliRunner

    from sparrow.cli.app import app
    from sparrow.stages.core.sparsity import as_policy

    schedule = tmp_path / "dense.parquet"
    write_artifact({"bin": [0, 1], "bin_start": [0, 512], "bin_end": [512, None], "budget": [None, None],
                    "tail": [1.0, 1.0], "predicted_step_seconds": [None, None]}, schedule, "schedule",
                   metadata={"page_size": 16})
    assert not as_policy(Schedule.from_artifact(schedule)).sparse
    assert as_policy(Schedule((0, 512), (0, 64))).sparse
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "--model", tiny_llama[0], "--prompts", str(vowel_prompts),
                                      "--eval-prompts", str(vowel_prompts), "--steps", "1",
                                      "--prompts-per-step", "2", "--samples", "2", "--max-new-tokens", "4",
                                      "--lora-rank", "2", "--schedule", str(schedule), "-o", str(run)])
    assert result.exit_code == 0, result.output
    passes = [line.strip() for line in result.stderr.splitlines() if line.strip()[:14] == "initial eval 1"]
    assert passes and all(line.startswith("initial eval 1/2: ") for line in passes), result.stderr
    row = read_artifact(run / "metrics.parquet", "metrics").to_pylist()[0]
    assert row["eval_accuracy"] is not None and row["eval_accuracy_sparse"] is None


def test_a_schedule_planned_for_another_model_is_refused(tiny_llama, vowel_prompts, tmp_path):
    from typer.testing import CliRunner

    from sparrow.cli.app import app

    qwen = tmp_path / "qwen3-4b.parquet"
    planned = CliRunner().invoke(app, ["plan-schedule", "--model", "qwen3-4b", "-o", str(qwen)])
    assert planned.exit_code == 0, planned.output
    run = tmp_path / "run"
    for cmd in (["train", "--steps", "1", "-o", str(run)], ["rollout", "-o", str(tmp_path / "r.parquet")]):
        result = CliRunner().invoke(app, [*cmd, "--model", tiny_llama[0], "--prompts", str(vowel_prompts),
                                          "--schedule", str(qwen)])
        assert result.exit_code != 0 and "the schedule was planned for qwen3-4b" in result.output
    assert not run.exists() and not (tmp_path / "r.parquet").exists()
    with pytest.raises(ValueError, match="planned for qwen3-4b, whose shape differs"):
        _train(tiny_llama[0], vowel_prompts, run, cfg=dict(sparsity=f"schedule:{qwen}"))


def test_sql_sees_every_step_of_a_run_as_one_view(tiny_llama, vowel_prompts, tmp_path):
    from sparrow.stages.sql import run_query

    _train(tiny_llama[0], vowel_prompts, tmp_path / "run", cfg=dict(steps=2, sparsity="budget:48"))
    rows = run_query(tmp_path / "run", "SELECT step, count(*) AS n, count(DISTINCT source_file) AS files "
                                       "FROM train_mismatch GROUP BY step ORDER BY step").to_pylist()
    assert [(r["step"], r["n"], r["files"]) for r in rows] == [(1, 60, 1), (2, 60, 1)]
    joined = run_query(tmp_path / "run", "SELECT count(*) AS n FROM metrics JOIN schedule ON true")
    assert joined.to_pylist() == [{"n": 2}]


def test_a_lora_on_16_bit_weights_trains_in_fp32(tiny_llama):
    """On a bf16 base (the GPU's training dtype) the LoRA is fp32, as peft's get_peft_model makes it by
    default: its start changes nothing (B = 0), and a small AdamW step moves it, which in bf16 it would not
    (0.01 + 1e-6 rounds back to 0.01 in bf16's 8 bits of mantissa)."""
    from sparrow.stages.model.adapter import add_lora

    model = load_model(tiny_llama[0], dtype=torch.bfloat16).model
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        before = model(tokens)
    add_lora(model, 4, 8.0)
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert lora and all(p.dtype == torch.float32 and p.requires_grad for p in lora.values())
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if "lora_" not in n)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), before, rtol=0, atol=0)
    start = {n: p.detach().clone() for n, p in lora.items()}
    opt = torch.optim.AdamW(lora.values(), lr=1e-6, weight_decay=0.0)
    for _ in range(2):  # A's gradient is zero until B has moved off 0
        opt.zero_grad()
        model(tokens).logsumexp(-1).sum().backward()
        opt.step()
    a = next(n for n in lora if "lora_A" in n)
    moved = lora[a].detach() != start[a]
    assert moved.float().mean() > 0.25
    lost = lora[a].detach()[moved].to(torch.bfloat16) == start[a][moved].to(torch.bfloat16)
    assert lost.float().mean() > 0.9  # what a bf16 LoRA would have kept of the step


def test_k3_of_nearly_equal_policies_is_never_negative():
    """k3 = exp(d) - 1 - d >= 0 for every d; float32 rounding of exp(d) - 1 for the tiny d of a dense run
    must not make it negative, in the loss's KL, the per-token log, the correction statistic or the
    off-policy diagnostics."""
    from sparrow.stages.train import corrections
    from sparrow.stages.train.objective import k3

    d = torch.tensor([5e-8, -5e-8, 3e-8, -1e-7, 1e-9, 0.0, 0.5, -0.5], dtype=torch.float32)
    assert (k3(d) >= 0).all()
    assert torch.allclose(k3(d[-2:]).double(), d[-2:].double().exp() - 1 - d[-2:].double())
    assert (corrections.token_statistic(d, "k3") >= 0).all()
    mask = torch.ones(1, len(d), dtype=torch.bool)
    logp = torch.full((1, len(d)), -1.0, dtype=torch.float32)
    assert corrections.off_policy_metrics(logp + d, logp, mask)["k3_kl"] >= 0
