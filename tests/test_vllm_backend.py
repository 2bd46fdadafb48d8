"""`sparrow rollout --engine vllm` (stages/backends/vllm_sampler.py).

Fast tests, always run, need no vLLM: what vLLM cannot do (sparse flags, adapters, truncated sampling)
is refused in one sentence before anything loads, and a missing extra says how to install it (the
only place the import is faked). The slow tests run only where vLLM is installed (`make vllm`), each
through the CLI into the rollouts artifact, vLLM in fp32: greedy tokens on SmolLM2-135M equal
transformers' greedy generate, and sampled-token logprobs (greedy, and sampled at T = 0.7) equal our
teacher-forced dense logprobs (`score_sequences`) within 1e-3 nats.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact
from sparrow.stages.backends.vllm_sampler import vllm_checkpoint
from sparrow.stages.model.config import ModelSpecError

from cli_checks import error_line

runner = CliRunner()
LOGPROB_TOL = 1e-3  # nats; fp32 on both sides, different kernels (measured gap about 1e-4)




@pytest.mark.parametrize("args,message", [
    (["--budget", "64"], "--budget, --schedule and --kv-compression need --engine ours"),
    (["--schedule", "SCHED"], "--budget, --schedule and --kv-compression need --engine ours"),
    (["--kv-compression", "snapkv", "--kv-budget", "64"],
     "--budget, --schedule and --kv-compression need --engine ours"),
    (["--top-p", "0.9"], "--top-k/--top-p are not supported with --engine vllm"),
    (["--top-k", "20"], "--top-k/--top-p are not supported with --engine vllm"),
    (["--adapter", "ADAPTER"], "--adapter is not supported with --engine vllm"),
])
def test_vllm_refuses_what_it_cannot_do(prompts_file, tmp_path, args, message):
    files = {"SCHED": str(tmp_path / "schedule.parquet"), "ADAPTER": str(tmp_path)}
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, ["rollout", "--prompts", str(prompts_file), "--engine", "vllm", "-o", str(out),
                            *[files.get(a, a) for a in args]])
    assert message in error_line(r)
    assert not out.exists()


def test_unknown_engine_refused(prompts_file, tmp_path):
    r = runner.invoke(app, ["rollout", "--prompts", str(prompts_file), "--engine", "hf",
                            "-o", str(tmp_path / "r.parquet")])
    assert "--engine must be ours or vllm, got 'hf'" in error_line(r)


def test_missing_extra_says_how_to_install(prompts_file, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, ["rollout", "--prompts", str(prompts_file), "--engine", "vllm", "-o", str(out)])
    line = error_line(r)
    assert "pip install -e '.[vllm]'" in line and "make vllm" in line
    assert not out.exists()


def test_vllm_checkpoint_is_a_loadable_directory():
    folder = vllm_checkpoint("smollm2-135m")  # the converted GGUF cache
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).exists(), name
    with pytest.raises(ModelSpecError, match="has no weights"):
        vllm_checkpoint("qwen3-4b")
    with pytest.raises(ModelSpecError, match="not 'model.gguf'"):
        vllm_checkpoint("model.gguf")


def test_vllm_checkpoint_expands_the_home_directory(tmp_path, monkeypatch):
    """`~/ckpt` names the folder under $HOME, as --model reads it for our engine."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        (folder / name).write_text("{}")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert vllm_checkpoint("~/ckpt") == folder


# ---------------------------------------------------------------------------- with vLLM installed


@pytest.mark.slow
def test_vllm_rollouts_match_transformers_and_teacher_forcing(prompts_file, tmp_path, smollm2):
    """One CLI run (vLLM start-up is 1.5-3 minutes here), greedy with 2 samples per prompt: tokens
    equal transformers' greedy generate (fp32), logprobs equal our dense teacher-forced ones."""
    pytest.importorskip("vllm")
    import transformers

    from sparrow.stages.model.loading import embedded_checkpoint
    from sparrow.stages.scoring.mismatch import score_sequences

    out = tmp_path / "r.parquet"
    new = 24
    r = runner.invoke(app, ["rollout", "--prompts", str(prompts_file), "--engine", "vllm", "--samples", "2",
                            "--temperature", "0", "--max-new-tokens", str(new), "--seed", "3",
                            "-o", str(out)])
    assert r.exit_code == 0, r.output
    rows = read_artifact(out, "rollouts").to_pylist()
    meta = artifact_metadata(out)
    assert meta["engine"] == "vllm" and meta["sparsity"] == "dense" and meta["summary"]["samples"] == 4
    assert [x["sample"] for x in rows] == [0, 1, 0, 1]

    hf = transformers.AutoModelForCausalLM.from_pretrained(embedded_checkpoint(), dtype=torch.float32)
    for x in rows:
        ids = torch.tensor([x["prompt_token_ids"]])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              eos_token_id=smollm2.config.eos_token_ids[0], pad_token_id=0)
        assert x["token_ids"] == ref[0, ids.shape[1]:].tolist()
        assert x["budgets"] == [0] * len(x["token_ids"])
        assert x["finish_reason"] == ("stop" if len(x["token_ids"]) < new else "length")

    scored = score_sequences(smollm2.model, [x["prompt_token_ids"] for x in rows],
                             [x["token_ids"] for x in rows], [], temperature=1.0)
    got = np.concatenate([x["logprobs"] for x in rows])
    assert np.abs(got - scored.logp_dense).max() <= LOGPROB_TOL


@pytest.mark.slow
def test_vllm_sampled_logprobs_follow_our_temperature_convention(prompts_file, tmp_path, smollm2):
    """Sampled at T = 0.7 (EOS ignored): each logprob is log_softmax(logits / T) of the sampled token,
    as our engine reports it, so teacher forcing at T = 0.7 gives the same numbers."""
    pytest.importorskip("vllm")
    from sparrow.stages.scoring.mismatch import score_sequences

    out = tmp_path / "r.parquet"
    r = runner.invoke(app, ["rollout", "--prompts", str(prompts_file), "--engine", "vllm", "--samples", "3",
                            "--temperature", "0.7", "--max-new-tokens", "16", "--ignore-eos", "-o", str(out)])
    assert r.exit_code == 0, r.output
    rows = read_artifact(out, "rollouts").to_pylist()
    assert [x["sample"] for x in rows] == [0, 1, 2, 0, 1, 2]
    assert all(len(x["token_ids"]) == 16 and x["finish_reason"] == "length" for x in rows)
    assert len({tuple(x["token_ids"]) for x in rows[:3]}) > 1  # sampled, not three copies
    scored = score_sequences(smollm2.model, [x["prompt_token_ids"] for x in rows],
                             [x["token_ids"] for x in rows], [], temperature=0.7)
    got = np.concatenate([x["logprobs"] for x in rows])
    assert np.abs(got - scored.logp_dense).max() <= LOGPROB_TOL
