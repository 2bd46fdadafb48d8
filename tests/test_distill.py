"""DistillSparse (`stages/distill.py`, `sparrow distill`, `profile/rollout --adapter`) on a tiny random Llama.

References: the plain sparse actor (a zero adapter must change nothing), the rollout engine's incremental
sparse decoding with the adapter merged (teacher-forced scoring with the adapter must reproduce it),
transformers (the learner's dense logprobs, the saved adapter through peft), and float64 numpy for the
objectives.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import test_train
import torch
import transformers
from torch import nn
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact, write_artifact
from sparrow.stages.attention import SparseAttention
from sparrow.stages.core.schedule import Schedule
from sparrow.stages.core.sparsity import as_policy, budget_fn
from sparrow.stages.core.trajectories import Trajectory
from sparrow.stages.distill import DistillConfig, Distiller, actor_hidden, sampled_logprobs, token_losses
from sparrow.stages.engine import Engine, EngineConfig, SamplingParams
from sparrow.stages.model.llama import ours_to_hf
from sparrow.stages.model.loading import load_model
from sparrow.stages.model.lora import LoraWeights, adapters_disabled, load_lora, lora_merged
from sparrow.stages.scoring.mismatch import decode_budgets, score_sequences

from cli_checks import error_line

runner = CliRunner()
# the fixtures of test_train: a tiny Llama with SmolLM2's tokenizer, a graded toy task's prompts
tiny_llama, vowel_prompts = test_train.tiny_llama, test_train.vowel_prompts
VOCAB = 300


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama (3 layers: 0-1 dense, 2 sparse), saved as a checkpoint, and its HF twin."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16,
                                   max_position_embeddings=512, rope_theta=5000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    path = tmp_path_factory.mktemp("tiny-distill")
    hf.save_pretrained(path, safe_serialization=True)
    return str(path), hf


def _tokens(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _lora(model, rank=2, alpha=4.0, scale=0.3, zero_b=False, seed=0) -> LoraWeights:
    g = torch.Generator().manual_seed(seed)
    modules = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name != "lm_head":
            a = torch.randn(rank, m.in_features, generator=g) * scale
            b = torch.randn(m.out_features, rank, generator=g) * scale
            modules[name] = (a, torch.zeros_like(b) if zero_b else b)
    return LoraWeights(modules, alpha, rank)


def _peft_state(lora: LoraWeights) -> dict:
    return {f"base_model.model.{ours_to_hf(name)}.lora_{ab}.weight": t
            for name, (a, b) in lora.modules.items() for ab, t in (("A", a), ("B", b))}


SCHEDULE = Schedule((0, 96), (48, 64))
BUDGETS = [64, SCHEDULE.budget_at]


def _trajectories(prompts, comps):
    return [Trajectory(f"p{i}", 0, p, c) for i, (p, c) in enumerate(zip(prompts, comps))]


# ---------------------------------------------------------------------------- the actor's definition


def test_zero_adapter_is_exactly_the_plain_sparse_actor(tiny):
    model = load_model(tiny[0]).model
    prompts, comps = _tokens((100, 70)), _tokens((20, 31), seed=2)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    plain = score_sequences(model, prompts, comps, BUDGETS)
    zero = score_sequences(model, prompts, comps, BUDGETS, actor=_lora(model, zero_b=True))
    assert np.array_equal(plain.logp_dense, zero.logp_dense)
    for b in BUDGETS:
        assert plain.sparse[b][0].min() < 0.999  # sparsity changed the distribution somewhere
        assert np.array_equal(plain.sparse[b][0], zero.sparse[b][0])
        assert np.array_equal(plain.sparse[b][1], zero.sparse[b][1])
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())  # restored bit for bit


@pytest.mark.parametrize("sparsity", [64, SCHEDULE], ids=["budget64", "schedule"])
def test_engine_with_adapter_equals_teacher_forced_scoring_with_it(tiny, sparsity):
    """Incremental sparse decoding by the engine with the adapter merged (prefill and decode, shared prompt
    pages, a sample waiting for a slot) reproduces teacher-forced sparse scoring with the adapter."""
    model = load_model(tiny[0]).model
    lora = _lora(model)
    prompts = _tokens((100, 70))
    params = [SamplingParams(max_new_tokens=n, n=2, seed=3, ignore_eos=True) for n in (24, 30)]
    with lora_merged(model, lora):
        results = Engine(model, as_policy(sparsity), EngineConfig(max_batch=3)).generate(prompts, params)
    comps = [c for group in results for c in group]
    budget_at = budget_fn(sparsity)
    scored = score_sequences(model, [c.prompt_token_ids for c in comps], [c.token_ids for c in comps],
                             [budget_at], actor=lora)
    plain = score_sequences(model, [c.prompt_token_ids for c in comps], [c.token_ids for c in comps],
                            [budget_at])
    got = np.concatenate([c.logprobs for c in comps])
    assert np.abs(got - scored.sparse[budget_at][1]).max() < 1e-4
    assert np.abs(got - plain.sparse[budget_at][1]).max() > 1e-2  # the adapter does change the actor
    assert np.array_equal(scored.logp_dense, plain.logp_dense)  # dense: the model without the adapter


def test_training_forward_equals_scoring_and_the_learner_never_sees_the_adapter(tiny):
    """The distiller's differentiable actor (peft-injected LoRA, shared prompt pass, block top-k) gives the
    logprobs of teacher-forced scoring with the same adapter merged; with the adapter loaded, the learner's
    dense logprobs (adapters disabled) equal transformers' on the base weights."""
    path, hf = tiny
    loaded = load_model(path)
    lora = _lora(loaded.model, seed=5)
    prompt = _tokens((90,))[0]
    comps = _tokens((12, 25, 1), seed=4)
    trajs = [Trajectory("p", i, prompt, c) for i, c in enumerate(comps)]
    budget_at = SCHEDULE.budget_at
    distiller = Distiller(loaded, trajs, budget_at, DistillConfig(lora_rank=2, lora_alpha=4.0),
                          init=_peft_state(lora))
    with torch.no_grad():
        hidden = actor_hidden(loaded.model, prompt, comps, budget_at)
    with adapters_disabled(loaded.model):
        scored = score_sequences(loaded.model, [prompt] * 3, comps, [budget_at], actor=distiller.lora())
    with torch.no_grad():
        got = np.concatenate([sampled_logprobs(loaded.model, hidden[i, : len(c)], c, 1.0).numpy()
                              for i, c in enumerate(comps)])
    assert np.abs(got - scored.sparse[budget_at][1]).max() < 1e-4
    dense = distiller.dense_targets([0, 1, 2])  # [T, H] each: the kl objective's dense hidden states
    for c, d in zip(comps, dense):
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([prompt + c])).logits[0, len(prompt) - 1: -1], -1)
            got = torch.log_softmax(loaded.model.logits(d), -1)
        assert (got - want).abs().max() < 1e-4


