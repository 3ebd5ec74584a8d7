"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20


def _check_number(name: str, value, low: float | None = None, high: float | None = None,
                  low_open: bool = False, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not integer and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value!r}")


@dataclass
class SamplingParams:
    """How to pick each generated token and when to stop.

    ``temperature == 0`` is greedy; ``top_k == 0`` turns top-k off. A request's random draws
    are keyed by (``seed``, output position); with ``seed=None`` the engine picks one.
    """

    max_tokens: int = 16  # generated tokens at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    min_p: float = 0.0  # drop tokens below min_p * p(most likely)
    repetition_penalty: float = 1.0  # >1 discourages tokens seen in prompt or output
    presence_penalty: float = 0.0  # subtracted once from logits of tokens already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    seed: int | None = None  # random stream key; None = chosen by the engine
    stop: list[str] = field(default_factory=list)  # stop strings, not included in the text
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that end generation
    ignore_eos: bool = False  # keep going past the model's end-of-sequence ids
    logprobs: int | None = None  # return this many top log-probabilities per token

    def __post_init__(self) -> None:
        _check_number("max_tokens", self.max_tokens, low=1, integer=True)
        _check_number("temperature", self.temperature, low=0)
        _check_number("top_p", self.top_p, low=0, high=1, low_open=True)
        _check_number("top_k", self.top_k, low=0, integer=True)
        _check_number("min_p", self.min_p, low=0, high=1)
        _check_number("repetition_penalty", self.repetition_penalty, low=0, low_open=True)
        _check_number("presence_penalty", self.presence_penalty, low=-2, high=2)
        _check_number("frequency_penalty", self.frequency_penalty, low=-2, high=2)
        if self.seed is not None:
            _check_number("seed", self.seed, low=-(2**63), high=2**63 - 1, integer=True)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(
                isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        for token_id in self.stop_token_ids:
            _check_number("stop_token_ids", token_id, low=0, integer=True)
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            _check_number("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS, integer=True)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
