"""`sparrow train`'s options that would do nothing are refused in one sentence before any model loads: a
LoRA scale of zero or below, LoRA options beside --full, and correction options that the resolved rules
never read; the options that do act stay accepted, and the help says what each flag does."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import write_artifact
from sparrow.stages.train import LossConfig, rollout_correction
from sparrow.stages.train.objective import CORRECTIONS

from cli_checks import error_line

runner = CliRunner()
WITH_IS = "tis, sparse-rl, icepop, seq-mask-tis, sparrow"  # the presets whose rules weight by IS


def train_args(tmp_path: Path, *extra: str) -> list[str]:
    """A one-step tiny-llama run over two token-id prompts (no tokenizer needed)."""
    rows = [{"prompt_id": f"p{i}", "task": "basic_arithmetic", "prompt": None,
             "prompt_token_ids": list(range(5, 25)), "answer": "3", "metadata": None} for i in range(2)]
    prompts = write_artifact(rows, tmp_path / "p.parquet", "prompts")
    return ["train", "--model", "tiny-llama", "--prompts", str(prompts), "--steps", "1", "--prompts-per-step",
            "1", "--samples", "2", "--max-new-tokens", "2", "-o", str(tmp_path / "run"), *extra]


class Validated(Exception):
    """Raised where `sparrow train` has checked its options and the run's configuration."""


@pytest.fixture()
def stop_after_validation(monkeypatch):
    """Ends `sparrow train` right after its configuration validated (at the --device check)."""
    import sparrow.cli.train as cli_train

    def stop(*a, **k):
        raise Validated()

    monkeypatch.setattr(cli_train, "check_device", stop)


# ---------------------------------------------------------------- the LoRA's options


@pytest.mark.parametrize("extra,expected", [
    (["--lora-alpha", "0"], "error: --lora-alpha must be positive, got 0.0"),
    (["--lora-alpha", "-3"], "error: --lora-alpha must be positive, got -3.0"),
    (["--full", "--lora-rank", "8"], "error: --lora-rank 8 sets the LoRA, but --full trains every weight "
                                     "without one; drop --lora-rank or --full"),
    (["--full", "--lora-rank", "16"], "error: --lora-rank 16 sets the LoRA, but --full trains every weight "
                                      "without one; drop --lora-rank or --full"),
    (["--lora-alpha", "8", "--full"], "error: --lora-alpha 8 sets the LoRA, but --full trains every weight "
                                      "without one; drop --lora-alpha or --full"),
])
def test_lora_options_that_train_nothing_or_are_dropped_are_refused(tmp_path, no_work, extra, expected):
    """alpha / rank scales every LoRA update, so alpha 0 trains nothing (distill refuses it in the same
    words); --full has no LoRA, so its rank and alpha, given even at their defaults, would be dropped."""
    result = runner.invoke(app, train_args(tmp_path, *extra))
    assert result.exit_code == 2 and error_line(result) == expected
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("alpha,learns", [(0.0, False), (32.0, True)])
def test_a_lora_of_alpha_zero_gets_no_gradient(alpha, learns):
    """Why alpha <= 0 is refused: peft scales the LoRA by alpha / rank, so at alpha 0 neither factor gets a
    gradient and every step leaves the adapter as it started."""
    import peft

    class Proj(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x)

    torch.manual_seed(0)
    model = peft.get_peft_model(Proj(), peft.LoraConfig(r=2, lora_alpha=alpha, target_modules=["proj"]))
    model(torch.randn(3, 4)).square().sum().backward()
    grads = [p.grad.abs().max().item() for n, p in model.named_parameters() if "lora_" in n]
    assert len(grads) == 2 and (max(grads) > 0) == learns


@pytest.mark.parametrize("extra", [["--full"], ["--lora-alpha", "0.5"], ["--no-full", "--lora-rank", "8"],
                                   ["--lora-rank", "4", "--lora-alpha", "8"]])
def test_lora_options_that_act_pass_the_checks(tmp_path, stop_after_validation, extra):
    assert isinstance(runner.invoke(app, train_args(tmp_path, *extra)).exception, Validated)


