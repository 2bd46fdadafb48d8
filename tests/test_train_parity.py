"""Issue 29 through the trainer on the tiny Llama: a batch with every token rejected is a logged, skipped
update and the run goes on; resume stays bit-exact with the stochastic rejection on; the rollout_corr/
metrics agree with the per-token log; oversample-and-select keeps the samples of highest acceptance;
evaluation runs under both samplers."""

from __future__ import annotations

import pytest
import test_train
import torch
from test_train import Crash, _metrics, _train, crash_in_update

from sparrow.schemas import read_artifact

tiny_llama, vowel_prompts = test_train.tiny_llama, test_train.vowel_prompts  # the fixtures


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory):
    """test_train's tiny Llama with 4 layers: layers 0-1 stay dense, so 2-3 make a budget sparse."""
    import transformers

    from sparrow.stages.model.loading import embedded_checkpoint

    tok = transformers.AutoTokenizer.from_pretrained(embedded_checkpoint())
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    path = tmp_path_factory.mktemp("deep-llama")
    hf.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path), hf


def rows(run):
    return read_artifact(run / "metrics.parquet", "metrics").to_pylist()


def mismatch(run, step):
    return read_artifact(run / "mismatch" / f"step={step:05d}.parquet", "train_mismatch").to_pylist()


def test_a_batch_with_every_token_rejected_skips_its_update(tiny_llama, vowel_prompts, tmp_path):
    """Acceptance min(1, r / 1e9) rejects every token: no optimizer step (the adapter stays at its
    initial value, lora_B = 0, and AdamW holds no state), each row says why, the run finishes."""
    cfg = dict(steps=2, correction="sparrow", loss={"rejection_c": 1e9})
    trainer, summary = _train(tiny_llama[0], vowel_prompts, tmp_path / "run", cfg=cfg)
    assert summary["steps"] == 2 and summary["skipped_updates"] == 2
    for r in rows(tmp_path / "run"):
        assert r["update_skipped"] == "the rollout correction rejected every token of the batch"
        assert r["rollout_corr/rollout_rs_masked_fraction"] == 1.0 and r["grad_norm"] == 0.0
    assert all(bool((p == 0).all()) for k, p in trainer.model.named_parameters() if "lora_B" in k)
    assert not trainer.optimizer.state


def test_resume_is_bit_exact_with_the_stochastic_rejection(tiny_llama, vowel_prompts, tmp_path):
    path = tiny_llama[0]
    cfg = dict(correction="sparrow", sparsity="budget:48", loss={"rejection_c": 1.2})
    straight, _ = _train(path, vowel_prompts, tmp_path / "straight", cfg=cfg)
    logged = _metrics(tmp_path / "straight")
    assert any(r["rollout_corr/rollout_rs_rejection_masked_fraction"] > 0 for r in logged)  # it rejects
    assert all(r["rollout_corr/rollout_rs_masked_fraction"] < 1 for r in logged)
    with pytest.raises(Crash):
        _train(path, vowel_prompts, tmp_path / "resumed", cfg=cfg, on_phase=crash_in_update(3))
    resumed, _ = _train(path, vowel_prompts, tmp_path / "resumed", cfg=cfg, resume=True)
    assert _metrics(tmp_path / "resumed") == logged
    a = {k: v for k, v in straight.model.named_parameters() if "lora_" in k}
    b = {k: v for k, v in resumed.model.named_parameters() if "lora_" in k}
    assert all(torch.equal(a[k], b[k]) for k in a)
    for step in (1, 2, 3):
        assert mismatch(tmp_path / "resumed", step) == mismatch(tmp_path / "straight", step)


