"""The autoscaler's decision: (metrics snapshot, controller state, config, now) -> targets.

One controller, two loops: the prefill pool and the decode pool each grow and shrink by the
signal of their own phase. :func:`decide` is a pure function; the runner
(``pdserve.cluster.autoscale.runner``) builds the :class:`MetricsSnapshot` in the router actor,
calls it every tick and hands the new targets to the pool manager, which makes them true (a
scale-down is a drain). The signals, the rules that keep it from flapping (down thresholds
below up ones, judged on the load spread over N-1 workers; fast up, slow down, one step per
interval) and the optional predictive floor: docs/autoscaling.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from pdserve.cluster.autoscale.config import SCALED_ROLES, AutoscaleConfig

UP, DOWN = "up", "down"


# -- inputs ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerSignal:
    """One ready (not draining) worker's load, from its latest heartbeat."""

    worker_id: str
    queued_tokens: int = 0  # prompt tokens not computed yet (prefill)
    num_running: int = 0
    num_waiting: int = 0  # queued requests, or reservations waiting for KV (decode)
    kv_usage: float = 0.0  # used / total KV blocks
    max_num_seqs: int = 256  # its engine's batch limit
    busy_fraction: float = 0.0  # forward time / wall time over its last seconds

    @property
    def decode_load(self) -> float:
        return max(self.kv_usage, (self.num_running + self.num_waiting) / self.max_num_seqs)


@dataclass(frozen=True)
class PoolSnapshot:
    """One pool as the runner observed it."""

    role: str  # "prefill" | "decode"
    target: int  # its target now
    workers: tuple[WorkerSignal, ...] = ()  # ready, not draining
    num_starting: int = 0
    num_draining: int = 0
    latency_p90_s: float | None = None  # prefill: its TTFT part; decode: ITL (None: no data)
    num_samples: int = 0  # latency samples in the window
    tokens_per_s: float = 0.0  # prompt tokens prefilled / output tokens streamed, per second

    @property
    def capacity(self) -> int:
        """Workers that count as capacity: ready and starting."""
        return len(self.workers) + self.num_starting


@dataclass(frozen=True)
class MetricsSnapshot:
    """What the controller knows at one tick."""

    pools: dict[str, PoolSnapshot]  # role -> pool, for the roles it scales
    arrival_rate: float = 0.0  # requests per second over the window (prefilled)
    mean_prompt_tokens: float = 0.0  # over the window
    mean_output_tokens: float = 0.0  # output tokens streamed / requests, over the window


# -- state and output -----------------------------------------------------------------------
@dataclass(frozen=True)
class LoadAverage:
    """A pool's load summed over its workers, averaged over about ``window_s`` (exponentially
    weighted): what a step down is judged on, so a load that flickers between heartbeats
    (one sequence now, none the next) counts for its mean, not its peaks."""

    queued_tokens: float = 0.0  # prefill: queued prompt tokens
    busy: float = 0.0  # prefill: busy fractions
    decode_load: float = 0.0  # decode: per-worker loads
    at: float = 0.0  # the time of the latest sample

    @staticmethod
    def of(pool: PoolSnapshot, now: float) -> LoadAverage:
        w = pool.workers
        return LoadAverage(sum(x.queued_tokens for x in w), sum(x.busy_fraction for x in w),
                           sum(x.decode_load for x in w), now)

    def updated(self, pool: PoolSnapshot, now: float, window_s: float) -> LoadAverage:
        new = LoadAverage.of(pool, now)
        a = 1.0 - math.exp(-max(0.0, now - self.at) / window_s)
        return LoadAverage(self.queued_tokens + a * (new.queued_tokens - self.queued_tokens),
                           self.busy + a * (new.busy - self.busy),
                           self.decode_load + a * (new.decode_load - self.decode_load), now)


@dataclass(frozen=True)
class PoolState:
    """What the controller remembers of one pool between ticks."""

    hot_since: float | None = None  # an up signal has held since
    cold_since: float | None = None  # every signal has been low since
    last_step_at: float | None = None
    last_up_at: float | None = None
    measured_capacity: float = 0.0  # highest per-worker tokens/s seen within the SLO
    latency_floor_s: float | None = None  # lowest latency P90 seen (a full window's)
    load: LoadAverage | None = None  # the pool's load averaged over the window
    last_step: str = ""  # the latest step's log line


@dataclass(frozen=True)
class ControllerState:
    pools: dict[str, PoolState] = field(default_factory=dict)

    def pool(self, role: str) -> PoolState:
        return self.pools.get(role, PoolState())


@dataclass(frozen=True)
class Signal:
    """One signal against its threshold."""

    name: str  # "queue" | "ttft" | "kv_load" | "itl" | "min" | "max" | "predictive" | "idle"
    value: float
    threshold: float

    @property
    def severity(self) -> float:
        return self.value / self.threshold if self.threshold else math.inf