@pytest.mark.parametrize("extra,expected", [
    (["--distill-rank", "8"], "error: --distill-rank sets the sparse actor's LoRA, which only "
                              "--distill-sparse trains; add --distill-sparse or drop it"),
    (["--distill-alpha", "8", "--distill-kl-coef", "0.01"],
     "error: --distill-alpha, --distill-kl-coef set the sparse actor's LoRA, which only --distill-sparse "
     "trains; add --distill-sparse or drop them"),
    (["--distill-sparse", "--distill-alpha", "0"], "error: --distill-alpha must be positive, got 0.0"),
    (["--distill-sparse", "--distill-rank", "0"], "error: --distill-rank must be at least 1, got 0"),
])
def test_sparse_actor_options_without_its_lora_are_refused(tmp_path, no_work, extra, expected):
    result = runner.invoke(app, train_args(tmp_path, "--budget", "64", *extra))
    assert result.exit_code == 2 and error_line(result) == expected
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- correction options without effect


def batch():
    """Three sequences of 5, 3 and 4 tokens: log ratios spread around 0, acceptance alphas in [0.5, 1]."""
    g = torch.Generator().manual_seed(0)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 3, 4])[:, None]
    log_ratio = torch.randn(3, 5, generator=g, dtype=torch.float64)
    alpha = torch.rand(3, 5, generator=g, dtype=torch.float64) * 0.5 + 0.5
    return log_ratio, mask, alpha


