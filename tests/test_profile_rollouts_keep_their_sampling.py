"""`profile --rollouts` keeps in the mismatch metadata how the given trajectories were sampled, as the
rollouts artifact records it (its top_p, top_k and max_new_tokens, beside the temperature it already
kept), so that `sparrow sql`'s provenance columns say it and do not read null."""

from __future__ import annotations

from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, write_artifact

runner = CliRunner()


def test_profile_of_rollouts_keeps_their_top_p_top_k_and_max_new_tokens(tmp_path):
    run = tmp_path / "run"
    rollouts = write_artifact(
        {"prompt_id": ["p0", "p1"], "sample": [0, 0], "prompt_token_ids": [list(range(3, 40))] * 2,
         "token_ids": [[7, 8, 9, 10], [7, 8]], "text": [None, None], "logprobs": [[-0.1] * 4, [-0.1] * 2],
         "budgets": [[0, 0, 0, 0], [0, 0]], "finish_reason": ["length", "stop"], "reward": [None, None]},
        tmp_path / "rollouts.parquet", "rollouts",
        metadata={"sparsity": "dense", "temperature": 0.8, "top_p": 0.9, "top_k": 20, "max_new_tokens": 4})
    mismatch = run / "mismatch.parquet"
    r = runner.invoke(app, ["profile", "--model", "tiny-llama", "--rollouts", str(rollouts), "--budgets",
                            "48", "--threads", "1", "-o", str(mismatch)])
    assert r.exit_code == 0, r.output
    meta = artifact_metadata(mismatch)
    assert (meta["temperature"], meta["top_p"], meta["top_k"], meta["max_new_tokens"]) == (0.8, 0.9, 20, 4)
    r = runner.invoke(app, ["sql", "SELECT DISTINCT source_top_p, source_top_k, source_max_new_tokens "
                            "FROM mismatch", "--run", str(run), "-f", "csv"])
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[1:] == ["0.9,20,4"]
