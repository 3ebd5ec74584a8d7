"""SamplingParams: every invalid value raises ValueError naming its field; valid ones normalize."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.worker_api.sampling_params import (
    MAX_INT32,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)

NAN, INF = math.nan, math.inf
NOT_NUMBERS = ["1", None, [1], {}, object(), 1j]
NON_FINITE = [NAN, INF, -INF]
NOT_INTEGERS = [True, False, 1.0, 2.5, np.float64(3.0), NAN, INF, "3", None, [3]]

# What a hostile client sends: past every array a step packs values into (int64), and
# lists long enough to cost every step.
HUGE = [2**31, 2**63, 10**30, 2**1000]

INVALID = {
    "max_tokens": NOT_INTEGERS + [0, -1, -(2**70)] + HUGE,
    "temperature": NOT_NUMBERS + NON_FINITE + [True, False, -1e-9, -1, -INF],
    "top_p": NOT_NUMBERS + NON_FINITE + [True, 0, 0.0, -0.1, 1.0000001, 2],
    "top_k": NOT_INTEGERS + [-1, -100] + HUGE,
    "min_p": NOT_NUMBERS + NON_FINITE + [True, -0.01, 1.01],
    "repetition_penalty": NOT_NUMBERS + NON_FINITE + [True, 0, 0.0, -1.0, 1e30,
                                                      MAX_REPETITION_PENALTY * 1.01],
    "presence_penalty": NOT_NUMBERS + NON_FINITE + [True, -2.01, 2.01],
    "frequency_penalty": NOT_NUMBERS + NON_FINITE + [True, -2.01, 2.01],
    "seed": [True, False, 1.0, 1.5, NAN, INF, "1", [1], 2**63, -(2**63) - 1],
    "stop": [1, b"stop", [""], ["ok", ""], [None], [1], ["ok", b"x"], {"a": 1}, ("ok", 3),
             ["s"] * (MAX_STOP_STRINGS + 1), ["x" * (MAX_STOP_STRING_CHARS + 1)]],
    "stop_token_ids": [1, "1", [-1], [1.0], [True], [None], ["1"], [1, -5], {1: 2},
                       [2**31], [10**30], [1] * (MAX_STOP_TOKEN_IDS + 1)],
    "ignore_eos": [0, 1, "true", None, 1.0, np.bool_(True)],
    "logprobs": NOT_INTEGERS[:-2] + [-1, MAX_LOGPROBS + 1, "1"],
}


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, values in INVALID.items()
                                              for v in values])
def test_invalid_value_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**{field: value})


VALID = {
    "max_tokens": [1, MAX_INT32, np.int64(7)],
    "temperature": [0, 0.0, 1e-9, 0.7, 2, 1e6, np.float32(0.5)],
    "top_p": [1e-9, 0.5, 1, 1.0],
    "top_k": [0, 1, 50, 10**9, MAX_INT32],
    "min_p": [0, 0.0, 0.05, 1],
    "repetition_penalty": [1e-3, 1, 1.2, MAX_REPETITION_PENALTY],
    "presence_penalty": [-2, -2.0, 0, 1.5, 2],
    "frequency_penalty": [-2, 0, 0.5, 2.0],
    "seed": [None, 0, -1, 2**63 - 1, -(2**63), np.int32(5)],
    "stop": [None, [], "x", ["a", "bb"], ("a", "b"), ["s"] * MAX_STOP_STRINGS,
             ["x" * MAX_STOP_STRING_CHARS]],
    "stop_token_ids": [None, [], [0, 7], (3,), [np.int64(4)], [MAX_INT32],
                       [1] * MAX_STOP_TOKEN_IDS],
    "ignore_eos": [True, False],
    "logprobs": [None, 0, 1, MAX_LOGPROBS],
}


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, values in VALID.items()
                                              for v in values])
def test_valid_values_are_accepted(field, value):
    SamplingParams(**{field: value})


def test_values_are_normalized_to_builtins():
    params = SamplingParams(max_tokens=np.int64(8), temperature=1, top_p=np.float32(0.5),
                            seed=np.int32(3), stop="end", stop_token_ids=(np.int64(2),),
                            logprobs=np.int16(2))
    assert type(params.max_tokens) is int and params.max_tokens == 8
    assert type(params.temperature) is float
    assert type(params.top_p) is float and params.top_p == 0.5
    assert type(params.seed) is int
    assert params.stop == ["end"]
    assert params.stop_token_ids == [2] and type(params.stop_token_ids[0]) is int
    assert type(params.logprobs) is int
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []


def test_defaults_and_greedy():
    params = SamplingParams()
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (16, 1.0, 1.0, 0)
    assert not params.is_greedy
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy


def test_stop_lists_are_copied():
    stops, ids = ["a"], [1]
    params = SamplingParams(stop=stops, stop_token_ids=ids)
    stops.append("b")
    ids.append(2)
    assert params.stop == ["a"] and params.stop_token_ids == [1]


def test_an_integer_too_long_to_print_is_named_not_printed():
    """Python refuses to print an int of more than 4300 digits: the error still names the
    field (a JSON body can hold such a number)."""
    with pytest.raises(ValueError, match=r"^top_k must be <= \d+, got an integer of \d+ bits"):
        SamplingParams(top_k=10**5000)
