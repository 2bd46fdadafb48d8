"""Sparrow used as a library leaves the process as it found it: importing it sets no Hugging Face
variable (a user's own Hub downloads in the same script keep working), its tokenizers load from local
files without that variable, and loading random weights does not reset the caller's torch random stream."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from sparrow.stages.model.loading import load_model

OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def _without_offline_variables() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in OFFLINE}


def test_importing_the_library_sets_no_hugging_face_variable_and_loads_local_tokenizers():
    script = (
        "import os\n"
        "from sparrow.stages.integrations.trl import SparseRollout\n"
        "from sparrow.stages.model.loading import load_model\n"
        "loaded = load_model('smollm2-135m')\n"
        "print([os.environ.get(k) for k in ('HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE')])\n"
        "print(loaded.tokenizer('The capital of France is').input_ids)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], env=_without_offline_variables(), cwd="/",
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    variables, ids = done.stdout.splitlines()[-2:]
    assert variables == "[None, None]"
    assert ids == "[504, 3575, 282, 4649, 314]"  # SmolLM2's own tokenizer.json, read by hand below


def test_the_embedded_tokenizer_agrees_with_its_vocabulary_file():
    import json

    from sparrow.stages.model.loading import embedded_checkpoint

    vocab = json.loads((embedded_checkpoint("smollm2-135m") / "tokenizer.json").read_text())["model"]["vocab"]
    assert [vocab[t] for t in ("The", "Ġcapital", "Ġof", "ĠFrance", "Ġis")] == [504, 3575, 282, 4649, 314]


def test_random_weights_leave_the_callers_random_stream_alone():
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    load_model("tiny-llama", random_weights=True)
    assert torch.equal(torch.rand(3), expected)


def test_random_weights_still_follow_their_own_seed():
    first = load_model("tiny-llama", random_weights=True, seed=5).model.state_dict()
    torch.rand(10)  # the caller's stream moves between the loads: the weights must not
    again = load_model("tiny-llama", random_weights=True, seed=5).model.state_dict()
    other = load_model("tiny-llama", random_weights=True, seed=6).model.state_dict()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)
