"""The learner and the scorers at long sequences: per-token quantities over chunks of positions, the
plain causal path beside the shared-prompt path, gradient checkpointing, the fp32 head; and checkpoint
correctness (rope scaling against transformers, refused rope types, EOS from generation_config.json).

References are independent of the code under test: whole-sequence float64 logits (our decoder's forward
over prompt + completion, no chunks, no shared prompt pass, no cache; and transformers', whose RMSNorm
rounds to fp32, within fp32 rounding), with log-softmax, entropy, alpha and the gradient written from
their definitions over the full [T, V] logits.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import test_train
import torch
import transformers
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact
from sparrow.stages.attention import SparseAttention
from sparrow.stages.core.sparsity import budget_fn
from sparrow.stages.engine import EngineConfig
from sparrow.stages.model.adapter import add_lora
from sparrow.stages.model.config import ModelConfig, ModelSpecError
from sparrow.stages.model.loading import load_model, resolve_config
from sparrow.stages.scoring.mismatch import decode_budgets, score_sequences
from sparrow.stages.train.policy import PREFIX_MASK_ELEMENTS, completion_logprobs, shares_prompts

from cli_checks import error_line
from tiny_models import tiny_qwen3

runner = CliRunner()
tiny_llama, vowel_prompts = test_train.tiny_llama, test_train.vowel_prompts
VOCAB = 300


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    """A tiny random Qwen3 (q/k norms, 3 layers: 0-1 dense, 2 sparse) in float64: ours and transformers'."""
    path = tmp_path_factory.mktemp("tiny64")
    hf = tiny_qwen3(path, tie_word_embeddings=False)
    return str(path), hf.double()