@dataclass(frozen=True)
class ScaleStep:
    """One decision: a pool's target moves by one."""

    role: str
    from_size: int
    to_size: int
    reason: str  # the signal's name (the metric's ``reason`` label)
    value: float  # the signal's value
    threshold: float  # what it was compared with
    held_s: float = 0.0  # how long it had held

    @property
    def direction(self) -> str:
        return UP if self.to_size > self.from_size else DOWN

    def line(self) -> str:
        """The one log line of this decision."""
        cmp = ">" if self.direction == UP else "<"
        return (f"autoscale {self.role} {self.from_size} -> {self.to_size} ({self.direction}): "
                f"{self.reason} {self.value:.4g} {cmp} {self.threshold:.4g}"
                + (f", held {self.held_s:.1f} s" if self.held_s else ""))


@dataclass(frozen=True)
class Decision:
    targets: dict[str, int]  # role -> target after this tick (unchanged where no step)
    state: ControllerState
    steps: tuple[ScaleStep, ...] = ()


# -- signals ----------------------------------------------------------------------------------
def _slo_s(config: AutoscaleConfig, role: str) -> float:
    return (config.ttft_slo_ms if role == "prefill" else config.itl_slo_ms) / 1000.0


def _latency_known(pool: PoolSnapshot, config: AutoscaleConfig) -> bool:
    return pool.latency_p90_s is not None and pool.num_samples >= config.min_samples


def up_signals(pool: PoolSnapshot, config: AutoscaleConfig) -> list[Signal]:
    """The signals of ``pool`` above their up thresholds."""
    n = max(1, pool.capacity)
    out = []
    if pool.role == "prefill":
        queued = sum(w.queued_tokens for w in pool.workers) / n
        if queued > config.prefill_queue_up_tokens:
            out.append(Signal("queue", queued, config.prefill_queue_up_tokens))
        latency_name = "ttft"
    else:
        load = sum(w.decode_load for w in pool.workers) / n
        if load > config.decode_load_up:
            out.append(Signal("kv_load", load, config.decode_load_up))
        latency_name = "itl"
    slo = _slo_s(config, pool.role)
    if pool.num_starting == 0 and _latency_known(pool, config) and pool.latency_p90_s > slo:
        out.append(Signal(latency_name, pool.latency_p90_s, slo))
    return out


def down_blockers(pool: PoolSnapshot, config: AutoscaleConfig,
                  latency_floor_s: float | None = None,
                  load: LoadAverage | None = None) -> list[Signal]:
    """The signals that say N-1 workers would not hold ``pool``'s load (each with the value
    projected on N-1 workers); empty when a step down is safe. ``latency_floor_s``: the
    lowest latency P90 the pool has shown (the part of latency no load adds); ``load``: the
    pool's load averaged over the window (default: this snapshot's)."""
    n = pool.capacity
    if n <= 1:
        return [Signal("capacity", n, 2)]
    load = load or LoadAverage.of(pool, 0.0)
    out = []
    if pool.role == "prefill":
        queued = load.queued_tokens / (n - 1)
        if queued >= config.prefill_queue_down_tokens and queued > 0:
            out.append(Signal("queue", queued, config.prefill_queue_down_tokens))
        busy = load.busy / (n - 1)
        if busy >= config.prefill_busy_down:
            out.append(Signal("busy", busy, config.prefill_busy_down))
        latency_name = "ttft"
    else:
        spread = load.decode_load / (n - 1)
        if spread >= config.decode_load_down:
            out.append(Signal("kv_load", spread, config.decode_load_down))
        latency_name = "itl"
    if pool.latency_p90_s is not None and pool.num_samples > 0:
        floor = min(pool.latency_p90_s, latency_floor_s or 0.0)
        projected = floor + (pool.latency_p90_s - floor) * n / (n - 1)
        limit = config.down_slo_fraction * _slo_s(config, pool.role)
        if projected >= limit:
            out.append(Signal(latency_name, projected, limit))
    return out


def _idle_signal(pool: PoolSnapshot, config: AutoscaleConfig, load: LoadAverage) -> Signal:
    """What a step down reports: the projected load on N-1 workers against its threshold."""
    n = max(2, pool.capacity)
    if pool.role == "prefill":
        return Signal("idle", load.busy / (n - 1), config.prefill_busy_down)
    return Signal("idle", load.decode_load / (n - 1), config.decode_load_down)


def _measure(pool: PoolSnapshot, state: PoolState, config: AutoscaleConfig) -> float:
    """The highest per-worker token rate seen within the SLO, this tick included."""
    ready = len(pool.workers)
    if ready and _latency_known(pool, config) and pool.latency_p90_s <= _slo_s(config,
                                                                              pool.role):
        return max(state.measured_capacity, pool.tokens_per_s / ready)
    return state.measured_capacity


