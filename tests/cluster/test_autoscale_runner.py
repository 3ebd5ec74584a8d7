"""The autoscaler's observe step (pool manager members + registry records + router windows ->
MetricsSnapshot) and its act step, on a fake pool manager and a fake clock."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pdserve.cluster.autoscale.config import AutoscaleConfig
from pdserve.cluster.autoscale.runner import AutoscaleRunner
from pdserve.cluster.pools.manager import Member
from pdserve.cluster.pools.plan import DRAINING, READY, STARTING
from pdserve.cluster.pools.store import MemberRecord
from pdserve.cluster.registry import WorkerRecord
from pdserve.engine.config import EngineConfig
from pdserve.router.metrics import RouterMetrics


class FakeManager:
    def __init__(self, members, records, targets):
        self.members = {m.worker_id: m for m in members}
        self.records = {r.worker_id: r for r in records}
        self._targets = dict(targets)
        self.set_calls = []
        config = EngineConfig(model="m", max_num_seqs=8)
        self.settings = SimpleNamespace(template=lambda role: SimpleNamespace(config=config))

    @property
    def targets(self):
        return dict(self._targets)

    async def set_target(self, role, size):
        self.set_calls.append((role, size))
        self._targets[role] = size


def member(worker_id, role, state, draining=False):
    return Member(MemberRecord(worker_id, role, draining=draining), actor=None, state=state)


def test_the_snapshot_counts_ready_starting_and_draining_and_reads_the_windows():
    members = [member("prefill-0", "prefill", READY), member("prefill-1", "prefill", STARTING),
               member("decode-0", "decode", READY), member("decode-1", "decode", DRAINING),
               member("decode-2", "decode", READY)]  # ready, but no heartbeat yet: starting
    records = [WorkerRecord("prefill-0", "prefill", queued_tokens=300, busy_fraction=0.5),
               WorkerRecord("decode-0", "decode", total_blocks=100, used_blocks=40,
                            num_running=6, num_waiting=2),
               WorkerRecord("decode-1", "decode", total_blocks=100, used_blocks=90)]
    manager = FakeManager(members, records, {"prefill": 2, "decode": 3})
    metrics, now = RouterMetrics(), 100.0
    for i in range(10):  # the last 10 s: a request a second, 200 prompt tokens, 20 ms TTFT part
        metrics.prefill_ttft_window.add(0.020 + 0.001 * i, now=now - 9 + i)
        metrics.prompt_window.add(200, now=now - 9 + i)
        metrics.itl_window.add(0.010, 50, now=now - 9 + i)
    config = AutoscaleConfig(enabled=True, window_s=10.0)
    runner = AutoscaleRunner(config, manager, metrics, clock=lambda: now)
    runner._started = now - 60
    snap = runner.snapshot({"prefill": 2, "decode": 3}, now)
    prefill, decode = snap.pools["prefill"], snap.pools["decode"]
    assert [w.worker_id for w in prefill.workers] == ["prefill-0"] and prefill.num_starting == 1
    assert prefill.workers[0].queued_tokens == 300 and prefill.workers[0].busy_fraction == 0.5
    assert prefill.latency_p90_s == 0.028 and prefill.num_samples == 10
    assert prefill.tokens_per_s == 200.0  # 2000 prompt tokens over 10 s
    assert [w.worker_id for w in decode.workers] == ["decode-0"]
    assert (decode.num_starting, decode.num_draining) == (1, 1)
    assert decode.workers[0].decode_load == 1.0  # (6 + 2) / max_num_seqs 8 > KV 0.4
    assert decode.latency_p90_s == 0.010 and decode.tokens_per_s == 50.0
    assert snap.arrival_rate == 1.0 and snap.mean_prompt_tokens == 200.0
    assert snap.mean_output_tokens == 51.0  # 50 streamed after the first, per request


def test_a_tick_sets_the_target_counts_the_decision_and_logs_one_line(caplog):
    members = [member("decode-0", "decode", READY)]
    records = [WorkerRecord("decode-0", "decode", total_blocks=10, used_blocks=10)]
    manager = FakeManager(members, records, {"decode": 1})
    clock = [0.0]
    config = AutoscaleConfig(enabled=True, scale_up_delay_s=1.0, scale_interval_s=1.0)
    runner = AutoscaleRunner(config, manager, RouterMetrics(), clock=lambda: clock[0])
    with caplog.at_level("INFO", logger="pdserve.cluster.autoscale.runner"):
        for t in (0.0, 0.5, 1.0):
            clock[0] = t
            asyncio.run(runner.tick())
    assert manager.set_calls == [("decode", 2)]
    lines = [r.getMessage() for r in caplog.records if "->" in r.getMessage()]
    assert lines == ["autoscale decode 1 -> 2 (up): kv_load 1 > 0.9, held 1.0 s"]
    counter = runner.metrics.autoscaler_decisions.labels("decode", "up", "kv_load")
    assert counter._value.get() == 1.0