def _batch(seed=0):
    """Two prompts of 3 completions each and one of a single completion; completions of 1..11 tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts, comps = [], []
    for n, k in ((90, 3), (70, 3), (31, 1)):
        prompt = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        for _ in range(k):
            prompts.append(prompt)
            comps.append(torch.randint(3, VOCAB, (int(torch.randint(1, 12, (1,), generator=g)),),
                                       generator=g).tolist())
    return prompts, comps


def _reference(forward, prompt, comp, temperature, extra=None):
    """From the definition, on the float64 logits `forward` gives for prompt + completion as one sequence."""
    n = len(prompt)
    with torch.no_grad():
        logits = forward(torch.tensor([prompt + comp]))[0, n - 1: n + len(comp) - 1].double() / temperature
    lp = logits - logits.logsumexp(-1, keepdim=True)  # [T, V]
    out = {"logp": lp[torch.arange(len(comp)), torch.tensor(comp)],
           "entropy": -(lp.exp() * lp).sum(-1)}
    if extra is not None:
        out["extra"] = lp.gather(-1, extra[: len(comp)])
    return out


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("chunk", [1, 4, 1024])
def test_chunked_scores_equal_the_definition_in_float64(tiny64, shared, chunk):
    """Logprobs, entropy and the extra ids' logprobs (the top-k bound of alpha) over chunks of positions,
    through either form of the forward, equal the unchunked float64 definition (and transformers')."""
    path, hf = tiny64
    ours = load_model(path, dtype=torch.float64).model
    prompts, comps = _batch()
    width = max(len(c) for c in comps)
    extra = torch.randint(0, VOCAB, (len(comps), width, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = completion_logprobs(ours, prompts, comps, 0.7, extra_ids=extra, chunk=chunk, shared=shared)
    for b, (p, c) in enumerate(zip(prompts, comps)):
        t = len(c)
        for forward, tol in ((ours, 1e-10), (lambda x: hf(x).logits, 1e-6)):
            want = _reference(forward, p, c, 0.7, extra[b])
            assert (got.logp[b, :t] - want["logp"]).abs().max() < tol
            assert (got.entropy[b, :t] - want["entropy"]).abs().max() < tol
            assert (got.extra_logp[b, :t] - want["extra"]).abs().max() < tol
        assert (got.logp[b, t:] == 0).all() and (got.entropy[b, t:] == 0).all()


def test_alpha_over_chunks_equals_the_definition_in_float64(tiny64):
    """Teacher-forced scoring in chunks of 3 positions: alpha = sum_v min(p_dense, p_sparse) over the full
    vocabulary, the sparse logprobs and the entropy equal their definitions on whole-sequence float64
    logits (dense: transformers; sparse: our decoder's whole-sequence block top-k forward)."""
    path, hf = tiny64
    ours = load_model(path, dtype=torch.float64).model
    prompts, comps = _batch(seed=5)
    temp = 0.8
    scored = score_sequences(ours, prompts, comps, [48], temperature=temp, vocab_chunk=3)
    alpha, logp_sparse = scored.sparse[48]
    for b, (p, c) in enumerate(zip(prompts, comps)):
        rows = scored.seq == b
        n, g = len(p), len(c)
        seq = torch.tensor([p + c])
        with torch.no_grad():
            dense = torch.log_softmax(hf(seq).logits[0, n - 1: n + g - 1].double() / temp, -1)
            budgets = decode_budgets(torch.arange(n + g)[None], torch.tensor([n]), budget_fn(48))
            attn = SparseAttention(budgets)
            sparse = torch.log_softmax(ours(seq, attention=attn)[0, n - 1: n + g - 1] / temp, -1)
        want_alpha = torch.minimum(dense.exp(), sparse.exp()).sum(-1).numpy()
        idx = torch.arange(g), torch.tensor(c)
        # the scorer stores float32 columns: equal to the float64 definition within fp32 rounding
        assert np.abs(alpha[rows] - want_alpha).max() < 2e-6
        assert np.abs(logp_sparse[rows] - sparse[idx].numpy()).max() < 2e-6
        assert np.abs(scored.logp_dense[rows] - dense[idx].numpy()).max() < 2e-6
        assert np.abs(scored.entropy_dense[rows] - (-(dense.exp() * dense).sum(-1)).numpy()).max() < 2e-6
    assert (alpha < 0.999).mean() > 0.3  # budget 48 does cut: most positions are past three pages


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("shared", [True, False])
def test_chunked_update_gradient_equals_the_unchunked_one(tiny64, shared):
    """The gradient of a weighted sum of logprobs through the chunked, checkpointed head (chunks of 2
    positions) equals the gradient of the same sum written over whole-sequence [T, V] log-softmaxes, for
    every parameter, in float64."""
    path, _ = tiny64
    ours = load_model(path, dtype=torch.float64).model
    prompts, comps = _batch(seed=7)
    weights = torch.randn(len(comps), max(len(c) for c in comps), generator=torch.Generator().manual_seed(1),
                          dtype=torch.float64)
    got = completion_logprobs(ours, prompts, comps, 0.9, chunk=2, shared=shared, entropy=False)
    (got.logp * weights).sum().backward()
    chunked = _grads(ours)
    ours.zero_grad(set_to_none=True)
    total = 0.0
    for b, (p, c) in enumerate(zip(prompts, comps)):
        logits = ours(torch.tensor([p + c]))[0, len(p) - 1: -1] / 0.9  # [T, V], whole
        lp = torch.log_softmax(logits, -1)[torch.arange(len(c)), torch.tensor(c)]
        total = total + (lp * weights[b, : len(c)]).sum()
    total.backward()
    whole = _grads(ours)
    assert chunked.keys() == whole.keys() and len(whole) == len(list(ours.parameters()))
    for name in whole:
        scale = whole[name].abs().max().clamp(min=1e-12)
        assert (chunked[name] - whole[name]).abs().max() / scale < 1e-10, name


@pytest.mark.parametrize("shared", [True, False])
def test_checkpointed_update_equals_the_plain_one(tiny64, shared):
    """With a LoRA on every projection (as the trainer runs), per-layer activation checkpointing gives the
    plain update's logprobs and LoRA gradients bit for bit on the CPU."""
    path, _ = tiny64
    runs = []
    for checkpointing in (False, True):
        model = load_model(path, dtype=torch.float64).model
        torch.manual_seed(0)
        add_lora(model, rank=2, alpha=4.0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.3)  # peft starts B at zero: make every gradient non-trivial
        model.gradient_checkpointing = checkpointing
        prompts, comps = _batch(seed=9)
        logp = completion_logprobs(model, prompts, comps, 1.0, chunk=3, shared=shared, entropy=False).logp
        (logp * torch.linspace(-1, 1, logp.shape[1], dtype=torch.float64)).sum().backward()
        runs.append((logp.detach(), _grads(model)))
    (a, ga), (b, gb) = runs
    assert torch.equal(a, b)
    assert ga.keys() == gb.keys() and len(ga) > 0 and all("lora_" in k for k in ga)
    assert all(torch.equal(ga[k], gb[k]) for k in ga)
    assert any(ga[k].abs().max() > 0 for k in ga if "lora_A" in k)


def test_plain_causal_path_equals_the_shared_prompt_path(tiny64):
    """The long-sequence form (each prompt + completion one causal sequence, no mask) gives the shared
    prompt pass's logprobs and entropy; the memory rule picks it for K = 1 and for long sequences."""
    path, _ = tiny64
    ours = load_model(path, dtype=torch.float64).model
    prompts, comps = _batch(seed=11)
    with torch.no_grad():
        shared = completion_logprobs(ours, prompts, comps, 1.0, shared=True)
        causal = completion_logprobs(ours, prompts, comps, 1.0, shared=False)
    assert (shared.logp - causal.logp).abs().max() < 1e-10
    assert (shared.entropy - causal.entropy).abs().max() < 1e-10
    assert shares_prompts(prompts, comps)  # short groups keep the shared prompt pass
    assert not shares_prompts(prompts[-1:], comps[-1:])  # K = 1: nothing to share
    long_prompt, long_comp = [1] * 1000, [2] * 16000  # 4 x 16K x 17K elements: far above the bound
    assert 4 * 16000 * 17000 > PREFIX_MASK_ELEMENTS
    assert not shares_prompts([long_prompt] * 4, [long_comp] * 4)


def test_train_with_gradient_checkpointing_equals_without(tiny_llama, vowel_prompts, tmp_path):
    """Two GRPO steps (rollout, dense recompute, update) with checkpointing: the metrics and the LoRA are
    those of the run without it, bit for bit (so --resume stays bit-exact whichever is used)."""
    path = tiny_llama[0]
    runs = []
    for on in (False, True):
        trainer, _ = test_train._train(path, vowel_prompts, tmp_path / f"run-{on}",
                                       cfg=dict(steps=2, gradient_checkpointing=on))
        assert trainer.model.gradient_checkpointing is on
        runs.append((test_train._metrics(tmp_path / f"run-{on}"),
                     {k: v for k, v in trainer.model.named_parameters() if "lora_" in k}))
    (ma, wa), (mb, wb) = runs
    assert ma == mb and any(r["grad_norm"] > 0 for r in ma)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# ---------------------------------------------------------------------------- the fp32 head


def test_bf16_head_is_fp32_not_rounded_to_bf16():
    """With bf16 weights the logits are the fp32 product of the bf16 values (the float64 product within
    fp32 rounding), not that product rounded to bf16; gradients flow through it."""
    model = load_model("tiny-qwen3", dtype=torch.bfloat16).model
    hidden = torch.randn(5, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    want = hidden.double() @ model.lm_head.weight.double().T
    got = model.logits(hidden)
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 1e-5 * want.abs().max()
    rounded = (hidden @ model.lm_head.weight.T).double()  # what the head gave before: bf16 logits
    assert (rounded - want).abs().max() > 100 * (got.double() - want).abs().max()
    h = hidden.clone().requires_grad_()
    model.logits(h).sum().backward()
    assert h.grad is not None and h.grad.dtype == torch.bfloat16


# ---------------------------------------------------------------------------- checkpoint correctness

ROPE_CASES = {
    "qwen3-yarn": (transformers.Qwen3Config, {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 128}),
    "llama3": (transformers.LlamaConfig, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 128}),
    "linear": (transformers.LlamaConfig, {"rope_type": "linear", "factor": 2.0}),
}


def _save_tiny(cls, path, **extra):
    cfg = cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
              rope_theta=10000.0, tie_word_embeddings=True, **extra)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    hf.save_pretrained(path, safe_serialization=True)
    return hf


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_scaling_matches_transformers(case, tmp_path):
    """A checkpoint saved with rope_scaling: our logits equal transformers' at 400 positions, most of them
    beyond the original 128-token context, where the scaling changes the logits."""
    cls, scaling = ROPE_CASES[case]
    hf = _save_tiny(cls, tmp_path, rope_scaling=dict(scaling))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved.get("rope_scaling") or saved.get("rope_parameters"))["rope_type"] == scaling["rope_type"]
    ours = load_model(str(tmp_path))
    assert ours.config.rope_scaling is not None and ours.config.rope_scaling.rope_type == scaling["rope_type"]
    tokens = torch.randint(0, VOCAB, (2, 400), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits
        got = ours.model(tokens)
        plain = load_model(str(_plain_copy(tmp_path))).model(tokens)  # the same weights, scaling dropped
    gap = (got - want).abs().max()
    assert gap < 1e-4, case
    assert (plain[:, 200:] - want[:, 200:]).abs().max() > max(1e-3, 10 * gap), case  # scaling matters there
    assert resolve_config(str(tmp_path)) == ours.config
    assert ModelConfig.from_dict(ours.config.to_dict()) == ours.config
    assert ModelConfig.from_hf(ours.config.to_hf()) == ours.config


def _plain_copy(path):
    copy = path / "plain"
    copy.mkdir()
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_scaling", None)
    if "rope_parameters" in cfg:
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    (copy / "config.json").write_text(json.dumps(cfg))
    (copy / "model.safetensors").symlink_to(path / "model.safetensors")
    return copy


def test_unsupported_rope_type_is_refused_in_one_sentence(tmp_path):
    model = tmp_path / "model"
    _save_tiny(transformers.LlamaConfig, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelSpecError, match="rope_scaling type 'dynamic' is not supported"):
        load_model(str(model))
    out = tmp_path / "m.parquet"
    r = runner.invoke(app, ["profile", "--model", str(model), "--prompts", str(tmp_path / "none.parquet"),
                            "-o", str(out)])
    line = error_line(r)
    assert r.exit_code == 2 and str(model / "config.json") in line and "'dynamic'" in line
    assert not out.exists()


@pytest.mark.parametrize("generation_eos,want", [(7, (2, 7)), ([2, 9, 7], (2, 9, 7)), (None, (2,))])
def test_eos_ids_from_generation_config(tmp_path, generation_eos, want):
    """EOS ids are config.json's and generation_config.json's together (an int or a list there)."""
    (tmp_path / "config.json").write_text(json.dumps(resolve_config("tiny-llama").to_hf()))
    if generation_eos is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    assert resolve_config(str(tmp_path)).eos_token_ids == want


def test_engine_stops_at_a_generation_config_eos(tmp_path):
    """The rollout engine stops at an id that only generation_config.json names."""
    from sparrow.stages.engine import Engine, SamplingParams

    hf = _save_tiny(transformers.LlamaConfig, tmp_path, eos_token_id=2)
    prompt = [5, 6, 7, 8]
    with torch.no_grad():  # the greedy first token, then make it an EOS through generation_config only
        first = int(hf(torch.tensor([prompt])).logits[0, -1].argmax())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, first]}))
    loaded = load_model(str(tmp_path))
    out = Engine(loaded.model, None, EngineConfig(max_batch=1)).generate([prompt],
                                                                         SamplingParams(max_new_tokens=5,
                                                                                    temperature=0.0))
    assert out[0][0].token_ids == [first] and out[0][0].finish_reason == "stop"


