"""``speculative_config``, validated: vLLM's keys for the two methods
(engine/speculation/speculator.py runs them), every bad value a ValueError naming its field."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.models.checkpoint import open_checkpoint

METHODS = ("draft_model", "ngram")
MAX_SPECULATIVE_TOKENS = 16
_KEYS = {"draft_model": ("method", "model", "num_speculative_tokens"),
         "ngram": ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")}
_DEFAULT_LOOKUP = 5  # vLLM's n when neither prompt_lookup_max nor prompt_lookup_min is given


def _int_in(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"speculative_config.{name} must be an integer in [{low}, {high}], "
                         f"got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated ``speculative_config``."""

    method: str  # "draft_model" | "ngram"
    num_speculative_tokens: int  # K: drafts per sequence per step, 1..16
    model: str | None = None  # draft_model: the draft's checkpoint (same vocabulary)
    prompt_lookup_max: int = _DEFAULT_LOOKUP  # ngram: longest suffix looked up
    prompt_lookup_min: int = _DEFAULT_LOOKUP  # ngram: shortest suffix looked up

    @classmethod
    def from_dict(cls, d: dict, target_model_config=None,
                  max_model_len: int | None = None) -> SpeculativeConfig:
        """ValueError naming the field when ``d`` is malformed; with ``target_model_config``
        the draft's vocabulary (and context, with ``max_model_len``) is checked against it."""
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {d!r}")
        method = d.get("method", "draft_model" if "model" in d else None)
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, "
                             f"got {d.get('method')!r}")
        unknown = sorted(set(d) - set(_KEYS[method]))
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {', '.join(unknown)} for "
                             f"method {method!r}; valid keys: {', '.join(_KEYS[method])}")
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        k = _int_in("num_speculative_tokens", d["num_speculative_tokens"], 1,
                    MAX_SPECULATIVE_TOKENS)
        if method == "ngram":
            high = d.get("prompt_lookup_max", d.get("prompt_lookup_min", _DEFAULT_LOOKUP))
            low = d.get("prompt_lookup_min", high)
            _int_in("prompt_lookup_max", high, 1, 1 << 20)
            _int_in("prompt_lookup_min", low, 1, high if isinstance(high, int) else 1)
            return cls(method, k, prompt_lookup_max=high, prompt_lookup_min=low)
        model = d.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError(f"speculative_config.model must be the draft's checkpoint folder, "
                             f"got {model!r}")
        if target_model_config is not None:
            _check_draft(model, target_model_config, max_model_len)
        return cls(method, k, model=model)


def _check_draft(model: str, target, max_model_len: int | None) -> None:
    draft = open_checkpoint(model).model_config
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocab_size ({draft.vocab_size}) "
                         f"must equal the target's vocab_size ({target.vocab_size})")
    if max_model_len is not None and draft.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config.model: the draft's max_position_embeddings "
                         f"({draft.max_position_embeddings}) is below max_model_len "
                         f"({max_model_len})")
