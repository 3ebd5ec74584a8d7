"""Per-request sampling parameters, validated on construction.

Every invalid value raises ``ValueError`` whose message starts with the field's name. Numbers are
strict: bools are never numbers, integer fields take integers only (``numbers.Integral``, so
numpy integers too, never ``1.0``), float fields take finite reals (ints too). Values are
normalized to builtin ``int`` / ``float`` / ``list`` so they serialize cleanly. ``stop`` accepts a
single string or ``None``; ``stop_token_ids`` accepts ``None``. Validation runs in
``__post_init__``: build a new object (``dataclasses.replace``) rather than mutate one.

Every field is bounded, so no value a client can send overflows the int64 and float arrays a
step packs, nor makes a step's per-token work (stop strings, stop ids) grow without limit:
these checks are the one validation both front doors (gRPC and HTTP) and the offline API share.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # most top log-probabilities a request may ask for
MAX_STOP_STRINGS = 32  # stop strings per request
MAX_STOP_STRING_CHARS = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 64  # extra stop ids per request (checked after every token)
MAX_INT32 = 2**31 - 1  # the ceiling of every count a request sets (max_tokens, top_k, ids)
MAX_REPETITION_PENALTY = 100.0  # beyond this every seen token is simply never chosen again
GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
MAX_CONSTRAINT_CHARS = 65536  # a schema, regex or grammar's text at most
MAX_CHOICES = 256  # choices a request may constrain its output to
MAX_LOGIT_BIAS = 1024  # entries of a logit_bias map (OpenAI's limit)
LOGIT_BIAS_RANGE = 100.0  # a bias is in [-100, 100] (OpenAI's range)
MAX_N = 16  # sequences one request may fork into (n, best_of): each holds a seat and its own
# blocks past the shared prompt, so one request never fills a step's batch alone
MAX_SCHEMA_DEPTH = 64  # objects and arrays nested in a JSON schema's text, at most
MAX_SCHEMA_ENUM_VALUES = 1024  # enum and const values in one JSON schema, at most
MAX_REGEX_DEPTH = 32  # groups nested in a regex, at most


def _check_int(name: str, value, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {_short(value)}")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {_short(value)}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {_short(value)}")
    return value


def _check_float(name: str, value, low: float | None = None, high: float | None = None,
                 low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {_short(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {_short(value)}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {_short(value)}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {_short(value)}")
    return value


def _check_list(name: str, value, max_len: int) -> list:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list, got {_short(value)}")
    if len(value) > max_len:
        raise ValueError(f"{name} must hold at most {max_len} entries, got {len(value)}")
    return list(value)


def _short(value) -> str:
    """``repr(value)`` cut to a length an error message can carry."""
    if isinstance(value, int) and value.bit_length() > 64:  # (repr refuses > 4300 digits)
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def _check_logit_bias(value) -> dict[int, float] | None:
    """``value`` as {token id: bias}; None for none or an empty map."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a map of token id to bias, got {_short(value)}")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias must hold at most {MAX_LOGIT_BIAS} entries, "
                         f"got {len(value)}")
    out = {}
    for key, bias in value.items():
        if isinstance(key, bool) or not isinstance(key, numbers.Integral) \
                or not 0 <= int(key) <= MAX_INT32:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got "
                             f"{_short(key)}")
        if isinstance(bias, bool) or not isinstance(bias, numbers.Real) \
                or not -LOGIT_BIAS_RANGE <= float(bias) <= LOGIT_BIAS_RANGE:  # (False for NaN)
            raise ValueError(f"logit_bias of token {int(key)} must be a number in "
                             f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], got {_short(bias)}")
        out[int(key)] = float(bias)
    return out or None


CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputs:
    """What a request's output must match (vLLM's ``structured_outputs``): exactly one of a
    JSON schema (``json``, as text or a dict), any JSON object (``json_object``), a regular
    expression, one of ``choice``'s strings, an EBNF ``grammar``, or a ``structural_tag`` (free
    text in which a trigger starts a region that must match its schema, as text or a dict:
    xgrammar's ``{"type": "structural_tag", "format": {...}}``, or vLLM's older
    ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``). Checked here for
    shape and size; whether it compiles is the engine's check (``engine/sampling/grammar.py``)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = self._given()
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of "
                             f"{', '.join(CONSTRAINT_KINDS)}, got {given or 'none'}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got "
                             f"{_short(self.json_object)}")
        if self.json is not None:
            self._as_json_text("json", (dict, bool), "a JSON schema (an object)")
        if self.structural_tag is not None:
            self._as_json_text("structural_tag", dict, "an object")
        for name in ("json", "regex", "grammar", "structural_tag"):
            text = getattr(self, name)
            if text is None:
                continue
            if not isinstance(text, str) or not text:
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got "
                                 f"{_short(text)}")
            if len(text) > MAX_CONSTRAINT_CHARS:
                raise ValueError(f"structured_outputs.{name} must be at most "
                                 f"{MAX_CONSTRAINT_CHARS} characters, got {len(text)}")
        if self.regex is not None and _regex_depth(self.regex) > MAX_REGEX_DEPTH:
            raise ValueError(f"structured_outputs.regex nests more than {MAX_REGEX_DEPTH} "
                             f"groups")
        if self.choice is not None:
            choices = _check_list("structured_outputs.choice", self.choice, MAX_CHOICES)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("structured_outputs.choice must be a list of non-empty strings")
            if sum(map(len, choices)) > MAX_CONSTRAINT_CHARS:
                raise ValueError(f"structured_outputs.choice must total at most "
                                 f"{MAX_CONSTRAINT_CHARS} characters")
            object.__setattr__(self, "choice", tuple(choices))

    def _as_json_text(self, name: str, types, what: str) -> None:
        """Field ``name`` (JSON text or its value) kept as canonical JSON text."""
        value = getattr(self, name)
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except RecursionError:
                raise ValueError(f"structured_outputs.{name} nests more than "
                                 f"{MAX_SCHEMA_DEPTH} levels") from None
            except ValueError as exc:
                raise ValueError(f"structured_outputs.{name} is not valid JSON: {exc}") from None
        if not isinstance(value, types):
            raise ValueError(f"structured_outputs.{name} must be {what}, got {_short(value)}")
        _check_schema_size(name, value)
        object.__setattr__(self, name, json.dumps(value, sort_keys=True))

    def _given(self) -> list[str]:
        return [name for name in CONSTRAINT_KINDS if getattr(self, name) not in (None, False)]

    @property
    def kind(self) -> str:
        return self._given()[0]

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (equal constraints share one)."""
        return (self.kind, getattr(self, self.kind))

    @classmethod
    def of(cls, value) -> StructuredOutputs:
        """``value`` as StructuredOutputs: one already, or a dict of its fields."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object, got {_short(value)}")
        unknown = sorted(set(value) - set(CONSTRAINT_KINDS))
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields {unknown}; it takes "
                             f"{', '.join(CONSTRAINT_KINDS)}")
        return cls(**value)


def _check_schema_size(name: str, schema) -> None:
    """Refuse a schema (field ``name``'s) nested deeper than MAX_SCHEMA_DEPTH or with more
    than MAX_SCHEMA_ENUM_VALUES enum/const values (one pass, no recursion: a deep one is
    refused, not a RecursionError)."""
    pending, num_values = [(schema, 1)], 0
    while pending:
        value, depth = pending.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"structured_outputs.{name} nests more than {MAX_SCHEMA_DEPTH} "
                             "levels")
        if isinstance(value, dict):
            enum = value.get("enum")
            num_values += (len(enum) if isinstance(enum, list) else 0) + ("const" in value)
            pending.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            pending.extend((v, depth + 1) for v in value)
    if num_values > MAX_SCHEMA_ENUM_VALUES:
        raise ValueError(f"structured_outputs.{name} has {num_values} enum and const values; "
                         f"at most {MAX_SCHEMA_ENUM_VALUES}")


def _regex_depth(regex: str) -> int:
    """How deep ``regex``'s groups nest (escaped and bracketed parentheses aside)."""
    depth = deepest = 0
    escaped = in_class = False
    for char in regex:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth = max(0, depth - 1)
    return deepest


@dataclass
class SamplingParams:
    """How to pick each generated token and when to stop.

    ``temperature == 0`` is greedy; ``top_k == 0`` turns top-k off. A request's random draws
    are keyed by (``seed``, output position); with ``seed=None`` the engine picks one.
    """

    max_tokens: int = 16  # generated tokens at most, >= 1
    temperature: float = 1.0  # >= 0; 0 (anything < 1e-5) = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    min_p: float = 0.0  # in [0, 1]: drop tokens below min_p * p(most likely); 0 = off
    repetition_penalty: float = 1.0  # > 0; >1 discourages tokens seen in prompt or output
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from generated tokens' logits
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence in generated tokens
    seed: int | None = None  # random stream key (int64 range); None = chosen by the engine
    stop: list[str] = field(default_factory=list)  # stop strings, not included in the text
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that end generation
    ignore_eos: bool = False  # keep going past the model's end-of-sequence ids
    logprobs: int | None = None  # return this many (0..20) top log-probabilities per token
    # the prompt's log-probabilities too: this many (0..20) top ones at each prompt position,
    # and the prompt token's own (the first token's is None), with the first output
    prompt_logprobs: int | None = None
    priority: int = 0  # scheduling priority: lower runs earlier (ties by arrival), as vLLM
    # the output must match this (a JSON schema, a regex, a choice, a grammar); None: free
    structured_outputs: StructuredOutputs | None = None
    # token id -> added to its logit before sampling, in [-100, 100] (OpenAI's logit_bias);
    # None (or empty): no bias. Ids are checked against the vocabulary by who knows it
    # (the router's doors, the engine). Reported logprobs are the logits' before the bias.
    logit_bias: dict[int, float] | None = None
    n: int = 1  # completions returned (1..MAX_N); they share the prompt's KV (one prefill)
    best_of: int | None = None  # sequences generated (n..MAX_N), the n of highest cumulative
    # log-probability returned; None = n

    @property
    def num_sequences(self) -> int:
        """Sequences the request forks into: ``best_of`` (``n`` when unset)."""
        return self.n if self.best_of is None else self.best_of

    def __post_init__(self) -> None:
        self.max_tokens = _check_int("max_tokens", self.max_tokens, low=1, high=MAX_INT32)
        self.temperature = _check_float("temperature", self.temperature, low=0)
        self.top_p = _check_float("top_p", self.top_p, low=0, high=1, low_open=True)
        self.top_k = _check_int("top_k", self.top_k, low=0, high=MAX_INT32)
        self.min_p = _check_float("min_p", self.min_p, low=0, high=1)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty,
                                               low=0, low_open=True,
                                               high=MAX_REPETITION_PENALTY)
        self.presence_penalty = _check_float("presence_penalty", self.presence_penalty,
                                             low=-2, high=2)
        self.frequency_penalty = _check_float("frequency_penalty", self.frequency_penalty,
                                              low=-2, high=2)
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed, low=_INT64_MIN, high=_INT64_MAX)
        self.stop = _check_list("stop", [self.stop] if isinstance(self.stop, str) else self.stop,
                                MAX_STOP_STRINGS)
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop must hold non-empty strings, got {_short(text)}")
            if len(text) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} "
                                 f"characters each, got {len(text)}")
        self.stop_token_ids = [
            _check_int("stop_token_ids", token_id, low=0, high=MAX_INT32)
            for token_id in _check_list("stop_token_ids", self.stop_token_ids,
                                        MAX_STOP_TOKEN_IDS)]
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {_short(self.ignore_eos)}")
        if self.logprobs is not None:
            self.logprobs = _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _check_int("prompt_logprobs", self.prompt_logprobs, low=0,
                                              high=MAX_LOGPROBS)
        self.priority = _check_int("priority", self.priority, low=-(2**31), high=2**31 - 1)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputs.of(self.structured_outputs)
        self.logit_bias = _check_logit_bias(self.logit_bias)
        self.n = _check_int("n", self.n, low=1, high=MAX_N)
        if self.best_of is not None:
            self.best_of = _check_int("best_of", self.best_of, low=1, high=MAX_N)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def child_seed(seed: int, index: int) -> int:
    """The random stream key of a request's sequence ``index`` (of ``n``/``best_of``): the
    request's own for index 0, else one derived from (seed, index) in the int64 range, so
    ``SamplingParams(seed=child_seed(seed, i))`` alone reproduces that sequence offline."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)