# ---------------------------------------------------------------------------- the objectives


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_objective_terms_match_float64():
    g = torch.Generator().manual_seed(0)
    dense, actor = torch.randn(7, 50, generator=g) * 3, torch.randn(7, 50, generator=g) * 3
    targets = torch.randint(0, 50, (7,), generator=g)
    ld, la = _np_log_softmax(dense.double().numpy()), _np_log_softmax(actor.double().numpy())
    kl = (np.exp(ld) * (ld - la)).sum(-1)
    d = ld[np.arange(7), targets.numpy()] - la[np.arange(7), targets.numpy()]
    k3 = np.exp(d) - 1 - d
    for name, want in (("kl", kl), ("k3", k3)):
        got = token_losses(name, torch.log_softmax(dense, -1), torch.log_softmax(actor, -1), targets)
        assert np.allclose(got.numpy(), want, rtol=1e-5, atol=1e-6), name


def _reference_terms(hf, model, lora, t, budget_at, temp, objective) -> float:
    """float64 sum over t's generated positions of the objective: transformers' dense logits against a
    whole-sequence sparse forward with `lora` merged."""
    seq = torch.tensor([t.prompt + t.completion])
    n, g = len(t.prompt), len(t.completion)
    with torch.no_grad():
        d = _np_log_softmax(hf(seq).logits[0, n - 1: n + g - 1].double().numpy() / temp)
        with lora_merged(model, lora):
            pos = torch.arange(seq.shape[1])[None]
            attn = SparseAttention(decode_budgets(pos, torch.tensor([n]), budget_at))
            a = _np_log_softmax(model(seq, attention=attn)[0, n - 1: n + g - 1].double().numpy() / temp)
    if objective == "kl":
        return float((np.exp(d) * (d - a)).sum())
    r = d[np.arange(g), t.completion] - a[np.arange(g), t.completion]
    return float((np.exp(r) - 1 - r).sum())


