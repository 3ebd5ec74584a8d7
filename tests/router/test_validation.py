"""Request validation without gRPC: defaults, field paths, context fitting."""

from __future__ import annotations

import pytest

from pdserve.api import generation_pb2 as pb
from pdserve.router.backend import GenerationDelta, ModelSpec
from pdserve.router.validation import (
    RequestValidationError,
    check_request_id,
    fit_to_context,
    validate_generate_request,
)
from pdserve.worker_api.sampling_params import SamplingParams

MODEL = ModelSpec("m", max_context_tokens=32, vocab_size=100, eos_token_ids=(2,))


def test_unset_sampling_fields_take_sampling_params_defaults():
    validated = validate_generate_request(pb.GenerateRequest(text="hi"), MODEL)
    assert validated.params == SamplingParams()
    assert validated.params.temperature == 1.0 and validated.params.max_tokens == 16
    assert validated.prompt_text == "hi" and validated.prompt_token_ids is None
    assert not validated.max_tokens_given


def test_explicit_zero_values_are_kept_not_treated_as_unset():
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[0, 99]), sampling=pb.SamplingParams(
        temperature=0.0, top_k=0, seed=0, logprobs=0, presence_penalty=0.0, max_tokens=3))
    validated = validate_generate_request(request, MODEL)
    params = validated.params
    assert (params.temperature, params.seed, params.logprobs, params.max_tokens) == (0.0, 0, 0, 3)
    assert params.is_greedy
    assert validated.max_tokens_given and validated.prompt_token_ids == [0, 99]


def test_every_sampling_field_is_carried_over():
    sampling = pb.SamplingParams(
        max_tokens=5, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=-0.5, seed=-7, stop=["\n", "END"],
        stop_token_ids=[3, 4], ignore_eos=True, logprobs=5)
    params = validate_generate_request(pb.GenerateRequest(text="x", sampling=sampling),
                                       MODEL).params
    assert params == SamplingParams(
        max_tokens=5, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=-0.5, seed=-7, stop=["\n", "END"],
        stop_token_ids=[3, 4], ignore_eos=True, logprobs=5)


def test_sampling_error_names_the_proto_field_path():
    request = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_p=float("nan")))
    with pytest.raises(RequestValidationError) as info:
        validate_generate_request(request, MODEL)
    assert info.value.field == "sampling.top_p"
    assert str(info.value).startswith("sampling.top_p: top_p must be finite")
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("request_id", ["", "a", "req-1_2.3:4", "A" * 128])
def test_good_request_ids(request_id):
    check_request_id(request_id)


@pytest.mark.parametrize("request_id", ["A" * 129, "a b", "a\nb", "a/b", "\u00e9", "a;b"])
def test_bad_request_ids(request_id):
    with pytest.raises(RequestValidationError) as info:
        check_request_id(request_id)
    assert info.value.field == "request_id"


def test_fit_to_context_shrinks_an_unset_max_tokens_only():
    unset = validate_generate_request(pb.GenerateRequest(text="x"), MODEL)
    assert fit_to_context([1] * 10, unset, MODEL).max_tokens == 16
    assert fit_to_context([1] * 20, unset, MODEL).max_tokens == 12
    given = validate_generate_request(
        pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_tokens=13)), MODEL)
    assert fit_to_context([1] * 19, given, MODEL).max_tokens == 13
    with pytest.raises(RequestValidationError) as info:
        fit_to_context([1] * 20, given, MODEL)
    assert info.value.field == "sampling.max_tokens"


@pytest.mark.parametrize("num_prompt", [0, 32, 40])
def test_fit_to_context_rejects_prompts_that_leave_no_room(num_prompt):
    validated = validate_generate_request(pb.GenerateRequest(text="x"), MODEL)
    with pytest.raises(RequestValidationError) as info:
        fit_to_context([1] * num_prompt, validated, MODEL)
    assert info.value.field == "text"


def test_model_spec_and_delta_reject_bad_values():
    with pytest.raises(ValueError, match="vocab_size"):
        ModelSpec("m", max_context_tokens=8, vocab_size=0)
    with pytest.raises(ValueError, match="eos_token_ids"):
        ModelSpec("m", max_context_tokens=8, vocab_size=4, eos_token_ids=(4,))
    with pytest.raises(ValueError, match="finish_reason"):
        GenerationDelta(token_ids=[1], finish_reason="done")
    with pytest.raises(ValueError, match="logprobs"):
        GenerationDelta(token_ids=[1, 2], logprobs=[{1: -0.1}])
