"""The training mismatch figure names its bins at the width the step files record, else at the width their
positions and bins imply (a foreign writer's files record none), never at a width the files contradict."""

import html
import re

from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import write_artifact


def _steps(run, bin_width: int, metadata: dict | None) -> None:
    positions = list(range(0, 200, 7))
    n = len(positions)
    for s in range(2):
        write_artifact({"step": [s] * n, "prompt_id": ["p"] * n, "sample": [0] * n, "position": positions,
                        "bin": [p // bin_width for p in positions], "budget": [64] * n, "token_id": [1] * n,
                        "logp_rollout": [-1.0] * n, "logp_dense": [-1.1] * n, "log_ratio": [0.1] * n,
                        "k3": [0.005] * n, "alpha_top20_lb": [0.9] * n, "weight": [1.0] * n,
                        "masked": [False] * n, "vetoed": [False] * n},
                       run / "mismatch" / f"step={s:05d}.parquet", "train_mismatch", metadata=metadata)


def _caption(run) -> str:
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    page = (run / "report" / "index.html").read_text()
    return html.unescape(re.search(r"<figure id='train-mismatch-[^']*'>.*?<figcaption>(.*?)</figcaption>",
                                   page, re.S)[1])


def test_step_files_without_a_recorded_width_are_read_at_the_width_their_bins_imply(tmp_path):
    # positions 0..196 in bins of 64: bins 0-3; 512 does not fit (bin 1 starts at 70 < 512)
    _steps(tmp_path / "run", 64, None)
    caption = _caption(tmp_path / "run")
    assert "in bins of 64 tokens (inferred from the 'bin' column" in caption


def test_step_files_recording_a_width_are_read_at_it(tmp_path):
    _steps(tmp_path / "run", 128, {"bin_width": 128})
    caption = _caption(tmp_path / "run")
    assert "in bins of 128 tokens, one line per bin" in caption