@pytest.mark.parametrize("objective,mixed,balance", [("kl", False, False), ("k3", False, False),
                                                     ("kl", True, False), ("kl", True, True)])
def test_step_loss_matches_float64_reference(tiny, objective, mixed, balance):
    """The distiller's loss on a fixed batch (two prompt groups, ragged completions) equals a float64 token
    mean built from transformers' dense logits and a whole-sequence sparse forward, one sequence at a time;
    `mixed`: each trajectory at its own budget function, two different ones within one prompt group;
    `balance`: each budget's terms weighted by mean(o) / o_j, o_j its token-mean objective over the batch."""
    path, hf = tiny
    loaded = load_model(path)
    prompts = _tokens((100, 60), seed=7)
    comps = _tokens((9, 17, 5), seed=8)
    trajs = [Trajectory("a", 0, prompts[0], comps[0]), Trajectory("b", 0, prompts[1], comps[1]),
             Trajectory("a", 1, prompts[0], comps[2])]
    fns = [budget_fn(64), SCHEDULE.budget_at, budget_fn(48)] if mixed else [budget_fn(64)]
    chosen = [0, 1, 2] if mixed else [0, 0, 0]
    temp = 0.8
    lora = _lora(loaded.model, seed=9, scale=0.2)
    terms = [[_reference_terms(hf, loaded.model, lora, t, f, temp, objective) for f in fns] for t in trajs]
    count = sum(len(t.completion) for t in trajs)
    weights = [1.0] * len(fns)
    if balance:
        o = [sum(row[j] for row in terms) / count for j in range(len(fns))]
        weights = [np.mean(o) / x for x in o]
    want = sum(weights[j] * row[j] for row, j in zip(terms, chosen)) / count
    cfg = DistillConfig(lora_rank=2, lora_alpha=4.0, objective=objective, temperature=temp,
                        balance_budgets=balance)
    distiller = Distiller(loaded, trajs, fns, cfg, init=_peft_state(lora))
    assert np.allclose(distiller.weights, weights, rtol=1e-4)
    got = distiller.step_loss([0, 1, 2], count, chosen)
    assert abs(got - want) <= 1e-4 * abs(want) + 1e-6
    assert all(p.grad is not None for p in distiller.params)
    assert not any(p.requires_grad for n, p in loaded.model.named_parameters() if "lora_" not in n)


def test_steps_teach_the_budgets_in_turn(tiny):
    loaded = load_model(tiny[0])
    trajs = [Trajectory("q", k, [1] * 20, [2, 3]) for k in range(3)]
    fns = [budget_fn(48), budget_fn(64), budget_fn(96)]
    distiller = Distiller(loaded, trajs, fns, DistillConfig(batch_size=2, lora_rank=2))
    got = [[fns[j](1000) for j in distiller.budgets_of(step, 2)] for step in range(3)]
    assert got == [[48, 64], [96, 48], [64, 96]]
    # 22 tokens fit in budget 48: every budget is dense here, the objective 0, and the weights stay 1
    assert distiller.weights == [1.0, 1.0, 1.0]


def test_distilling_lowers_the_objective_and_touches_only_the_lora(tiny):
    loaded = load_model(tiny[0])
    base = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    prompts = _tokens((100, 80), seed=11)
    trajs = [Trajectory(f"p{i}", k, p, c) for i, p in enumerate(prompts)
             for k, c in enumerate(_tokens((16, 16), seed=20 + i))]
    cfg = DistillConfig(steps=12, batch_size=4, lora_rank=4, lr=1e-3)
    distiller = Distiller(loaded, trajs, budget_fn(48), cfg)
    tokens = sum(len(t.completion) for t in trajs)
    before = distiller.step_loss(range(len(trajs)), tokens)  # the KL over all the data
    distiller.run()
    after = distiller.step_loss(range(len(trajs)), tokens)
    assert after < 0.5 * before
    with adapters_disabled(loaded.model):
        state = {k.replace(".base_layer", ""): v for k, v in loaded.model.state_dict().items()
                 if "lora_" not in k}
    assert state.keys() == base.keys() and all(torch.equal(state[k], base[k]) for k in base)


