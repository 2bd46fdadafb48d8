"""train --max-num-seqs (verl's rollout.max_num_seqs): the rollout engine decodes at most N samples
together, the others wait their turn, and a step samples the same tokens as with all of them at once."""

from __future__ import annotations

from test_train import VOWELS, tiny_llama, vowel_token_prompts  # noqa: F401 - tiny_llama is a fixture
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import read_artifact, write_artifact
from sparrow.stages.model.loading import load_model
from sparrow.stages.tasks import TASKS


def test_max_num_seqs_bounds_the_engine_batch_and_keeps_the_samples(tiny_llama, tmp_path,  # noqa: F811
                                                                     monkeypatch):
    import sparrow.stages.train.rollouts as rollouts

    monkeypatch.setitem(TASKS, "vowels", VOWELS)
    batches = []
    made = rollouts.make_engine

    def recording(model, policy, max_batch, *a, **k):
        batches.append(max_batch)
        return made(model, policy, max_batch, *a, **k)

    monkeypatch.setattr(rollouts, "make_engine", recording)
    tok = load_model(tiny_llama[0]).tokenizer
    prompts = write_artifact(vowel_token_prompts(tok, 2, 2), tmp_path / "p.parquet", "prompts")
    tokens = {}
    for name, extra in (("all", []), ("one", ["--max-num-seqs", "1"])):
        run = tmp_path / name
        result = CliRunner().invoke(app, ["train", "--model", tiny_llama[0], "--prompts", str(prompts),
                                          "--steps", "1", "--prompts-per-step", "2", "--samples", "2",
                                          "--max-new-tokens", "4", "--threads", "1", *extra, "-o", str(run)])
        assert result.exit_code == 0, result.output
        table = read_artifact(run / "mismatch" / "step=00001.parquet", "train_mismatch")
        tokens[name] = sorted(zip(table["prompt_id"].to_pylist(), table["sample"].to_pylist(),
                                  table["position"].to_pylist(), table["token_id"].to_pylist()))
    assert batches == [4, 1]  # 2 prompts x 2 samples, then --max-num-seqs 1
    assert tokens["all"] == tokens["one"] and len(tokens["all"]) >= 4