def predictive_floor(role: str, snapshot: MetricsSnapshot, capacity: float) -> int | None:
    """Dynamo's replicas = ceil(rate x mean length / per-worker tokens/s), or None."""
    if capacity <= 0 or snapshot.arrival_rate <= 0:
        return None
    length = snapshot.mean_prompt_tokens if role == "prefill" else snapshot.mean_output_tokens
    return max(1, math.ceil(snapshot.arrival_rate * length / capacity - 1e-9))


# -- the decision -----------------------------------------------------------------------------
@dataclass
class _Want:
    role: str
    to_size: int
    signal: Signal
    held_s: float = 0.0


def _pool_want(pool: PoolSnapshot, state: PoolState, config: AutoscaleConfig, now: float,
               floor: int | None) -> tuple[_Want | None, PoolState]:
    """What one pool would do alone (before the budget), and its new timers."""
    low, high = config.bounds(pool.role)
    target = pool.target
    ups = up_signals(pool, config)
    load = state.load.updated(pool, now, config.window_s) if state.load is not None \
        else LoadAverage.of(pool, now)
    blockers = down_blockers(pool, config, state.latency_floor_s, load)
    hot_since = (state.hot_since if state.hot_since is not None else now) if ups else None
    cold_since = (state.cold_since if state.cold_since is not None else now) \
        if not blockers and not ups else None
    state = dataclasses.replace(state, hot_since=hot_since, cold_since=cold_since, load=load)
    if state.last_step_at is not None and now - state.last_step_at < config.scale_interval_s:
        return None, state
    if target < low:
        return _Want(pool.role, target + 1, Signal("min", target, low)), state
    if target > high:
        return _Want(pool.role, target - 1, Signal("max", target, high)), state
    caught_up = pool.capacity >= target
    if floor is not None and floor > target and target < high and caught_up:
        return _Want(pool.role, target + 1, Signal("predictive", floor, target)), state
    if ups and target < high and caught_up and now - hot_since >= config.scale_up_delay_s:
        strongest = max(ups, key=lambda s: s.severity)
        return _Want(pool.role, target + 1, strongest, now - hot_since), state
    in_grace = state.last_up_at is not None and now - state.last_up_at < config.scale_down_grace_s
    above_floor = floor is None or target - 1 >= floor
    if (cold_since is not None and target > low and not in_grace and above_floor
            and pool.capacity <= target and now - cold_since >= config.scale_down_delay_s):
        return _Want(pool.role, target - 1, _idle_signal(pool, config, load),
                     now - cold_since), state
    return None, state


def decide(snapshot: MetricsSnapshot, state: ControllerState, config: AutoscaleConfig,
           now: float) -> Decision:
    """The targets after this tick (see the module docstring); pure."""
    pools, wants = dict(state.pools), []
    for role in SCALED_ROLES:
        pool = snapshot.pools.get(role)
        if pool is None:
            continue
        pool_state = state.pool(role)
        measured = _measure(pool, pool_state, config)
        lowest = pool_state.latency_floor_s
        if _latency_known(pool, config):
            lowest = pool.latency_p90_s if lowest is None else min(lowest, pool.latency_p90_s)
        pool_state = dataclasses.replace(pool_state, measured_capacity=measured,
                                         latency_floor_s=lowest)
        floor = None
        if config.predictive:
            configured = getattr(config, f"{role}_capacity_tokens_per_s")
            floor = predictive_floor(role, snapshot, configured or measured)
        want, pools[role] = _pool_want(pool, pool_state, config, now, floor)
        if want is not None:
            wants.append(want)
    targets = {role: pool.target for role, pool in snapshot.pools.items()}
    steps = []
    # Downs first (they free budget), then ups by severity while the budget allows.
    wants.sort(key=lambda w: (w.to_size > targets[w.role], -w.signal.severity))
    for want in wants:
        growing = want.to_size > targets[want.role]
        scaled = sum(targets.get(r, 0) for r in SCALED_ROLES)
        if growing and want.signal.name != "min" and scaled + 1 > config.budget:
            continue
        step = ScaleStep(want.role, targets[want.role], want.to_size, want.signal.name,
                         want.signal.value, want.signal.threshold, want.held_s)
        targets[want.role] = want.to_size
        steps.append(step)
        pools[want.role] = dataclasses.replace(
            pools[want.role], hot_since=None, cold_since=None, last_step_at=now,
            last_up_at=now if growing else pools[want.role].last_up_at, last_step=step.line())
    return Decision(targets, ControllerState(pools), tuple(steps))