def test_correction_metrics_agree_with_the_per_token_log(deep_llama, vowel_prompts, tmp_path):
    """kl is the mean of log p_rollout - log p_dense (the logged log ratio log r_t, negated), k3_kl the mean
    of the logged k3; the IS statistics those of min(r, 2) over the logged tokens (r = exp(log_ratio)); the
    masked fraction that of the log."""
    run = tmp_path / "run"
    loss = {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.999_1.001"}
    cfg = dict(steps=2, sparsity="budget:48", ignore_eos=True, loss=loss)
    _train(deep_llama[0], vowel_prompts, run, cfg=cfg)
    for r in rows(run):
        log = mismatch(run, r["step"])
        lr = -torch.tensor([t["log_ratio"] for t in log], dtype=torch.float64)  # log p_rollout - log p_dense
        w = (-lr).exp().clamp(max=2.0)
        assert r["rollout_corr/kl"] == pytest.approx(float(lr.mean()), abs=1e-6)
        assert r["rollout_corr/k3_kl"] == pytest.approx(sum(t["k3"] for t in log) / len(log), abs=1e-6)
        assert r["rollout_corr/is_bounded_mean"] == pytest.approx(float(w.mean()), abs=1e-5)
        assert r["rollout_corr/is_bounded_eff_sample_size"] == pytest.approx(
            float(w.mean() ** 2 / (w ** 2).mean()), abs=1e-5)
        masked = sum(t["masked"] for t in log) / len(log)
        assert r["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(masked)
        assert r["rollout_corr/rollout_rs_token_k1_masked_fraction"] == pytest.approx(masked)
        assert 0 < masked < 1
        assert r["alpha_lb_p5_by_bin"] and r["alpha_lb_p5_by_bin"][0] == pytest.approx(r["alpha_lb_p5"])


def test_oversample_keeps_the_samples_of_highest_acceptance(tiny_llama, vowel_prompts, tmp_path):
    run = tmp_path / "run"
    cfg = dict(steps=1, samples=2, oversample=4, sparsity="budget:48", ignore_eos=True)
    _train(tiny_llama[0], vowel_prompts, run, cfg=cfg)
    row = rows(run)[0]
    log = mismatch(run, 1)
    per_sample: dict[tuple, list[float]] = {}
    for t in log:
        per_sample.setdefault((t["prompt_id"], t["sample"]), []).append(
            1.0 if t["budget"] == 0 else t["alpha_top20_lb"])
    assert len(per_sample) == 2 * 2  # 2 prompts x 2 kept of 4
    kept = [sum(v) / len(v) for v in per_sample.values()]
    assert row["oversample_acceptance_kept"] == pytest.approx(sum(kept) / len(kept), abs=1e-5)
    assert row["oversample_acceptance_kept"] >= row["oversample_acceptance_dropped"]
    with pytest.raises(ValueError, match="--oversample must exceed --samples"):
        _train(tiny_llama[0], vowel_prompts, tmp_path / "bad", cfg=dict(samples=3, oversample=3))


def test_eval_under_both_samplers(tiny_llama, vowel_prompts, tmp_path):
    _train(tiny_llama[0], vowel_prompts, tmp_path / "sparse", cfg=dict(steps=2, sparsity="budget:48"))
    evals = [r for r in rows(tmp_path / "sparse") if r["eval_accuracy"] is not None]
    assert evals and all(0 <= r["eval_accuracy_sparse"] <= 1 for r in evals)
    _train(tiny_llama[0], vowel_prompts, tmp_path / "dense", cfg=dict(steps=2))
    assert all(r["eval_accuracy_sparse"] is None for r in rows(tmp_path / "dense"))


def test_cli_correction_options_and_trackers(tiny_llama, vowel_prompts, tmp_path):
    """The verl / TRL options through `sparrow train`, each step's row in RUN/metrics.jsonl (and, where
    the tensorboard package is installed, as scalars TensorBoard reads back); bad values are refused in
    one sentence before anything is written."""
    import importlib.util
    import json

    from typer.testing import CliRunner

    from sparrow.cli.app import app

    from cli_checks import error_line

    runner = CliRunner()
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    run = tmp_path / "run"
    args = ["train", "--model", tiny_llama[0], "--prompts", str(vowel_prompts), "--steps", "2",
            "--prompts-per-step", "2", "--samples", "2", "--max-new-tokens", "4", "--lora-rank", "2",
            "--budget", "48", "--correction", "sparrow", "--rollout-rs", "seq_mean_k1",
            "--rollout-rs-threshold", "0.5_2", "--loss-agg", "dr_grpo", "--oversample", "3"]
    result = runner.invoke(app, [*args, "--report-to", "jsonl,tensorboard" if tensorboard else "jsonl",
                                 "-o", str(run)])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    plain = lambda r: {k: (None if isinstance(v, float) and v != v else v) for k, v in r.items()
                       if k not in ("alpha_lb_p5_by_bin", "alpha_p5_by_bin")}  # float32 in the parquet
    assert [plain(r) for r in lines] == [plain(r) for r in rows(run)]  # the parquet's rows, as JSON
    config = json.loads((run / "checkpoint" / "config.json").read_text())
    assert config["loss"] == {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.5_2",
                              "loss_agg": "dr_grpo"} and config["oversample"] == 3
    if tensorboard:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(run / "tensorboard"))
        events.Reload()
        kl = events.Scalars("rollout_corr/kl")
        assert [e.step for e in kl] == [1, 2]
        assert [e.value for e in kl] == pytest.approx([r["rollout_corr/kl"] for r in lines], rel=1e-6)
    for bad, words in ((["--rollout-rs", "token_k9"], "--rollout-rs must be a comma list of"),
                       (["--rollout-is-threshold", "3_2"], "L < U"),
                       (["--report-to", "mlflow"], "--report-to must be a comma list of"),
                       (["--oversample", "2"], "--oversample must exceed --samples")):
        line = error_line(runner.invoke(app, [*args, *bad, "-o", str(tmp_path / "bad")]))
        assert words in line, line
    if importlib.util.find_spec("wandb") is None:
        line = error_line(runner.invoke(app, [*args, "--report-to", "wandb", "-o", str(tmp_path / "bad")]))
        assert "--report-to wandb needs the wandb package, which is not installed" in line
    assert not (tmp_path / "bad").exists()
