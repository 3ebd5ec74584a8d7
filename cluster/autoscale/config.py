"""The autoscaler's settings (:class:`AutoscaleConfig`) and the file that sets them
(``pdserve serve --autoscale-config FILE``, the Helm chart's ``autoscaling:`` values).

What each setting does to the decision is in ``pdserve.cluster.autoscale.decision``.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

SCALED_ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class AutoscaleConfig:
    """Autoscaler settings; ``pdserve serve --autoscale`` and ``--autoscale-config FILE``."""

    enabled: bool = False  # scale the prefill and decode pools by their phase signals
    min_prefill: int = 1  # prefill workers at least
    max_prefill: int = 4  # prefill workers at most
    min_decode: int = 1  # decode workers at least
    max_decode: int = 4  # decode workers at most
    max_workers: int | None = None  # prefill + decode workers at most (None: the two maxima)
    scale_interval_s: float = 10.0  # one step per pool at most this often
    scale_up_delay_s: float = 10.0  # an up signal must hold this long before a pool grows
    scale_down_delay_s: float = 120.0  # every signal must stay low this long before it shrinks
    scale_down_grace_s: float = 60.0  # no step down of a pool this soon after it grew
    window_s: float = 30.0  # latency percentiles and token rates over this window
    ttft_slo_ms: float = 1000.0  # prefill grows while its TTFT P90 is above this
    itl_slo_ms: float = 100.0  # decode grows while the ITL P90 is above this
    prefill_queue_up_tokens: int = 4096  # queued prompt tokens per prefill worker that grow
    # the prefill pool
    prefill_queue_down_tokens: int = 512  # the prefill pool shrinks only while its queued
    # prompt tokens / (N-1) stay under this
    prefill_busy_down: float = 0.6  # the prefill pool shrinks only while its workers' busy
    # fractions (forward time / wall time) summed / (N-1) stay under this
    decode_load_up: float = 0.9  # mean decode load (per worker the larger of KV usage and
    # running / max_num_seqs) that grows the decode pool
    decode_load_down: float = 0.5  # the decode pool shrinks only while its load summed /
    # (N-1) stays under this
    down_slo_fraction: float = 0.8  # a pool shrinks only while its latency P90 projected on
    # N-1 workers stays under this fraction of its SLO
    predictive: bool = False  # also hold each pool at demand / per-worker capacity (Dynamo)
    prefill_capacity_tokens_per_s: float | None = None  # prompt tokens/s one prefill worker
    # serves within the TTFT SLO (None: the highest rate measured within it)
    decode_capacity_tokens_per_s: float | None = None  # output tokens/s one decode worker
    # serves within the ITL SLO (None: the highest rate measured within it)
    min_samples: int = 5  # latency samples a window needs before its P90 counts

    def __post_init__(self) -> None:
        for name in ("min_prefill", "min_decode", "min_samples"):
            if getattr(self, name) < (0 if name != "min_samples" else 1):
                raise ValueError(f"{name} must be >= {0 if name != 'min_samples' else 1}, "
                                 f"got {getattr(self, name)}")
        for role in SCALED_ROLES:
            low, high = self.bounds(role)
            if high < max(1, low):
                raise ValueError(f"max_{role} ({high}) must be >= 1 and >= min_{role} ({low})")
        if self.max_workers is not None and self.max_workers < self.min_prefill + self.min_decode:
            raise ValueError(f"max_workers ({self.max_workers}) must be >= min_prefill + "
                             f"min_decode ({self.min_prefill + self.min_decode})")
        for name in ("scale_interval_s", "window_s", "ttft_slo_ms", "itl_slo_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("scale_up_delay_s", "scale_down_delay_s", "scale_down_grace_s",
                     "prefill_queue_up_tokens", "prefill_queue_down_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.prefill_queue_down_tokens > self.prefill_queue_up_tokens:
            raise ValueError("prefill_queue_down_tokens must be <= prefill_queue_up_tokens")
        if not 0 < self.prefill_busy_down <= 1:
            raise ValueError(f"prefill_busy_down must be in (0, 1], got {self.prefill_busy_down}")
        if not 0 < self.decode_load_down <= self.decode_load_up:
            raise ValueError(f"need 0 < decode_load_down ({self.decode_load_down}) <= "
                             f"decode_load_up ({self.decode_load_up})")
        if not 0 < self.down_slo_fraction <= 1:
            raise ValueError(f"down_slo_fraction must be in (0, 1], got {self.down_slo_fraction}")
        for name in ("prefill_capacity_tokens_per_s", "decode_capacity_tokens_per_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or none, got {value}")

    def bounds(self, role: str) -> tuple[int, int]:
        """(min, max) workers of ``role``'s pool."""
        return getattr(self, f"min_{role}"), getattr(self, f"max_{role}")

    @property
    def budget(self) -> int:
        """Prefill + decode workers at most."""
        return self.max_workers if self.max_workers is not None \
            else self.max_prefill + self.max_decode


# -- the settings file ------------------------------------------------------------------------
def config_file_values(path: str | Path) -> dict:
    """:class:`AutoscaleConfig` field values from a YAML file (``--autoscale-config``).

    Keys are the Helm chart's ``autoscale:`` values: the fields in camelCase (``minPrefill``,
    ``ttftSloMs``, ``enabled``) or as written here (``min_prefill``); the mapping may sit under
    a top-level ``autoscale:`` key, so a values file's section works as is. An unknown key or
    a file that is not a mapping raises ValueError naming it."""

    text = Path(path).read_text()
    data = yaml.safe_load(text) or {}
    if isinstance(data, dict) and set(data) == {"autoscale"}:
        data = data["autoscale"] or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of autoscale settings")
    names = {f.name for f in dataclasses.fields(AutoscaleConfig)}
    values = {}
    for key, value in data.items():
        name = re.sub(r"(?<!^)([A-Z])", r"_\1", str(key)).lower()
        if name not in names:
            raise ValueError(f"{path}: unknown autoscale setting {key!r} (known: "
                             f"{', '.join(sorted(_camel(n) for n in names))})")
        values[name] = _typed(name, value, path)
    return values


def _typed(name: str, value, path) -> object:
    """``value`` as the field's type (int for int, float for float, bool for bool, or None
    where allowed); ValueError naming the key otherwise."""

    hint = typing.get_type_hints(AutoscaleConfig)[name]
    kinds = [k for k in typing.get_args(hint) if k is not type(None)] or [hint]
    if value is None and type(None) in typing.get_args(hint):
        return None
    kind = kinds[0]
    if kind is bool and isinstance(value, bool):
        return value
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"{path}: {_camel(name)} must be {kind.__name__}, got {value!r}")


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)