# ---------------------------------------------------------------------------- the CLI


def _prompts_file(path, lengths, seed):
    rows = [{"prompt_id": f"q{i}", "task": "kv_lookup", "prompt": None, "prompt_token_ids": t, "answer": "1",
             "metadata": None} for i, t in enumerate(_tokens(lengths, seed))]
    return write_artifact(rows, path, "prompts")


def _schedule_file(path, page_size):
    write_artifact({"bin": [0, 1], "bin_start": [0, 96], "bin_end": [96, None], "budget": [48, 64],
                    "tail": [None, None], "predicted_step_seconds": [None, None]}, path, "schedule",
                   metadata={"page_size": page_size})
    return path


def test_cli_distill_profile_and_rollout_with_the_adapter(tiny, tmp_path):
    from peft import PeftModel

    path, hf = tiny
    train = _prompts_file(tmp_path / "p.parquet", (100, 90), 1)
    held = _prompts_file(tmp_path / "e.parquet", (95,), 2)
    out = tmp_path / "adapter"
    r = runner.invoke(app, ["distill", "--model", path, "--prompts", str(train), "--eval-prompts", str(held),
                            "--schedule", str(_schedule_file(tmp_path / "s.parquet", 16)), "--steps", "3",
                            "--samples", "2", "--max-new-tokens", "8", "--lora-rank", "2", "--lr", "1e-2",
                            "--eval-budgets", "48,64", "--balance-budgets", "--format", "csv",
                            "-o", str(out)])
    assert r.exit_code == 0, r.output
    record = json.loads((out / "sparrow_distill.json").read_text())
    assert record["config"]["balance_budgets"] and record["train_budgets"] == "48,64"
    assert len(record["budget_weights"]) == 2 and min(record["budget_weights"]) > 0
    assert "steps at budgets 48,64" in " ".join(r.stderr.split())
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("bin,budget,tokens,tail_before,tail_after") and len(lines) >= 3
    assert "wrote the adapter" in r.stderr
    before, after = (read_artifact(out / "mismatch" / f"{n}.parquet", "mismatch")
                     for n in ("before", "after"))
    assert before.num_rows == after.num_rows == 2 * 8 * 2  # 2 eval samples x 8 tokens x 2 budgets
    assert before.column("logp_dense").equals(after.column("logp_dense"))  # the dense policy is unchanged
    assert artifact_metadata(out / "mismatch" / "after.parquet")["adapter"] == str(out)
    # transformers + peft read the adapter: the same model as ours with it merged
    peft_model = PeftModel.from_pretrained(hf, str(out)).eval()
    ours = load_model(path).model
    x = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad(), lora_merged(ours, load_lora(out)):
        assert (peft_model(x).logits - ours(x)).abs().max() < 1e-4
    peft_model.unload()
    # profile --adapter on the eval trajectories, as a rollouts file, gives the distilled scores
    rolled = tmp_path / "r.parquet"
    r = runner.invoke(app, ["rollout", "--model", path, "--prompts", str(held), "--samples", "2",
                            "--max-new-tokens", "8", "--seed", "1", "--dense", "-o", str(rolled)])
    assert r.exit_code == 0, r.output
    prof = tmp_path / "m.parquet"
    r = runner.invoke(app, ["profile", "--model", path, "--rollouts", str(rolled), "--budgets", "48,64",
                            "--adapter", str(out), "-o", str(prof)])
    assert r.exit_code == 0, r.output
    got = read_artifact(prof, "mismatch").sort_by([("budget", "ascending"), ("sample", "ascending"),
                                                   ("position", "ascending")])
    want = after.sort_by([("budget", "ascending"), ("sample", "ascending"), ("position", "ascending")])
    assert np.abs(got.column("alpha").to_numpy() - want.column("alpha").to_numpy()).max() < 1e-5
    # rollout --adapter --schedule samples with the distilled sparse actor
    r = runner.invoke(app, ["rollout", "--model", path, "--prompts", str(held), "--adapter", str(out),
                            "--schedule", str(tmp_path / "s.parquet"), "--max-new-tokens", "4",
                            "-o", str(tmp_path / "r2.parquet")])
    assert r.exit_code == 0, r.output