# ---------------------------------------------------------------------------- profile --random-weights


def test_profile_random_weights(prompts_file, tmp_path):
    """`sparrow profile --random-weights` scores with a preset's shapes and seeded random weights (what
    `--model qwen3-4b --random-weights --device cuda` times on a GPU) and records it."""
    runs = {}
    for flag in ([], ["--random-weights"]):
        out = tmp_path / f"m{len(flag)}.parquet"
        r = runner.invoke(app, ["profile", "--model", "smollm2-135m", "--prompts", str(prompts_file),
                                "--samples", "1", "--max-new-tokens", "3", "--budgets", "48", *flag,
                                "-o", str(out)])
        assert r.exit_code == 0, r.output
        runs[bool(flag)] = (read_artifact(out, "mismatch"), artifact_metadata(out))
    assert runs[True][1]["random_weights"] is True and "random_weights" not in runs[False][1]
    assert runs[True][1]["dtype"] == runs[False][1]["dtype"] == "float32"
    assert runs[True][0].column("token_id").to_pylist() != runs[False][0].column("token_id").to_pylist()
    r = runner.invoke(app, ["profile", "--model", "qwen3-4b", "--prompts", str(prompts_file),
                            "--dtype", "fp8", "-o", str(tmp_path / "x.parquet")])
    assert "--dtype must be one of" in error_line(r)



