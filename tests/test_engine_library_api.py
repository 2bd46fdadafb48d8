"""The engine as a Python library: a `generate` that raises (an interrupt, a callback's exception) or
refuses a prompt leaves the engine as a fresh one, and `SamplingParams` / `EngineConfig` / token ids of
a wrong type or range are refused in one sentence naming the field before any work."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from sparrow.stages.engine import Engine, EngineConfig, SamplingParams
from sparrow.stages.engine.config import DecodeStep
from sparrow.stages.engine.sequence import MIN_TEMPERATURE
from sparrow.stages.model.llama import Transformer

P = [[5, 17, 42, 7, 99], [3, 1, 4, 1, 5, 9, 2, 6]]  # the prompts whose results are compared
Q = [[11, 12, 13], [200, 201, 202, 203, 204, 205]]  # the run that is interrupted
PARAMS = SamplingParams(n=2, max_new_tokens=12, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    from sparrow.stages.model.loading import load_model

    return load_model("tiny-llama", random_weights=True).model


def _tokens(results):
    return [[(c.request_id, c.sample, c.prompt_token_ids, c.token_ids, c.logprobs) for c in g]
            for g in results]


def _prefilled(engine: Engine) -> int:
    """Prompt tokens prefilled, recomputes after a preemption left out."""
    return engine.stats.prefill_tokens - engine.stats.recomputed_tokens


def _fresh(tiny, config: EngineConfig, prompts=P, params=PARAMS):
    with Engine(tiny, None, config) as engine:
        return _tokens(engine.generate(prompts, params))


class Stop(Exception):
    pass


def _stop_at_second_decode_step(engine: Engine):
    def on_step(new: int, finished: int) -> None:
        if engine.stats.decode_steps == 2:
            raise KeyboardInterrupt

    return {"on_step": on_step}


def _failing_journal(engine: Engine):
    def on_prompt(request_id: int, completions) -> None:
        raise Stop("the journal's write failed")

    return {"on_prompt": on_prompt}


@pytest.mark.parametrize("step", [DecodeStep.PLAIN, DecodeStep.EAGER])
@pytest.mark.parametrize("failure, raised", [(_stop_at_second_decode_step, KeyboardInterrupt),
                                             (_failing_journal, Stop)])
@pytest.mark.parametrize("request_ids", [None, [0, 1]])
def test_a_generate_that_raises_leaves_the_engine_as_a_fresh_one(tiny, step, failure, raised, request_ids):
    config = EngineConfig(max_batch=4, decode_step=step)
    engine = Engine(tiny, None, config)
    # Q's second prompt runs longer, so the journal fails while it still decodes
    q_params = [SamplingParams(max_new_tokens=2, seed=7), SamplingParams(n=2, max_new_tokens=12, seed=7)]
    with pytest.raises(raised):
        engine.generate(Q, q_params, **failure(engine))
    assert not engine.has_work()
    assert engine.runner.cache is not None  # the pool is kept for the next run
    again = engine.generate(P, PARAMS, request_ids=request_ids)
    assert _tokens(again) == _fresh(tiny, config)
    assert _prefilled(engine) == sum(map(len, P))  # P's prompts alone, each prefilled once


@pytest.mark.parametrize("config, prompts, params, refusal", [
    (EngineConfig(max_batch=4), [P[0], [1] * 2040], PARAMS, "exceeds the model's context of 2048"),
    (EngineConfig(max_batch=4, num_pages=4), [P[0], [1] * 60], PARAMS, "needs 5 KV pages for one sample"),
    (EngineConfig(max_batch=4), P, [PARAMS, SamplingParams(logprobs=513)],
     "logprobs must be at most the model's vocabulary of 512 tokens, got 513"),
])
def test_a_refused_prompt_leaves_nothing_of_the_earlier_ones_queued(tiny, config, prompts, params, refusal):
    engine = Engine(tiny, None, config)
    with pytest.raises(ValueError, match=refusal):
        engine.generate(prompts, params)
    assert not engine.has_work() and engine.stats.prefill_tokens == 0
    assert _tokens(engine.generate(P, PARAMS)) == _fresh(tiny, config)
    assert _prefilled(engine) == sum(map(len, P))


@pytest.mark.parametrize("field, value, sentence", [
    ("seed", -1, "seed must be >= 0 (with the request id and sample index it seeds each sample's draws; "
                 "there is no random seed), got -1"),
    ("seed", None, "seed must be a whole number >= 0 (with the request id and sample index it seeds each "
                   "sample's draws; there is no random seed), got None"),
    ("n", 2.0, "n must be a whole number at least 1 (samples per prompt), got 2.0"),
    ("n", True, "n must be a whole number at least 1 (samples per prompt), got True"),
    ("top_k", 1.5, "top_k must be a whole number >= 0 (0: off), got 1.5"),
    ("top_k", "5", "top_k must be a whole number >= 0 (0: off), got '5'"),
    ("max_new_tokens", 1.5, "max_new_tokens must be a whole number at least 1, got 1.5"),
    ("logprobs", 2.0, "logprobs must be a whole number >= 0, got 2.0"),
    ("temperature", math.inf, "temperature must be 0 (greedy) or a finite number of at least 1e-06, got inf"),
    ("temperature", 1e-40, "temperature must be 0 (greedy) or a finite number of at least 1e-06, got 1e-40"),
    ("temperature", "1", "temperature must be a number, got '1'"),
    ("top_p", None, "top_p must be a number, got None"),
    ("ignore_eos", 1, "ignore_eos must be True or False, got 1"),
])
def test_sampling_params_refuse_a_wrong_type_or_range_naming_the_field(field, value, sentence):
    with pytest.raises(ValueError) as raised:
        SamplingParams(**{field: value})
    assert str(raised.value) == sentence


def test_sampling_params_take_numpy_numbers_as_plain_ones():
    params = SamplingParams(n=np.int64(2), seed=np.uint32(5), top_k=np.int32(3), temperature=np.float32(0.5))
    assert params == SamplingParams(n=2, seed=5, top_k=3, temperature=0.5)
    assert type(params.n) is int and type(params.seed) is int and type(params.temperature) is float


def test_the_smallest_temperature_samples_the_greedy_tokens_with_finite_logprobs(tiny):
    config = EngineConfig(max_batch=4)
    greedy = _fresh(tiny, config, params=SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    coldest = _fresh(tiny, config, params=SamplingParams(max_new_tokens=8, temperature=MIN_TEMPERATURE,
                                                         ignore_eos=True))
    assert [[c[3] for c in g] for g in coldest] == [[c[3] for c in g] for g in greedy]
    assert all(math.isfinite(lp) and lp <= 0 for g in coldest for c in g for lp in c[4])


@pytest.mark.parametrize("field, value, start", [
    ("page_size", 0, "page_size must be 16"),
    ("page_size", -16, "page_size must be 16"),
    ("page_size", 32, "page_size must be 16"),
    ("max_batch", 2.5, "max_batch must be a whole number at least 1, got 2.5"),
    ("max_batch", "16", "max_batch must be a whole number at least 1, got '16'"),
    ("max_batch", True, "max_batch must be a whole number at least 1, got True"),
    ("num_pages", 1.5, "num_pages must be a whole number at least 1, got 1.5"),
    ("gpu_memory_utilization", 0, "gpu_memory_utilization must be a fraction in (0, 1], got 0"),
    ("gpu_memory_utilization", "0.5", "gpu_memory_utilization must be a fraction in (0, 1], got '0.5'"),
    ("dense_layers", (-1,), "dense_layers must be a sequence of layer indices, each a whole number >= 0"),
    ("dense_layers", (0.5,), "dense_layers must be a sequence of layer indices, each a whole number >= 0"),
    ("eos_ids", (True,), "eos_ids must be a sequence of token ids, each a whole number >= 0"),
    ("cascade", 1, "cascade must be True, False or None"),
])
def test_engine_config_refuses_a_wrong_type_or_range_naming_the_field(field, value, start):
    with pytest.raises(ValueError) as raised:
        EngineConfig(**{field: value})
    assert str(raised.value).startswith(start) and "\n" not in str(raised.value)


def test_the_default_dense_layers_are_the_first_two_a_one_layer_model_has(tiny):
    one_layer = Transformer(replace(tiny.cfg, num_layers=1))
    with Engine(one_layer) as engine:  # the default (0, 1) is not a refusal: layer 0 is dense
        assert len(engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))[0][0].token_ids) == 2


def test_dense_layers_past_the_models_are_refused_by_the_engine(tiny):
    with pytest.raises(ValueError, match=r"^dense_layers must be layer indices of the model, 0 to 1, got "
                                         r"\(1, 99\)"):
        Engine(tiny, None, EngineConfig(dense_layers=(1, 99)))


@pytest.mark.parametrize("prompts, message", [
    ([[True, False]], r"^prompt 0 holds something other than whole token ids: bool True at index 0"),
    ([torch.tensor([[5, 17, 42]])], r"^prompt 0 is a 2-D array of shape \(1, 3\), not one prompt's ids"),
    (np.array([5, 17, 42]), r"^generate takes a list of prompts, got one ndarray of token ids"),
    (torch.tensor([5, 17, 42]), r"^generate takes a list of prompts, got one Tensor of token ids"),
    ([[5, 17], [[5, 17]]], r"^prompt 1 holds something other than whole token ids: list \[5, 17\]"),
])
def test_prompts_of_the_wrong_shape_or_type_are_named_for_what_they_are(tiny, prompts, message):
    engine = Engine(tiny, None, EngineConfig(max_batch=4))
    with pytest.raises(TypeError, match=message):
        engine.generate(prompts, PARAMS)
    assert not engine.has_work()


@pytest.mark.parametrize("request_ids", [[-1, 0], [0, 1.0], [True, 2]])
def test_request_ids_that_cannot_seed_samples_are_refused_before_any_work(tiny, request_ids):
    engine = Engine(tiny, None, EngineConfig(max_batch=4))
    with pytest.raises(ValueError, match=r"^request ids must be whole numbers >= 0 \(they seed"):
        engine.generate(P, PARAMS, request_ids=request_ids)
    assert not engine.has_work() and engine.stats.prefill_tokens == 0


def test_an_object_array_of_prompts_is_a_prompt_list(tiny):
    # a pandas column of id lists (df["input_ids"].values) is a 1-D object array: one prompt per entry
    column = np.empty(len(P), dtype=object)
    column[:] = P
    with Engine(tiny) as engine:
        got = engine.generate(column, PARAMS)
    assert _tokens(got) == _fresh(tiny, EngineConfig())