def weights_of(options: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, kept) of the rules these options resolve to, validated or not, on `batch()`."""
    log_ratio, mask, alpha = batch()
    corr = rollout_correction(log_ratio, mask, LossConfig(**options), advantages=torch.zeros(3), alpha=alpha,
                              generator=torch.Generator().manual_seed(1))
    return corr.weights, corr.mask


IDLE = {  # options the resolved rules never read -> (the weights they would give, by hand; the refusal)
    "is threshold without IS": (["--correction", "none", "--rollout-is-threshold", "3"],
                                dict(correction="none", rollout_is_threshold="3"), "ones",
                                "--rollout-is-threshold bounds the IS weights, but --correction none has no "
                                "IS: add --rollout-is token or sequence, or pick a --correction with it "
                                f"({WITH_IS})"),
    "is mode without IS": (["--correction", "none", "--rollout-is-mode", "mask"],
                           dict(correction="none", rollout_is_mode="mask"), "ones",
                           "--rollout-is-mode picks how the IS weights are bounded, but --correction none "
                           "has no IS: add --rollout-is token or sequence, or pick a --correction with it "
                           f"({WITH_IS})"),
    "batch normalisation without weights": (
        ["--correction", "none", "--rollout-is-batch-normalize"],
        dict(correction="none", rollout_is_batch_normalize=True), "ones",
        "--rollout-is-batch-normalize divides the IS or alpha weights by their mean, but --correction none "
        f"has no IS: add --rollout-is token or sequence, or pick a --correction with it ({WITH_IS}), or add "
        "--alpha-weight"),
    "is threshold with IS turned off": (["--rollout-is", "none", "--rollout-is-threshold", "3"],
                                        dict(rollout_is="none", rollout_is_threshold="3"), "ones",
                                        "--rollout-is-threshold bounds the IS weights, but --rollout-is none "
                                        "turns IS off: give --rollout-is token or sequence"),
    "rejection C without rejection": (["--correction", "none", "--rejection-c", "2"],
                                      dict(correction="none", rejection_c=2.0), "ones",
                                      "--rejection-c is the stochastic rejection's C, but --correction none "
                                      "has no stochastic rejection: add --rejection token or sequence, or "
                                      "pick a --correction with it (sparrow)"),
    "rs threshold with rs none": (["--rollout-rs", "none", "--rollout-rs-threshold", "3"],
                                  dict(rollout_rs="none", rollout_rs_threshold="3"), "tis",
                                  "--rollout-rs-threshold needs --rollout-rs options to bound, and "
                                  "--rollout-rs none names none"),
}


@pytest.mark.parametrize("case", IDLE)
def test_correction_options_without_effect_are_refused(tmp_path, no_work, case):
    """Each option, had it been let through, gives the weights of the rules without it (computed here from
    their definitions: all ones without a correction, min(r, 2) under the default token TIS), so the run's
    config.json would name a correction that never ran; refused in one sentence, nothing written."""
    argv, options, expect, message = IDLE[case]
    log_ratio, mask, _ = batch()
    by_hand = torch.ones_like(log_ratio) if expect == "ones" else log_ratio.exp().clamp(max=2.0)
    weights, kept = weights_of(options)
    assert torch.equal(kept, mask) and torch.allclose(weights, torch.where(mask, by_hand, 0.0))
    with pytest.raises(ValueError) as refused:
        LossConfig(**options).validate()
    assert str(refused.value) == message
    result = runner.invoke(app, train_args(tmp_path, *argv))
    assert result.exit_code == 2 and error_line(result) == f"error: {message}"
    assert not (tmp_path / "run").exists()


def test_every_preset_validates_with_its_defaults():
    for name in CORRECTIONS:
        LossConfig(correction=name).validate()
        LossConfig(correction=name, rollout_is_batch_normalize=False).validate()  # off is never refused


ACTING = {  # options that change the correction under the rules they resolve to
    "IS on with its threshold (verl's token TIS)": dict(correction="none", rollout_is="token",
                                                        rollout_is_threshold="1.5"),
    "a preset's IS with another mode": dict(correction="tis", rollout_is_mode="mask"),
    "alpha weights batch-normalised, no IS": dict(correction="none", alpha_weight=True,
                                                  rollout_is_batch_normalize=True),
    "the sparrow recipe's C": dict(correction="sparrow", rejection_c=0.5),
    "rejection on with its C": dict(correction="none", rejection="token", rejection_c=0.5),
    "rs with its threshold": dict(correction="none", rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25"),
}


@pytest.mark.parametrize("case", ACTING)
def test_correction_options_that_act_are_accepted(case):
    """Accepted, and each changes the weights or the kept tokens against the same rules without it."""
    options = ACTING[case]
    LossConfig(**options).validate()
    base = {k: v for k, v in options.items() if k in ("correction", "rollout_is", "rejection", "rollout_rs",
                                                      "alpha_weight")}
    if "rollout_rs_threshold" in options:  # the rule at its default bounds
        base["rollout_rs_threshold"] = "2.0"
    weights, kept = weights_of(options)
    base_weights, base_kept = weights_of(base)
    assert not (torch.equal(kept, base_kept) and torch.allclose(weights, base_weights)), case


def test_alpha_weights_batch_normalised_are_divided_by_their_mean():
    """Without IS the normalisation divides the alpha weights by their mean over the kept tokens."""
    _, mask, alpha = batch()
    weights, kept = weights_of(dict(correction="none", alpha_weight=True, rollout_is_batch_normalize=True))
    assert torch.equal(kept, mask)
    assert torch.allclose(weights, torch.where(mask, alpha / alpha[mask].mean(), 0.0))


# ---------------------------------------------------------------- help


def train_help() -> dict:
    command = typer.main.get_command(app).commands["train"]
    return {p.name: p for p in command.params}


def test_dense_help_does_not_contradict_its_shown_default():
    dense = train_help()["dense"]
    assert not dense.show_default and "(the default)" not in dense.help
    text = " ".join(re.sub(r"[│─╭╮╰╯]", " ", runner.invoke(app, ["train", "--help"],
                                                         env={"COLUMNS": "300"}).output).split())
    assert "[default: no-dense]" not in text
    assert "Roll out densely, as a run does without --budget, --schedule or --kv-compression." in text


def test_format_help_of_a_run_does_not_describe_stdout_output():
    """train refuses -o - (a run is a directory), so its -f help says nothing of it."""
    fmt = train_help()["format"]
    assert "-o -" not in fmt.help and "stderr" not in fmt.help
    assert fmt.help.startswith("The summary's format: table, csv, json or tsv on stdout")




def test_max_num_seqs_below_one_is_refused(tmp_path, no_work):
    result = runner.invoke(app, train_args(tmp_path, "--max-num-seqs", "0"))
    assert error_line(result) == "error: --max-num-seqs must be at least 1, got 0"


@pytest.mark.parametrize("flag", ["--batch-size", "--batch"])
def test_an_ambiguous_batch_flag_is_refused_on_train(tmp_path, no_work, flag):
    """On rollout and profile --batch-size is the engine's --max-num-seqs; a TRL or verl user means a
    training batch by it, so train names the options that say which instead of taking either."""
    line = error_line(runner.invoke(app, train_args(tmp_path, flag, "8")))
    assert line == ("error: --batch-size and --batch are ambiguous for a training run: a step's batch is "
                    "--prompts-per-step x "
                    "--samples, the update's --micro-batch, and the rollout engine's --max-num-seqs")
    assert not (tmp_path / "run").exists()


def test_max_batch_stays_an_alias_of_max_num_seqs_on_train(tmp_path, stop_after_validation):
    with pytest.raises(Validated):
        runner.invoke(app, train_args(tmp_path, "--max-batch", "2"), catch_exceptions=False)
