"""A user's --reward-fn is loaded once per version of its file: a notebook that edits the file and runs
again scores with the edited function (the one whose sha256 the provenance records), not the first."""

from __future__ import annotations

from sparrow.stages.tasks import get_task
from sparrow.stages.tasks.reward_function import register_function, reward_fn_sha256

VERL = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return {value}\n"


def _score(task: str) -> float:
    return get_task(task).judge_many([("any completion", "gold", {})])[0].reward


def test_an_edited_reward_file_is_loaded_again(tmp_path):
    file = tmp_path / "my_reward.py"
    file.write_text(VERL.format(value=0.25))
    spec = f"{file}:compute_score"
    first = register_function(spec)
    assert _score(first) == 0.25
    assert register_function(spec) == first  # unchanged: not imported again
    file.write_text(VERL.format(value=0.75))
    again = register_function(spec)
    assert _score(again) == 0.75
    assert reward_fn_sha256(spec) == __import__("hashlib").sha256(file.read_bytes()).hexdigest()