@pytest.fixture(scope="module")
def cli_files(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distill-bad")
    path = tiny[0]
    prompts = _prompts_file(tmp / "p.parquet", (100,), 1)
    loaded = load_model(path)
    lora = _lora(loaded.model, rank=2)
    distiller = Distiller(loaded, [Trajectory("q", 0, [1] * 10, [2, 3])], budget_fn(48),
                          DistillConfig(lora_rank=2, lora_alpha=4.0), init=_peft_state(lora))
    adapter = distiller.save(tmp / "adapter", path)
    dense = tmp / "dense.parquet"
    assert runner.invoke(app, ["rollout", "--model", path, "--prompts", str(prompts), "--max-new-tokens", "3",
                               "-o", str(dense)]).exit_code == 0
    speculative = tmp / "speculative.parquet"
    assert runner.invoke(app, ["rollout", "--model", path, "--prompts", str(prompts), "--max-new-tokens", "3",
                               "--budget", "48", "--speculate", "2", "-o", str(speculative)]).exit_code == 0
    foreign = tmp / "foreign.parquet"
    pq.write_table(pa.table({"prompt_id": ["q0"], "prompt_token_ids": [[5] * 60], "token_ids": [[7, 8]]}),
                   foreign)
    return {"PROMPTS": str(prompts), "ADAPTER": str(adapter), "DENSE": str(dense), "FOREIGN": str(foreign),
            "SPECULATIVE": str(speculative),
            "SCHED32": str(_schedule_file(tmp / "s32.parquet", 32)), "MODEL": path}


@pytest.mark.parametrize("args,message", [
    (["distill", "--model", "smollm2-135m", "--prompts", "PROMPTS", "--budget", "48", "--init-adapter",
      "ADAPTER"], "an adapter for another base model"),
    (["profile", "--model", "smollm2-135m", "--prompts", "PROMPTS", "--adapter", "ADAPTER"],
     "an adapter for another base model"),
    (["distill", "--model", "MODEL", "--prompts", "PROMPTS", "--budget", "48", "--init-adapter", "ADAPTER",
      "--lora-rank", "4"], "the adapter has rank 2, but --lora-rank is 4"),
    (["distill", "--model", "MODEL", "--prompts", "PROMPTS", "--schedule", "SCHED32"], "pages of 32 tokens"),
    (["distill", "--model", "MODEL", "--rollouts", "DENSE", "--budget", "48", "--objective", "k3"],
     "was sampled densely"),
    (["distill", "--model", "MODEL", "--rollouts", "SPECULATIVE", "--budget", "48", "--objective", "k3"],
     "holds exact speculative samples (--speculate 1), which are the dense model's"),  # 2 capped: 3 tokens
    (["distill", "--model", "MODEL", "--rollouts", "FOREIGN", "--budget", "48", "--objective", "k3"],
     "does not record how it was sampled"),
    (["distill", "--model", "MODEL", "--prompts", "PROMPTS"], "give --budget or --schedule"),
    (["distill", "--model", "MODEL", "--prompts", "PROMPTS", "--budget", "48", "--train-budgets", "48,50"],
     "--train-budgets: "),
    (["distill", "--model", "MODEL", "--prompts", "PROMPTS", "--budget", "48", "--objective", "kl2"],
     "--objective must be one of kl, k3"),
])
def test_cli_bad_input(cli_files, tmp_path, args, message):
    out = tmp_path / "out"
    r = runner.invoke(app, [cli_files.get(a, a) for a in args] + ["-o", str(out)])
    line = error_line(r)
    assert message in line, line
    assert line.count(cli_files["ADAPTER"]) <= 1, line  # the adapter named once, by its flag
    assert not out.exists()


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading the weights fails the command: a refusal must come before it."""
    def load(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr("sparrow.stages.model.loading.load_model", load)


REFUSED_BEFORE_LOADING = [
    (["--prompts", "PROMPTS", "--samples", str(10**10), "--max-new-tokens", "16", "--trajectories-per-step",
      "1"], "--samples 10000000000 for 1 prompt with --max-new-tokens 16 need at least"),
    (["--rollouts", "DENSE", "--samples", "1"], "--samples applies only when sampling from --prompts or "
     "--eval-prompts; the trajectories of --rollouts DENSE are already sampled"),
    (["--rollouts", "DENSE", "--max-new-tokens", "4"], "--max-new-tokens applies only when sampling"),
    (["--rollouts", "DENSE", "--trajectories-per-step", "3"],
     "--trajectories-per-step 3 is more than the 1 trajectories of --rollouts DENSE; a step holds each "
     "trajectory at most once, so give at most 1"),
    (["--prompts", "PROMPTS", "--samples", "2", "--trajectories-per-step", "3"],
     "--trajectories-per-step 3 is more than the 2 trajectories that --prompts PROMPTS samples (1 prompt x "
     "--samples 2)"),
    (["--prompts", "PROMPTS", "--train-budgets", "48,48"], "--train-budgets lists 48 more than once"),
    (["--prompts", "PROMPTS", "--init-adapter", "ADAPTER", "--lora-rank", "2", "--lora-alpha", "8"],
     "--init-adapter ADAPTER: the adapter has alpha 4, but --lora-alpha is 8; pass --lora-alpha 4"),
    (["--prompts", "PROMPTS", "--init-adapter", "MISSING"], "--init-adapter MISSING: no such directory"),
]


@pytest.mark.parametrize("args,message", REFUSED_BEFORE_LOADING,
                         ids=["huge-samples", "rollouts-samples", "rollouts-max-new-tokens",
                              "rollouts-batch", "prompts-batch", "train-budgets-twice", "init-adapter-alpha",
                              "init-adapter-missing"])
def test_cli_refuses_before_the_weights_load(cli_files, tmp_path, no_model_load, args, message):
    out = tmp_path / "out"
    files = {**cli_files, "MISSING": str(tmp_path / "nodir")}
    r = runner.invoke(app, ["distill", "--model", cli_files["MODEL"], "--budget", "48",
                            *[files.get(a, a) for a in args], "-o", str(out)])
    line = error_line(r)
    for name, path in files.items():
        message = message.replace(name, path)
    assert message in line, line
    assert not out.exists()


@pytest.mark.parametrize("args", [
    ["--rollouts", "DENSE", "--eval-prompts", "PROMPTS", "--samples", "1", "--max-new-tokens", "4"],
    ["--prompts", "PROMPTS", "--init-adapter", "ADAPTER", "--lora-rank", "2", "--lora-alpha", "4"],
    ["--rollouts", "DENSE", "--trajectories-per-step", "1"],
], ids=["eval-prompts-sample", "init-adapter-same-alpha", "batch-of-all"])
def test_cli_accepts_up_to_the_weights(cli_files, tmp_path, no_model_load, args):
    r = runner.invoke(app, ["distill", "--model", cli_files["MODEL"], "--budget", "48",
                            *[cli_files.get(a, a) for a in args], "-o", str(tmp_path / "out")])
    assert isinstance(r.exception, AssertionError) and "the weights were loaded" in str(r.exception), r.output


HOLD_ADAPTER = """
import sys, time
from sparrow.schemas.locations import hold_output
hold_output(sys.argv[1], "sparrow distill", "another adapter directory (-o)")
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_distill_into_an_adapter_being_written_is_refused(cli_files, tmp_path, no_model_load):
    """While another process writes -o (holding the lock beside it, as a running distill does), a second
    distill to the same directory is refused before its weights load; once that writer is gone, the same
    command goes on to the weights, and no lock file is left beside the adapter."""
    import subprocess
    import sys

    out = tmp_path / "out"
    args = ["distill", "--model", cli_files["MODEL"], "--budget", "48", "--rollouts", cli_files["DENSE"],
            "-o", str(out)]
    proc = subprocess.Popen([sys.executable, "-c", HOLD_ADAPTER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        line = error_line(runner.invoke(app, args))
        assert f"{out} is being written by another sparrow distill (pid {proc.pid})" in line, line
        assert "choose another adapter directory (-o)" in line and not out.exists()
    finally:
        proc.kill()
        proc.wait()
    r = runner.invoke(app, args)
    assert isinstance(r.exception, AssertionError) and "the weights were loaded" in str(r.exception), r.output
    from sparrow.schemas.locations import release_folder

    release_folder(out)  # what the command's exit does
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_cli_rollouts_alone_sample_nothing_and_a_step_holds_them_all(cli_files, tmp_path):
    """--rollouts without --eval-prompts samples nothing and says nothing of sampling; the default
    trajectories per step is lowered to the trajectories there are, as the record says."""
    out = tmp_path / "out"
    r = runner.invoke(app, ["distill", "--model", cli_files["MODEL"], "--rollouts", cli_files["DENSE"],
                            "--budget", "48", "--steps", "1", "--lora-rank", "2", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "sampling" not in r.stderr
    assert json.loads((out / "sparrow_distill.json").read_text())["config"]["batch_size"] == 1


def test_a_write_that_fails_late_leaves_the_previous_output_whole(cli_files, tmp_path, monkeypatch):
    """The folder is replaced whole: a full disk at its last file (mismatch/after.parquet) leaves the
    previous run's folder as it was, every file of it, and says which file could not be written."""
    from sparrow.schemas import ArtifactError
    from sparrow.stages import distill

    out = tmp_path / "out"
    args = ["distill", "--model", cli_files["MODEL"], "--rollouts", cli_files["DENSE"], "--budget", "48",
            "--steps", "1", "--lora-rank", "2", "-o", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    before = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    write = distill.write_artifact

    def full_at_after(data, path, *a, **k):
        if str(path).endswith("after.parquet"):
            raise ArtifactError(f"cannot write {path} (No space left on device)")
        return write(data, path, *a, **k)

    monkeypatch.setattr(distill, "write_artifact", full_at_after)
    r = runner.invoke(app, [*args, "--seed", "7", "--force"])
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines()[-1] == (f"error: cannot write {out}/mismatch/after.parquet (No "
                                                 "space left on device)")
    assert {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    beside = [p.name for p in tmp_path.iterdir() if not p.name.endswith(".sparrow.lock")]
    assert beside == ["out"]  # no hidden version left beside it


# ---------------------------------------------------------------------------- sparrow train --distill-sparse


def test_train_distill_sparse_keeps_the_learner_apart(tiny_llama, vowel_prompts, tmp_path):
    """Two GRPO steps with the sparse actor's adapter trained jointly: the learner (its saved adapter, its
    forward) equals transformers + peft with the learner's adapter alone; the sparse actor is the learner
    plus the sparse adapter (both merged into fresh base weights); the sparse adapter trained."""
    from peft import PeftModel

    from sparrow.stages.train import TrainConfig

    path, hf = tiny_llama
    trainer, summary = test_train._train(path, vowel_prompts, tmp_path / "run", cfg=dict(
        steps=2, sparsity="budget:48", distill_sparse=True, distill_rank=2, distill_alpha=4.0))
    sparse_dir = tmp_path / "run" / "sparse_adapter"
    assert summary["sparse_adapter"] == str(sparse_dir)
    sparse = load_lora(sparse_dir)
    assert sparse.r == 2 and any(b.abs().sum() > 0 for _, b in sparse.modules.values())
    history = json.loads((sparse_dir / "sparrow_distill.json").read_text())["history"]
    assert [h["step"] for h in history] == [1, 2] and all(np.isfinite(h["sparse_kl"]) for h in history)
    x = torch.randint(0, 1000, (2, 20))
    peft_model = PeftModel.from_pretrained(hf, summary["adapter"]).eval()
    with torch.no_grad():
        learner = trainer.model(x)
        assert (peft_model(x).logits - learner).abs().max() < 1e-4
        with trainer.sparse_actor.acting():
            actor = trainer.model(x)
        fresh = load_model(path).model
        with lora_merged(fresh, load_lora(summary["adapter"])), lora_merged(fresh, sparse):
            assert (fresh(x) - actor).abs().max() < 1e-4
    assert (actor - learner).abs().max() > 1e-4
    # the actor sampled: its step-2 rollouts (the sparse adapter trained once) are not the learner's alone
    test_train._train(path, vowel_prompts, tmp_path / "plain", cfg=dict(steps=2, sparsity="budget:48"))
    rows = [read_artifact(tmp_path / d / "metrics.parquet", "metrics").to_pylist() for d in ("run", "plain")]
    assert rows[0][0]["mismatch_kl"] == rows[1][0]["mismatch_kl"]  # step 1: the sparse adapter is still 0
    assert rows[0][1]["mismatch_kl"] != rows[1][1]["mismatch_kl"]
    peft_model.unload()
    for bad, message in ((dict(sparsity="dense"), "needs a sparse sampler"),
                         (dict(sparsity="budget:48", lora_rank=0), "not --full")):
        with pytest.raises(ValueError, match=message):
            TrainConfig(model=path, distill_sparse=True, **bad).validate()


def test_exact_alpha_of_the_joint_sparse_actor(tiny):
    """Under --distill-sparse the logged exact alpha compares the learner (dense) with the sparse actor
    (learner plus its own adapter, sparse): against a reference from the learner's full forward and the
    actor's differentiable teacher-forced sparse form (`actor_hidden`, another attention path) with both
    peft adapters active."""
    from sparrow.stages.engine import Completion
    from sparrow.stages.model.adapter import add_lora
    from sparrow.stages.train import TrainConfig
    from sparrow.stages.train.exact_alpha import exact_alpha
    from sparrow.stages.train.sparse_actor import JointSparseActor

    path, _ = tiny
    model = load_model(path).model
    add_lora(model, 2, 4.0)
    cfg = TrainConfig(model=path, sparsity="budget:48", distill_sparse=True, distill_rank=2)
    policy = as_policy(48)
    joint = JointSparseActor(model, cfg, budget_fn(policy))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # both adapters away from zero: the learner differs from the base, the actor more
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    prompt, comps = _tokens([90])[0], _tokens([12, 7], seed=2)
    completions = [Completion(0, i, prompt, c, [0.0] * len(c), [48] * len(c), "length")
                   for i, c in enumerate(comps)]
    got = exact_alpha(model, completions, policy, 2, 0, 1, 1.0, 12, actor=joint.weights())
    model.eval()
    with torch.no_grad():
        with joint.acting():
            sparse = model.logits(actor_hidden(model, prompt, comps, budget_fn(policy)))  # [2, 12, V]
        for i, c in enumerate(comps):
            dense = model.logits(model.hidden_states(torch.tensor([prompt + c]))[0, len(prompt) - 1: -1])
            want = torch.minimum(dense.double().softmax(-1), sparse[i, : len(c)].double().softmax(-1)).sum(-1)
            assert got[i, : len(c)].double() == pytest.approx(want.tolist(), abs=1e-4)
            assert torch.isnan(got[i, len(c):]).all()
    plain = exact_alpha(model, completions, policy, 2, 0, 1, 1.0, 12)  # the learner alone, both sides
    assert (plain[0] - got[0]).abs().max() > 1e-3


def test_train_distill_sparse_resumes_bit_exact(tiny_llama, vowel_prompts, tmp_path):
    """A --distill-sparse run that crashes in its third update and resumes from the step-1 checkpoint ends
    with the uninterrupted run's metrics, both adapters bit for bit and the sparse adapter's history."""
    path = tiny_llama[0]
    cfg = dict(steps=3, sparsity="budget:48", distill_sparse=True, distill_rank=2, distill_alpha=4.0)
    straight, _ = test_train._train(path, vowel_prompts, tmp_path / "straight", cfg=cfg)
    with pytest.raises(test_train.Crash):
        test_train._train(path, vowel_prompts, tmp_path / "resumed", cfg=cfg,
                          on_phase=test_train.crash_in_update(3))
    resumed, _ = test_train._train(path, vowel_prompts, tmp_path / "resumed", cfg=cfg, resume=True)
    assert test_train._metrics(tmp_path / "resumed") == test_train._metrics(tmp_path / "straight")
    a = {k: v for k, v in straight.model.named_parameters() if "lora_" in k}
    b = {k: v for k, v in resumed.model.named_parameters() if "lora_" in k}
    assert any(".sparse." in k for k in a) and a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    history = [json.loads((tmp_path / run / "sparse_adapter" / "sparrow_distill.json").read_text())["history"]
               for run in ("straight", "resumed")]
    assert [h["step"] for h in history[1]] == [1, 2, 3]
    assert history[0] == history[1]
