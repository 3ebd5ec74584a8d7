"""The gRPC door's translation without gRPC: defaults, what the client gave, field paths."""

from __future__ import annotations

import pytest

from pdserve.api import generation_pb2 as pb
from pdserve.router.backend import GenerationDelta, ModelSpec
from pdserve.router.validation import (
    RequestValidationError,
    check_request_id,
    client_request_from_proto,
)
from pdserve.worker_api.sampling_params import SamplingParams

MODEL = ModelSpec("m", max_context_tokens=32, vocab_size=100, eos_token_ids=(2,))


def test_unset_sampling_fields_take_sampling_params_defaults():
    incoming = client_request_from_proto(pb.GenerateRequest(text="hi"), MODEL)
    assert incoming.params == SamplingParams()
    assert incoming.params.temperature == 1.0 and incoming.params.max_tokens == 16
    assert incoming.prompt == "hi" and incoming.prompt_field == "text"
    assert incoming.max_tokens is None  # the client gave none: 16 is a ceiling
    assert incoming.label  # the server made one


def test_explicit_zero_values_are_kept_not_treated_as_unset():
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[0, 99]), sampling=pb.SamplingParams(
        temperature=0.0, top_k=0, seed=0, logprobs=0, presence_penalty=0.0, max_tokens=3))
    incoming = client_request_from_proto(request, MODEL)
    params = incoming.params
    assert (params.temperature, params.seed, params.logprobs, params.max_tokens) == (0.0, 0, 0, 3)
    assert params.is_greedy
    assert incoming.max_tokens == 3 and incoming.prompt == [0, 99]
    assert (incoming.prompt_field, incoming.max_tokens_field) == ("token_ids",
                                                                  "sampling.max_tokens")


def test_the_label_deadline_and_claimed_tenant_are_carried_over():
    request = pb.GenerateRequest(request_id="r-1", text="x", tenant="team-a")
    incoming = client_request_from_proto(request, MODEL, deadline=12.5, metadata_tenant="other")
    assert (incoming.label, incoming.deadline, incoming.claimed_tenant) == ("r-1", 12.5,
                                                                            "team-a")
    untold = client_request_from_proto(pb.GenerateRequest(text="x"), MODEL,
                                       metadata_tenant="team-b")
    assert untold.claimed_tenant == "team-b"


def test_every_sampling_field_is_carried_over():
    sampling = pb.SamplingParams(
        max_tokens=5, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=-0.5, seed=-7, stop=["\n", "END"],
        stop_token_ids=[3, 4], ignore_eos=True, logprobs=5)
    params = client_request_from_proto(pb.GenerateRequest(text="x", sampling=sampling),
                                       MODEL).params
    assert params == SamplingParams(
        max_tokens=5, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=-0.5, seed=-7, stop=["\n", "END"],
        stop_token_ids=[3, 4], ignore_eos=True, logprobs=5)


def test_sampling_error_names_the_proto_field_path():
    request = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_p=float("nan")))
    with pytest.raises(RequestValidationError) as info:
        client_request_from_proto(request, MODEL)
    assert info.value.field == "sampling.top_p"
    assert str(info.value).startswith("sampling.top_p: top_p must be finite")
    assert isinstance(info.value, ValueError)


def test_n_and_best_of_are_carried_over_and_bounded():
    sampling = pb.SamplingParams(n=4, best_of=4)
    params = client_request_from_proto(pb.GenerateRequest(text="x", sampling=sampling),
                                       MODEL).params
    assert (params.n, params.best_of, params.num_sequences) == (4, 4, 4)
    for fields, field in [(dict(n=0), "sampling.n"), (dict(n=-1), "sampling.n"),
                          (dict(n=2**63 - 1), "sampling.n"), (dict(n=-(2**63)), "sampling.n"),
                          (dict(n=3, best_of=2), "sampling.best_of"),
                          (dict(best_of=0), "sampling.best_of"),
                          (dict(n=2, best_of=3), "sampling.best_of")]:  # (a stream: refused)
        request = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(**fields))
        with pytest.raises(RequestValidationError) as info:
            client_request_from_proto(request, MODEL)
        assert info.value.field == field, fields


def test_structured_outputs_are_carried_over_and_their_errors_named():
    def params(outputs: pb.StructuredOutputs) -> SamplingParams:
        request = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(
            structured_outputs=outputs))
        return client_request_from_proto(request, MODEL).params

    assert params(pb.StructuredOutputs(json='{"type": "object"}')).structured_outputs.json \
        == '{"type": "object"}'
    assert params(pb.StructuredOutputs(choice=pb.Choices(choices=["a", "b"]))
                  ).structured_outputs.choice == ("a", "b")
    assert params(pb.StructuredOutputs(json_object=True)).structured_outputs.json_object
    assert params(pb.StructuredOutputs(regex="[0-9]+")).structured_outputs.regex == "[0-9]+"
    assert params(pb.StructuredOutputs(structural_tag='{"triggers": [], "structures": []}')
                  ).structured_outputs.structural_tag == '{"structures": [], "triggers": []}'
    for outputs, field in [(pb.StructuredOutputs(), "sampling.structured_outputs"),
                           (pb.StructuredOutputs(json="{bad"), "sampling.structured_outputs.json"),
                           (pb.StructuredOutputs(choice=pb.Choices()),
                            "sampling.structured_outputs.choice"),
                           (pb.StructuredOutputs(structural_tag="[]"),
                            "sampling.structured_outputs.structural_tag")]:
        with pytest.raises(RequestValidationError) as info:
            params(outputs)
        assert info.value.field == field, str(info.value)


@pytest.mark.parametrize("request_id", ["", "a", "req-1_2.3:4", "A" * 128])
def test_good_request_ids(request_id):
    check_request_id(request_id)


@pytest.mark.parametrize("request_id", ["A" * 129, "a b", "a\nb", "a/b", "\u00e9", "a;b"])
def test_bad_request_ids(request_id):
    with pytest.raises(RequestValidationError) as info:
        check_request_id(request_id)
    assert info.value.field == "request_id"


def test_model_spec_and_delta_reject_bad_values():
    with pytest.raises(ValueError, match="vocab_size"):
        ModelSpec("m", max_context_tokens=8, vocab_size=0)
    with pytest.raises(ValueError, match="eos_token_ids"):
        ModelSpec("m", max_context_tokens=8, vocab_size=4, eos_token_ids=(4,))
    with pytest.raises(ValueError, match="finish_reason"):
        GenerationDelta(token_ids=[1], finish_reason="done")
    with pytest.raises(ValueError, match="logprobs"):
        GenerationDelta(token_ids=[1, 2], logprobs=[{1: -0.1}])
