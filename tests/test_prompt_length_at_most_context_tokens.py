"""`--context-tokens N` of the long-context tasks is the most tokens a prompt may have, counted here with
the model's own tokenizer and chat template (transformers' apply_chat_template on the user message), and a
prompt falls short of N by less than one of its records."""

from __future__ import annotations

import re

import pytest

from sparrow.stages.tasks import make_prompts

USER = re.compile(r"<\|im_start\|>user\n(.*)<\|im_end\|>\n<\|im_start\|>assistant\n$", re.DOTALL)
RECORD = {"kv_lookup": r"^Locker .*$", "count": r"^Entry \d+: .*$"}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from sparrow.stages.model.loading import embedded_checkpoint

    return AutoTokenizer.from_pretrained(str(embedded_checkpoint("smollm2-135m")))


def _templated_tokens(tok, prompt: str) -> int:
    """The prompt's tokens as the model's chat template gives them for its user message."""
    user = USER.search(prompt).group(1)
    ids = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]
    return len(ids)


@pytest.mark.parametrize("name", ["kv_lookup", "count", "passkey"])
@pytest.mark.parametrize("target", [512, 900])
def test_no_prompt_is_longer_than_context_tokens(tok, name, target):
    for row in make_prompts(name, 2, 1, tok, context_tokens=target):
        tokens = _templated_tokens(tok, row["prompt"])
        assert tokens == len(row["prompt_token_ids"]) and tokens <= target, (name, target, tokens)
        if name in RECORD:  # as many records as fit: one more would not
            lines = re.findall(RECORD[name], row["prompt"], flags=re.MULTILINE)
            longest = max(len(tok("\n" + line, add_special_tokens=False).input_ids) for line in lines)
            assert target - tokens < longest + 2, (name, target, tokens, longest)


def test_the_reported_request_stays_within_512_tokens(tok):
    """`prompts --task kv_lookup --n 2 --seed 1 --context-tokens 512` wrote 516-519 tokens."""
    for row in make_prompts("kv_lookup", 2, 1, tok, context_tokens=512):
        assert _templated_tokens(tok, row["prompt"]) <= 512
