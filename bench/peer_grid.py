"""The grid a peer sitting measures (``python -m pdserve.bench.peer``): shapes, dtypes and loads.

A **shape** is a workload of vLLM's random dataset: prompt and output lengths, each fixed or
spread. ``--shapes`` takes ``IN/OUT`` with an optional ``~R`` after either length, ``R`` the
client's range ratio in [0, 1): the lengths are drawn uniformly from ``[len * (1 - R),
len * (1 + R)]``. ``1024~0.5/256~0.5`` is 512-1,536 prompt tokens and 128-384 output tokens;
``256/64`` is 256 and 64 for every request.

A **load** is a closed loop at a concurrency (``c=8``: the client keeps 8 requests in flight)
or Poisson arrivals at a fraction of vLLM's capacity (``0.8 cap``). The capacity of a (dtype,
shape) cell is the request rate vLLM completed at its highest closed-loop concurrency of that
cell, in the same sitting. So every sitting runs each dtype in two passes: first the
closed-loop points of every shape, every server in turn; then, the capacities known, the
Poisson points of every shape, every server in turn again (each server starts once per pass).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

DEFAULT_SHAPES = ("256/64", "1024~0.5/256~0.5", "2048/128", "128/512")
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Shape:
    input_len: int  # prompt tokens (the mean where spread)
    output_len: int  # output tokens asked for (the mean where spread)
    input_spread: float = 0.0  # the client's range ratio for prompts, in [0, 1)
    output_spread: float = 0.0  # ... and for outputs

    @property
    def label(self) -> str:
        def part(length: int, spread: float) -> str:
            return f"{length}~{spread:g}" if spread else str(length)
        return f"{part(self.input_len, self.input_spread)}/" \
               f"{part(self.output_len, self.output_spread)}"

    @property
    def spread(self) -> bool:
        return bool(self.input_spread or self.output_spread)

    def client_args(self) -> list[str]:
        """``vllm bench serve``'s random-dataset arguments for this shape."""
        ratio = json.dumps({"input": self.input_spread, "output": self.output_spread})
        return ["--random-input-len", str(self.input_len),
                "--random-output-len", str(self.output_len), "--random-range-ratio", ratio]


def parse_shape(text: str) -> Shape:
    """``IN[~R]/OUT[~R]`` (see the module docstring) as a :class:`Shape`; ValueError naming
    ``--shapes`` otherwise."""
    halves = text.strip().split("/")
    if len(halves) != 2:
        raise ValueError(f"--shapes: {text!r} is not IN/OUT (e.g. 256/64 or 1024~0.5/256~0.5)")
    (input_len, input_spread), (output_len, output_spread) = (
        _length(half, text) for half in halves)
    return Shape(input_len, output_len, input_spread, output_spread)


def _length(part: str, text: str) -> tuple[int, float]:
    length, _, spread = part.partition("~")
    try:
        tokens, ratio = int(length), float(spread) if spread else 0.0
    except ValueError:
        raise ValueError(f"--shapes: {text!r}: {part!r} is not LEN or LEN~RATIO") from None
    if tokens < 1:
        raise ValueError(f"--shapes: {text!r}: a length must be at least 1, not {tokens}")
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--shapes: {text!r}: a range ratio must be in [0, 1), not {ratio:g}")
    return tokens, ratio


@dataclass(frozen=True)
class Load:
    concurrency: int | None = None  # closed loop: requests the client keeps in flight
    capacity_fraction: float | None = None  # Poisson: arrivals at this share of vLLM's capacity

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.capacity_fraction is None):
            raise ValueError("Load: give concurrency or capacity_fraction, one of them")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be at least 1, not {self.concurrency}")
        if self.capacity_fraction is not None and not self.capacity_fraction > 0:
            raise ValueError(f"--rate-fractions must be above 0, not {self.capacity_fraction}")

    @property
    def closed(self) -> bool:
        return self.concurrency is not None

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.closed else f"{self.capacity_fraction:g} cap"


@dataclass(frozen=True)
class Point:
    dtype: str  # both servers load the model in it
    shape: Shape
    load: Load

    @property
    def label(self) -> str:
        return f"{self.dtype} {self.shape.label} {self.load.label}"

    def num_prompts(self, base: int) -> int:
        """Requests the point sends: ``base``, and in a closed loop at least two per slot
        (every slot refilled at least once, so the loop runs full before it drains)."""
        return max(base, 2 * self.load.concurrency) if self.load.closed else base


def passes(dtype: str, shapes: list[Shape], concurrency: list[int],
           fractions: list[float]) -> list[list[Point]]:
    """One dtype's passes in run order: every shape's closed-loop points (concurrency rising),
    then every shape's Poisson points (none where ``fractions`` is empty)."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtypes: {dtype!r} is not one of {', '.join(DTYPES)}")
    closed = [Point(dtype, s, Load(concurrency=c)) for s in shapes for c in sorted(concurrency)]
    poisson = [Point(dtype, s, Load(capacity_fraction=f)) for s in shapes for f in fractions]
    return [closed, poisson] if poisson else [closed]


def grid(dtypes: list[str], shapes: list[Shape], concurrency: list[int],
         fractions: list[float]) -> list[Point]:
    """Every point of a sitting, in run order."""
    return [p for d in dtypes for one in passes(d, shapes, concurrency, fractions) for p in one]


def capacity(peer_results: dict[Point, dict], dtype: str, shape: Shape) -> float:
    """vLLM's capacity in the (``dtype``, ``shape``) cell: requests/s it completed at its
    highest closed-loop concurrency there; RuntimeError when it has no such point."""
    closed = [(p.load.concurrency, r) for p, r in peer_results.items()
              if p.dtype == dtype and p.shape == shape and p.load.closed]
    if not closed:
        raise RuntimeError(f"no closed-loop point of vLLM at {dtype} {shape.label}: the "
                           "Poisson points' rates are fractions of its capacity there")
    rate = max(closed, key=lambda pair: pair[0])[1]["request_throughput"]
    if not rate > 0:
        raise RuntimeError(f"vLLM completed {rate} requests/s at {dtype} {shape.label}")
    return rate


def rate_of(point: Point, peer_results: dict[Point, dict]) -> float | None:
    """The request rate the client sends ``point`` at: None (as fast as the concurrency
    allows) for a closed loop, the fraction of vLLM's capacity for a Poisson point."""
    if point.load.closed:
        return None
    return point.load.capacity_fraction * capacity(peer_results, point.dtype, point.shape)
