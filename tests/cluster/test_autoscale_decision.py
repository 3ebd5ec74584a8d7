"""The autoscaler's pure decision on a fake clock: synthetic load traces through a small fluid
model of a prefill pool and a decode pool (workers take ``START_S`` to come up), plus direct
calls for the edge cases (a refused scale-down, the budget, bounds, the predictive floor)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from pdserve.cluster.autoscale.config import AutoscaleConfig
from pdserve.cluster.autoscale.decision import (
    ControllerState,
    MetricsSnapshot,
    PoolSnapshot,
    WorkerSignal,
    decide,
    down_blockers,
    predictive_floor,
)

START_S = 20.0  # a new worker's start time in the model
CONFIG = AutoscaleConfig(enabled=True, min_prefill=1, max_prefill=4, min_decode=1,
                         max_decode=4, scale_interval_s=10, scale_up_delay_s=10,
                         scale_down_delay_s=60, scale_down_grace_s=60, window_s=30,
                         ttft_slo_ms=500, itl_slo_ms=50)


@dataclass
class Load:
    """Requests per second with their prompt and output lengths, at one time."""

    rate: float
    prompt: int = 200
    output: int = 200


@dataclass
class FluidCluster:
    """A fluid model of the two pools, fed to :func:`decide` once a second.

    Prefill: each ready worker computes ``prefill_rate`` prompt tokens/s from one queue; its
    TTFT part is the queue wait plus its own compute. Decode: each ready worker holds up to
    ``slots`` sequences; ITL grows with the batch (``itl0`` x (1 + batch / slots)); KV usage is
    the live tokens over ``kv_tokens``. A step up starts a worker ready ``START_S`` later; a
    step down drains one (a starting one first) at once."""

    config: AutoscaleConfig = CONFIG
    prefill_rate: float = 4000.0
    slots: int = 32
    itl0: float = 0.02
    kv_tokens: int = 32 * 600
    targets: dict = field(default_factory=lambda: {"prefill": 1, "decode": 1})
    ready: dict = field(default_factory=lambda: {"prefill": 1, "decode": 1})
    starting: list = field(default_factory=list)  # (role, ready_at)
    queue: float = 0.0  # prompt tokens waiting
    running: float = 0.0  # sequences at the decode pool
    state: ControllerState = field(default_factory=ControllerState)
    history: list = field(default_factory=list)  # (t, prefill target, decode target)
    steps: list = field(default_factory=list)

    def run(self, trace: Callable[[float], Load], seconds: float) -> FluidCluster:
        for t in range(int(seconds)):
            self.tick(float(t), trace(float(t)))
        return self

    def tick(self, now: float, load: Load) -> None:
        for role, at in [s for s in self.starting if s[1] <= now]:
            self.starting.remove((role, at))
            self.ready[role] += 1
        snapshot = self.observe(load)
        decision = decide(snapshot, self.state, self.config, now)
        self.state = decision.state
        for step in decision.steps:
            self.steps.append((now, step))
            if step.direction == "up":
                self.starting.append((step.role, now + START_S))
            else:
                pending = [s for s in self.starting if s[0] == step.role]
                if pending:
                    self.starting.remove(pending[-1])
                else:
                    self.ready[step.role] -= 1
        self.targets = dict(decision.targets)
        self.history.append((now, self.targets["prefill"], self.targets["decode"]))

    def observe(self, load: Load) -> MetricsSnapshot:
        n_p, n_d = self.ready["prefill"], self.ready["decode"]
        self.queue += load.rate * load.prompt
        done = min(self.queue, n_p * self.prefill_rate)
        self.queue -= done
        ttft = self.queue / (n_p * self.prefill_rate) + load.prompt / self.prefill_rate
        batch = self.running / n_d
        active = min(batch, self.slots)
        itl = self.itl0 * (1 + active / self.slots)
        self.running += done / load.prompt
        self.running -= min(self.running, n_d * active / (load.output * itl))
        batch = self.running / n_d
        kv = min(1.0, min(batch, self.slots) * (load.prompt + load.output / 2) / self.kv_tokens)
        samples = int(load.rate * self.config.window_s)
        prefill = PoolSnapshot(
            "prefill", self.targets["prefill"],
            tuple(WorkerSignal(f"p{i}", queued_tokens=int(self.queue / n_p),
                               busy_fraction=done / (n_p * self.prefill_rate))
                  for i in range(n_p)),
            self._starting("prefill"), latency_p90_s=1.2 * ttft if samples else None,
            num_samples=samples, tokens_per_s=done)
        decode = PoolSnapshot(
            "decode", self.targets["decode"],
            tuple(WorkerSignal(f"d{i}", num_running=int(min(batch, self.slots)),
                               num_waiting=int(max(0.0, batch - self.slots)), kv_usage=kv,
                               max_num_seqs=self.slots) for i in range(n_d)),
            self._starting("decode"), latency_p90_s=1.2 * itl if self.running >= 1 else None,
            num_samples=samples if self.running >= 1 else 0,
            tokens_per_s=n_d * active / itl)
        return MetricsSnapshot({"prefill": prefill, "decode": decode}, load.rate, load.prompt,
                               load.output)

    def _starting(self, role: str) -> int:
        return sum(1 for r, _ in self.starting if r == role)

    def sizes(self, role: str) -> list[int]:
        column = 1 if role == "prefill" else 2
        return [h[column] for h in self.history]


def direction_changes(sizes: list[int]) -> int:
    moves = [b - a for a, b in zip(sizes, sizes[1:], strict=False) if b != a]
    return sum(1 for a, b in zip(moves, moves[1:], strict=False) if (a > 0) != (b > 0))


def pool_totals(sim: FluidCluster) -> list[int]:
    return [p + d for _, p, d in sim.history]


# -- traces -----------------------------------------------------------------------------------
def test_a_ramp_grows_both_pools_one_step_at_a_time_and_never_shrinks_while_rising():
    sim = FluidCluster().run(lambda t: Load(rate=min(30.0, 0.05 * t), prompt=400,
                                            output=100), 900)
    for role in ("prefill", "decode"):
        sizes = sim.sizes(role)
        assert sizes[-1] >= 2, f"{role} never grew: {sizes[-1]}"
        assert all(b - a in (0, 1) for a, b in zip(sizes, sizes[1:], strict=False))
    ups = [(t, s) for t, s in sim.steps if s.direction == "up"]
    for role in ("prefill", "decode"):
        times = [t for t, s in ups if s.role == role]
        assert all(b - a >= CONFIG.scale_interval_s for a, b in zip(times, times[1:],
                                                                     strict=False))


def test_a_spike_grows_the_pools_then_they_return_to_their_minimum_once():
    def spike(t):
        return Load(rate=12.0 if 120 <= t < 240 else 0.5, prompt=500, output=150)

    sim = FluidCluster().run(spike, 900)
    for role in ("prefill", "decode"):
        sizes = sim.sizes(role)
        assert max(sizes) >= 2 and sizes[-1] == 1
        assert direction_changes(sizes) <= 1  # up during the spike, down after: no flapping
    for role in ("prefill", "decode"):  # slow down: no step down soon after a step up
        ups = [t for t, s in sim.steps if s.role == role and s.direction == "up"]
        downs = [t for t, s in sim.steps if s.role == role and s.direction == "down"]
        assert min(downs) - max(ups) >= CONFIG.scale_down_grace_s


def test_a_fast_sawtooth_does_not_oscillate():
    period = 60  # shorter than the down delay: the pools follow the peaks, not the teeth

    def saw(t):
        return Load(rate=12.0 * ((t % period) / period), prompt=500, output=150)

    sim = FluidCluster().run(saw, 1200)
    for role in ("prefill", "decode"):
        assert direction_changes(sim.sizes(role)) == 0
        assert not [s for _, s in sim.steps if s.role == role and s.direction == "down"]


def test_a_slow_sawtooth_changes_direction_at_most_once_per_period():
    period = 400

    def saw(t):
        return Load(rate=12.0 if (t % period) < period / 2 else 0.3, prompt=500, output=150)

    periods = 4
    sim = FluidCluster().run(saw, period * periods)
    for role in ("prefill", "decode"):
        sizes = sim.sizes(role)
        assert max(sizes) >= 2  # it follows the load...
        for k in range(periods):  # ...one run up and one run down per period at most
            window = sizes[k * period:(k + 1) * period]
            assert direction_changes(window) <= 1, (role, k, window)
        assert direction_changes(sizes) <= 2 * periods - 1


def test_long_prompts_short_outputs_grow_prefill_not_decode():
    sim = FluidCluster().run(lambda t: Load(rate=3.0, prompt=3000, output=4), 600)
    assert max(sim.sizes("prefill")) >= 2
    assert set(sim.sizes("decode")) == {1}
    assert {s.reason for _, s in sim.steps if s.role == "prefill"} <= {"queue", "ttft"}


def test_short_prompts_long_outputs_grow_decode_not_prefill():
    sim = FluidCluster().run(lambda t: Load(rate=3.0, prompt=20, output=600), 600)
    assert max(sim.sizes("decode")) >= 2
    assert set(sim.sizes("prefill")) == {1}
    assert {s.reason for _, s in sim.steps if s.role == "decode"} <= {"kv_load", "itl"}


def test_the_budget_caps_both_pools_together():
    config = dataclasses.replace(CONFIG, max_workers=3)
    sim = FluidCluster(config=config).run(lambda t: Load(rate=30.0, prompt=800, output=300),
                                          600)
    assert max(pool_totals(sim)) == 3
    assert min(sim.sizes("prefill")) >= 1 and min(sim.sizes("decode")) >= 1


# -- direct decisions -------------------------------------------------------------------------
def decode_pool(loads: list[float], target: int | None = None, starting: int = 0,
                itl: float | None = None, samples: int = 0) -> PoolSnapshot:
    workers = tuple(WorkerSignal(f"d{i}", kv_usage=u) for i, u in enumerate(loads))
    return PoolSnapshot("decode", len(loads) + starting if target is None else target,
                        workers, starting, latency_p90_s=itl, num_samples=samples)


def prefill_pool(queued: list[int], ttft: float | None = None, samples: int = 0,
                 target: int | None = None, starting: int = 0) -> PoolSnapshot:
    workers = tuple(WorkerSignal(f"p{i}", queued_tokens=q) for i, q in enumerate(queued))
    return PoolSnapshot("prefill", len(queued) + starting if target is None else target,
                        workers, starting, latency_p90_s=ttft, num_samples=samples)


def run_ticks(pools: dict, seconds: float, config: AutoscaleConfig = CONFIG,
              state: ControllerState | None = None, **rates):
    """Tick once a second on the same snapshot until the first step (or ``seconds``)."""
    state, steps = state or ControllerState(), []
    for t in range(int(seconds)):
        decision = decide(MetricsSnapshot(pools, **rates), state, config, float(t))
        state = decision.state
        steps += decision.steps
        if decision.steps:
            break
    return steps, state


def test_a_scale_down_is_refused_while_n_minus_1_workers_would_be_saturated():
    # Two decode workers at 40% each: under the up threshold, but one would hold 80% > 50%.
    pools = {"decode": decode_pool([0.4, 0.4]), "prefill": prefill_pool([0])}
    steps, _ = run_ticks(pools, 1000)
    assert steps == []
    blockers = down_blockers(pools["decode"], CONFIG)
    assert [b.name for b in blockers] == ["kv_load"] and blockers[0].value == pytest.approx(0.8)
    # At 20% each one worker would hold 40%: after the down delay, one step down.
    pools["decode"] = decode_pool([0.2, 0.2])
    steps, _ = run_ticks(pools, 1000)
    assert [(s.role, s.from_size, s.to_size, s.reason) for s in steps] == \
        [("decode", 2, 1, "idle")]


def test_a_flickering_light_load_is_judged_by_its_mean_and_the_pool_shrinks():
    # Two decode workers with one slot each; a sequence runs one tick in three: every third
    # heartbeat shows a full worker (load 1.0), the mean is 1/3 < 0.5 on one worker.
    config = dataclasses.replace(CONFIG, max_decode=2)
    state, steps = ControllerState(), []
    for t in range(600):
        busy = t % 3 == 0
        pool = PoolSnapshot("decode", 2, (WorkerSignal("d0", num_running=int(busy),
                                                       max_num_seqs=1),
                                          WorkerSignal("d1", max_num_seqs=1)))
        decision = decide(MetricsSnapshot({"decode": pool}), state, config, float(t))
        state, steps = decision.state, steps + list(decision.steps)
        if steps:
            break
    assert [(s.from_size, s.to_size) for s in steps] == [(2, 1)]
    assert steps[0].value == pytest.approx(1 / 3, abs=0.1)


def test_a_scale_down_is_refused_while_the_latency_on_n_minus_1_would_break_the_slo():
    # The pool once showed 10 ms ITL (its floor); 27 ms now on 2 workers projects to
    # 10 + 17 x 2 = 44 ms on 1, not under 0.8 x 50 ms.
    light = {"decode": decode_pool([0.1, 0.1], itl=0.010, samples=100)}
    state = decide(MetricsSnapshot(light), ControllerState(), CONFIG, 0.0).state
    assert state.pool("decode").latency_floor_s == 0.010
    loaded = {"decode": decode_pool([0.1, 0.1], itl=0.027, samples=100)}
    assert run_ticks(loaded, 1000, state=state)[0] == []
    assert run_ticks({"decode": decode_pool([0.1, 0.1], itl=0.020, samples=100)}, 1000,
                     state=state)[0] != []  # 10 + 10 x 2 = 30 ms: fine
    # A latency that is all floor (no load adds to it) does not block: 27 ms stays 27 ms.
    assert len(run_ticks(loaded, 1000)[0]) == 1


def test_an_up_signal_must_hold_for_the_delay_and_a_starting_worker_counts_as_capacity():
    pools = {"prefill": prefill_pool([0], ttft=2.0, samples=50)}
    steps, state = run_ticks(pools, 100)
    assert [(s.from_size, s.to_size, s.reason) for s in steps] == [(1, 2, "ttft")]
    assert steps[0].held_s == pytest.approx(CONFIG.scale_up_delay_s)
    # The new worker is starting: the window's TTFT (of the smaller pool) grows nothing more.
    pools = {"prefill": prefill_pool([0], ttft=2.0, samples=50, target=2, starting=1)}
    decision = decide(MetricsSnapshot(pools), state, CONFIG, 500.0)
    assert decision.steps == ()
    # ... but a queue too long even for both (the starting one counted) does.
    pools = {"prefill": prefill_pool([20000], samples=50, target=2, starting=1)}
    steps, _ = run_ticks(pools, 100, state=ControllerState())
    assert [(s.from_size, s.to_size, s.reason) for s in steps] == [(2, 3, "queue")]


def test_no_step_down_within_the_grace_after_a_step_up():
    config = dataclasses.replace(CONFIG, scale_down_delay_s=1, scale_down_grace_s=300)
    hot = {"decode": decode_pool([0.95])}
    steps, state = run_ticks(hot, 100, config)
    assert steps[0].direction == "up"
    up_at = state.pool("decode").last_up_at
    idle = {"decode": decode_pool([0.0, 0.0])}
    times = []
    for t in range(int(up_at) + 1, int(up_at) + 600):
        decision = decide(MetricsSnapshot(idle), state, config, float(t))
        state = decision.state
        if decision.steps:
            times.append(t)
            break
    assert times and times[0] - up_at >= 300


def test_targets_outside_the_bounds_come_back_one_step_per_interval():
    pools = {"prefill": prefill_pool([0] * 6, target=6)}
    state, sizes = ControllerState(), []
    for t in range(0, 60):
        pools = {"prefill": prefill_pool([0] * 6, target=sizes[-1] if sizes else 6)}
        decision = decide(MetricsSnapshot(pools), state, CONFIG, float(t))
        state = decision.state
        sizes.append(decision.targets["prefill"])
    assert sizes[0] == 5 and sizes[-1] == 4
    assert sizes.index(4) - sizes.index(5) >= CONFIG.scale_interval_s


def test_the_predictive_floor_is_dynamos_formula_and_holds_the_pool_up():
    snapshot = MetricsSnapshot({}, arrival_rate=10.0, mean_prompt_tokens=1000,
                               mean_output_tokens=300)
    assert predictive_floor("prefill", snapshot, 4000.0) == math.ceil(10 * 1000 / 4000)
    assert predictive_floor("decode", snapshot, 1000.0) == 3
    assert predictive_floor("decode", MetricsSnapshot({}), 1000.0) is None
    config = dataclasses.replace(CONFIG, predictive=True, decode_capacity_tokens_per_s=1000.0)
    pools = {"decode": decode_pool([0.1])}
    decision = decide(MetricsSnapshot(pools, 10.0, 1000, 300), ControllerState(), config, 0.0)
    assert [(s.to_size, s.reason) for s in decision.steps] == [(2, "predictive")]
    # ...and a pool at its floor is not shrunk, however idle.
    idle = {"decode": decode_pool([0.0, 0.0, 0.0])}
    rates = dict(arrival_rate=10.0, mean_prompt_tokens=1000, mean_output_tokens=300)
    assert run_ticks(idle, 1000, config, **rates)[0] == []
    steps, _ = run_ticks(idle, 1000, config, arrival_rate=5.0, mean_prompt_tokens=1000,
                         mean_output_tokens=300)  # the floor is 2 now
    assert [(s.from_size, s.to_size) for s in steps] == [(3, 2)]


def test_the_measured_capacity_only_counts_windows_within_the_slo():
    ok = PoolSnapshot("prefill", 1, (WorkerSignal("p0"),), latency_p90_s=0.1,
                      num_samples=50, tokens_per_s=3000.0)
    late = dataclasses.replace(ok, latency_p90_s=2.0, tokens_per_s=9000.0)
    state = decide(MetricsSnapshot({"prefill": ok}), ControllerState(), CONFIG, 0.0).state
    state = decide(MetricsSnapshot({"prefill": late}), state, CONFIG, 1.0).state
    assert state.pool("prefill").measured_capacity == 3000.0


def test_every_decision_is_one_line_naming_pool_sizes_signal_and_value():
    steps, _ = run_ticks({"decode": decode_pool([0.95])}, 100)
    assert steps[0].line() == ("autoscale decode 1 -> 2 (up): kv_load 0.95 > 0.9, "
                               "held 10.0 s")


@pytest.mark.parametrize("bad", [dict(min_prefill=3, max_prefill=2), dict(max_decode=0),
                                 dict(max_workers=1), dict(decode_load_down=0.95),
                                 dict(prefill_queue_down_tokens=10_000), dict(window_s=0),
                                 dict(down_slo_fraction=1.5),
                                 dict(decode_capacity_tokens_per_s=0.0)])
def test_bad_settings_raise_a_value_error_naming_the_field(bad):
    with pytest.raises(ValueError) as err:
        AutoscaleConfig(**bad)
    assert any(name in str(err.value) for name in bad)


def test_the_settings_file_takes_helm_style_keys_under_an_autoscale_section(tmp_path):
    from pdserve.cluster.autoscale.config import config_file_values

    path = tmp_path / "autoscale.yaml"
    path.write_text("autoscale:\n  enabled: true\n  minPrefill: 1\n  maxDecode: 3\n"
                    "  ttftSloMs: 250\n  scale_up_delay_s: 2\n  maxWorkers: null\n")
    values = config_file_values(path)
    assert values == dict(enabled=True, min_prefill=1, max_decode=3, ttft_slo_ms=250.0,
                          scale_up_delay_s=2.0, max_workers=None)
    assert AutoscaleConfig(**values).ttft_slo_ms == 250.0
    path.write_text("maxDecode: 2\nscaleUpDelay: 3\n")
    with pytest.raises(ValueError, match="unknown autoscale setting 'scaleUpDelay'"):
        config_file_values(path)
    path.write_text("maxDecode: two\n")
    with pytest.raises(ValueError, match="maxDecode must be int"):
        config_file_values(path)
