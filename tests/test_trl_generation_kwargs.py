"""`SparseRollout` called as TRL's GRPOTrainer calls it applies `GRPOConfig.generation_kwargs` on top of the
other sampling settings, as TRL's own generation does (max_new_tokens / vLLM's max_tokens, temperature,
top_p, top_k), refuses any other key in one sentence naming it, and refuses max_completion_length=None
(unless generation_kwargs gives the length) before the engine is built.

References: transformers' logits of the same checkpoint (the sampled tokens' log softmax at the
generation_kwargs temperature, and its greedy continuation for top_k 1), and the lengths asked for.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from sparrow.stages.integrations.trl import SparseRollout

from tiny_models import tiny_qwen3

PROMPTS = ["a short prompt", "another, longer prompt than that"]


def is_conversational(example):  # TRL's trl.data_utils.is_conversational, word for word
    keys = {k for k in example if k in ["prompt", "chosen", "rejected", "completion", "messages"]}
    if keys:
        m = example[keys.pop()]
        if isinstance(m, list) and isinstance(m[0], dict) and "role" in m[0]:
            return True
    return False


@pytest.fixture(autouse=True)
def trl_data_utils(monkeypatch):
    """TRL's is_conversational where TRL is not installed."""
    try:
        import trl.data_utils  # noqa: F401
    except ImportError:
        trl = types.ModuleType("trl")
        trl.data_utils = types.SimpleNamespace(is_conversational=is_conversational)
        monkeypatch.setitem(sys.modules, "trl", trl)
        monkeypatch.setitem(sys.modules, "trl.data_utils", trl.data_utils)


class ByteTokenizer:
    """Text -> ids within the tiny model's vocabulary (TRL calls `tokenizer(text=prompts)`)."""

    def __call__(self, text):
        return {"input_ids": [[5 + b % 290 for b in t.encode()] for t in text]}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return tiny_qwen3(tmp_path_factory.mktemp("tiny-trl-kwargs"))


def trainer(hf, **settings):
    """A stand-in with GRPOTrainer's attributes and GRPOConfig's defaults."""
    args = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
                max_completion_length=8, seed=42, per_device_train_batch_size=2, steps_per_generation=1,
                vllm_importance_sampling_correction=False, chat_template_kwargs=None, generation_kwargs=None)
    args.update(settings)
    return types.SimpleNamespace(
        model=hf, processing_class=ByteTokenizer(), args=types.SimpleNamespace(**args),
        state=types.SimpleNamespace(global_step=0), chat_template=None, chat_template_kwargs={},
        use_vllm=False, tools=None, environment_factories=None,
        accelerator=types.SimpleNamespace(unwrap_model=lambda m: m, device=torch.device("cpu")))


def reference_logp(hf, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def test_generation_kwargs_length_and_temperature_are_applied(hf):
    rollout = SparseRollout(None, ignore_eos=True)
    out = rollout(PROMPTS, trainer(hf, generation_kwargs={"max_new_tokens": 3, "temperature": 0.5}))
    assert [len(c) for c in out["completion_ids"]] == [3, 3]
    assert rollout.last.metrics["sparrow/completions/mean_length"] == 3.0
    for p, c, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
        torch.testing.assert_close(torch.tensor(lp), reference_logp(hf, p, c, 0.5), rtol=0, atol=1e-4)
        assert (torch.tensor(lp) - reference_logp(hf, p, c, 1.0)).abs().max() > 1e-2


def test_vllm_names_max_tokens_and_top_k(hf):
    out = SparseRollout(None, ignore_eos=True)(PROMPTS, trainer(hf, generation_kwargs={"max_tokens": 4,
                                                                                         "top_k": 1}))
    for p, c in zip(out["prompt_ids"], out["completion_ids"]):
        with torch.no_grad():
            greedy = hf.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False)[0, len(p):]
        assert c == greedy.tolist()


@pytest.mark.parametrize("settings, sentence", [
    (dict(generation_kwargs={"max_new_tokens": 4, "do_sample": True, "min_p": 0.1}),
     "SparseRollout applies generation_kwargs' max_new_tokens, max_tokens, temperature, top_p, top_k only; "
     "remove 'do_sample', 'min_p'"),
    (dict(generation_kwargs={"max_new_tokens": 4, "max_tokens": 5}),
     "generation_kwargs gives max_new_tokens=4 and max_tokens=5; give one"),
    (dict(generation_kwargs={"temperature": "hot"}), "generation_kwargs['temperature'] must be a number"),
    (dict(generation_kwargs={"top_p": 1.5}), "GRPOConfig's sampling settings: top_p must be in (0, 1]"),
    (dict(max_completion_length=None), "SparseRollout needs a completion length: set max_completion_length"),
])
def test_unsupported_settings_are_refused_before_the_engine_is_built(hf, settings, sentence):
    rollout = SparseRollout(None)
    with pytest.raises(ValueError) as e:
        rollout(PROMPTS, trainer(hf, **settings))
    assert str(e.value).startswith(sentence) and "\n" not in str(e.value)
    assert rollout.engine is None and rollout.model is None


def test_no_max_completion_length_with_a_length_in_generation_kwargs(hf):
    out = SparseRollout(None, ignore_eos=True)(
        PROMPTS, trainer(hf, max_completion_length=None, generation_kwargs={"max_new_tokens": 2}))
    assert [len(c) for c in out["completion_ids"]] == [2, 2]