def test_gguf_rope_scaling_is_refused(tmp_path):
    """A GGUF whose metadata asks for rope scaling is refused in one sentence before any weights load."""
    import gguf

    path = tmp_path / "scaled.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 2), ("embedding_length", 64), ("feed_forward_length", 96),
                       ("attention.head_count", 4), ("context_length", 512)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_uint32("llama.vocab_size", VOCAB)
    writer.add_string("llama.rope.scaling.type", "yarn")
    writer.add_float32("llama.rope.scaling.factor", 4.0)
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelSpecError, match=r"scaled\.gguf: GGUF rope scaling 'yarn' is not supported"):
        resolve_config(str(path))


@pytest.mark.parametrize("objective", ["kl", "k3"])
def test_distill_step_with_gradient_checkpointing_equals_without(tmp_path, objective):
    """The distiller's actor forward (shared prompt pass, block top-k completions, LoRA) recomputed per
    layer in backward gives the plain step's loss and LoRA gradients bit for bit."""
    from sparrow.stages.core.trajectories import Trajectory
    from sparrow.stages.distill import DistillConfig, Distiller

    _save_tiny(transformers.LlamaConfig, tmp_path)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, VOCAB, (90,), generator=g).tolist()
    trajs = [Trajectory("p", i, prompt, torch.randint(3, VOCAB, (n,), generator=g).tolist())
             for i, n in enumerate((14, 6, 20))]
    runs = []
    for on in (False, True):
        loaded = load_model(str(tmp_path))
        cfg = DistillConfig(lora_rank=2, lora_alpha=4.0, objective=objective, gradient_checkpointing=on,
                            dense_layers=(0,))  # of the 2 layers, the second is sparse
        distiller = Distiller(loaded, trajs, budget_fn(48), cfg)
        with torch.no_grad():
            for name, p in loaded.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
        assert loaded.model.gradient_checkpointing is on
        loaded.model.train()
        loss = distiller.step_loss([0, 1, 2], 40)
        runs.append((loss, _grads(loaded.model)))
    (la, ga), (lb, gb) = runs
    assert la == lb and la > 0 and ga.keys() == gb.keys() and ga
    assert all(torch.equal(ga[k], gb[k]) for k in ga)
