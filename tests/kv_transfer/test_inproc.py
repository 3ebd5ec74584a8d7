"""The in-process transport: each fault kind, sender semantics, and a property test over random
fault sequences (every transfer completes exactly or is reported failed; nothing is written
for an ended key; no thread survives)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.kv_transfer import (
    FaultKind,
    FaultPlan,
    InProcConnector,
    InProcEndpoint,
    InProcHub,
    KVReceiveSink,
    TransferError,
    TransferKey,
)

SRC_IDS = [3, 1, 4]
DST_IDS = [10, 2, 7]


class Rig:
    """One D endpoint with a recording sink and one P connector on a hub."""

    def __init__(self, kv, plan: FaultPlan | None = None, max_channels: int = 4):
        self.kv = kv
        self.hub = InProcHub()
        self.src = kv.make_pool(11)
        self.dst = kv.make_pool(12)
        self.before = kv.snapshot(self.dst)
        self.sink = kv.RecordingSink(self.dst)
        self.endpoint = InProcEndpoint(self.hub, "decode-0", self.sink)
        self.connector = InProcConnector(self.hub, "prefill-0", fault_plan=plan,
                                         max_channels=max_channels)

    def sender(self):
        return self.connector.sender(self.endpoint.address)

    def close(self):
        self.connector.close()
        assert self.kv.wait_until(lambda: self.endpoint.num_peers == 0, 5.0)
        self.endpoint.close()
        self.sink.close()

    def exact(self, src_ids=SRC_IDS, dst_ids=DST_IDS) -> bool:
        return self.kv.blocks_equal(self.src, src_ids, self.dst, dst_ids)


def run_one(kv, script, wait_end: bool = True):
    rig = Rig(kv, FaultPlan(script))
    key = TransferKey(1, 1)
    rig.sink.expect(key, DST_IDS)
    futures = kv.send_request(rig.sender(), key, rig.src, SRC_IDS, first_token=42)
    for f in futures:
        f.exception(timeout=5)
    if wait_end:
        rig.sink.wait(lambda s: key in s.ended, 5.0)
    return rig, key, futures


@pytest.mark.parametrize("fault", [FaultKind.NONE, FaultKind.DELAY, FaultKind.DUPLICATE])
@pytest.mark.parametrize("frame", [0, 3, 4])  # first layer, last layer, COMMIT
def test_benign_faults_complete_exactly(kv, no_thread_leak, fault, frame):
    rig, key, futures = run_one(kv, {frame: fault})
    assert rig.sink.completed == {key: 42}
    assert rig.exact()
    assert all(f.exception(timeout=5) is None for f in futures)
    rig.close()


@pytest.mark.parametrize("fault", [FaultKind.DROP, FaultKind.TRUNCATE, FaultKind.CORRUPT])
@pytest.mark.parametrize("frame", [0, 2, 3])
def test_damaging_layer_faults_fail_the_key(kv, no_thread_leak, fault, frame):
    rig, key, _ = run_one(kv, {frame: fault})
    assert key in rig.sink.failed and key not in rig.sink.completed
    assert not rig.sink.late_layers
    assert not rig.sink.lost  # a bad payload fails its key, not the channel
    rig.close()


@pytest.mark.parametrize("fault", [FaultKind.TRUNCATE, FaultKind.CORRUPT])
def test_damaged_header_breaks_the_pair(kv, no_thread_leak, fault):
    rig, key, _ = run_one(kv, {4: fault})  # the COMMIT frame has no payload: header is hit
    assert key in rig.sink.failed
    assert rig.sink.wait(lambda s: s.lost, 5.0)
    # the sender learns the pair is gone and the connector builds a new one
    assert kv.wait_until(lambda: rig.sender().send_abort(TransferKey(9, 9)).exception(5) is None)
    rig.close()


def test_dropped_commit_fails_at_close(kv, no_thread_leak):
    rig, key, _ = run_one(kv, {4: FaultKind.DROP}, wait_end=False)
    assert not rig.sink.wait(lambda s: key in s.ended, 0.2)
    rig.close()  # CLOSE reaches D: keys still open on the channel fail
    assert key in rig.sink.failed


def test_peer_death_fails_futures_and_open_keys(kv, no_thread_leak):
    rig, key, futures = run_one(kv, {2: FaultKind.PEER_DEATH})
    assert rig.sink.wait(lambda s: s.lost and key in s.failed, 5.0)
    assert rig.sink.lost[0][0] == "prefill-0"
    assert all(isinstance(f.exception(timeout=5), TransferError) for f in futures[2:])
    # a retry with a new epoch goes through a fresh channel and completes
    retry = TransferKey(1, 2)
    rig.sink.expect(retry, DST_IDS)
    kv.send_request(rig.sender(), retry, rig.src, SRC_IDS, first_token=5)
    assert rig.sink.wait(lambda s: retry in s.completed, 5.0)
    assert rig.exact()
    rig.close()


def test_stale_epoch_and_stray_frames_never_write(kv, no_thread_leak):
    rig = Rig(kv)
    live, stale = TransferKey(4, 2), TransferKey(4, 1)
    rig.sink.expect(live, DST_IDS)
    sender = rig.sender()
    kv.send_request(sender, stale, rig.src, [0, 5, 6])  # unknown to D: drained
    kv.send_request(sender, live, rig.src, SRC_IDS)
    kv.send_request(sender, live, rig.src, [0, 5, 6], commit=False)  # after commit: fenced
    sender.flush(5)
    rig.close()
    assert rig.sink.completed == {live: 7} and rig.exact()
    assert not rig.sink.late_layers
    others = [b for b in range(kv.NUM_BLOCKS) if b not in DST_IDS]
    assert kv.untouched(rig.dst, rig.before, others)


def test_abort_is_delivered_and_fences(kv, no_thread_leak):
    rig = Rig(kv)
    key = TransferKey(8, 1)
    rig.sink.expect(key, DST_IDS)
    sender = rig.sender()
    kv.send_request(sender, key, rig.src, SRC_IDS, commit=False)
    sender.send_abort(key)
    sender.send_abort(key)  # idempotent
    kv.send_request(sender, key, rig.src, SRC_IDS)  # a confused sender keeps going
    sender.flush(5)
    rig.close()
    assert key in rig.sink.failed and key not in rig.sink.completed
    assert not rig.sink.late_layers


@pytest.mark.parametrize(("num_stand_ins", "completes"), [(0, True), (2, True), (3, False),
                                                         (7, False)])
def test_the_commit_names_its_stand_ins_and_the_sink_bounds_them(kv, no_thread_leak,
                                                                 num_stand_ins, completes):
    """The COMMIT's count of stand-in blocks reaches ``on_complete`` unchanged; naming every
    block expected (or more) fails the key: the last block always holds real KV."""
    rig = Rig(kv)
    key = TransferKey(1, 1)
    rig.sink.expect(key, DST_IDS)
    for f in kv.send_request(rig.sender(), key, rig.src, SRC_IDS, first_token=42,
                             num_stand_ins=num_stand_ins):
        f.result(timeout=5)
    assert rig.sink.wait(lambda s: key in s.ended, 5.0)
    if completes:
        assert (rig.sink.completed, rig.sink.stand_ins) == ({key: 42}, {key: num_stand_ins})
    else:
        assert key not in rig.sink.completed
        assert "num_stand_ins" in str(rig.sink.failed[key])
    rig.close()


def test_sinks_satisfy_the_protocol(kv):
    assert isinstance(kv.RecordingSink(kv.make_pool(0)), KVReceiveSink)


def test_sender_rejects_bad_input_and_is_closed_idempotently(kv, no_thread_leak):
    rig = Rig(kv)
    sender = rig.sender()
    with pytest.raises(ValueError, match="layer_start"):
        sender.send_layers(TransferKey(1, 1), 2, 2, torch.zeros(1, 2, 1, 4, 2, 8))
    with pytest.raises(ValueError, match="num_blocks"):
        sender.send_layers(TransferKey(1, 1), 0, 1, torch.zeros(10))
    with pytest.raises(ValueError, match="key"):
        sender.send_commit((1, 1), 0)
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match="num_stand_ins"):
            sender.send_commit(TransferKey(1, 1), 0, num_stand_ins=bad)
    sender.close()
    sender.close()
    assert sender.is_broken
    assert isinstance(sender.send_abort(TransferKey(1, 1)).exception(1), TransferError)
    assert rig.endpoint.num_peers == 0  # never connected: channels are lazy
    rig.close()
    rig.close()


def test_lru_bounds_channels(kv, no_thread_leak):
    hub = InProcHub()
    sinks = [kv.RecordingSink(kv.make_pool(i)) for i in range(3)]
    endpoints = [InProcEndpoint(hub, f"d{i}", s) for i, s in enumerate(sinks)]
    connector = InProcConnector(hub, "p", max_channels=2)
    a, b = (connector.sender(e.address) for e in endpoints[:2])
    a.send_abort(TransferKey(1, 1)).result(5)
    b.send_layers(TransferKey(2, 1), 0, 1, torch.zeros(1, 2, 1, 4, 2, 8)).result(5)
    assert connector.num_channels == 2 and a.is_idle and not b.is_idle
    connector.sender(endpoints[2].address)  # evicts a (idle), not b (open key)
    assert a.is_broken and not b.is_broken
    assert kv.wait_until(lambda: endpoints[0].num_peers == 0)
    with pytest.raises(TransferError, match="busy"):
        connector.sender(endpoints[2].address).send_layers(
            TransferKey(3, 1), 0, 1, torch.zeros(1, 2, 1, 4, 2, 8))
        connector.sender(endpoints[0].address)
    connector.close()
    for e in endpoints:
        e.close()


REQUESTS = 3


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=st.lists(st.sampled_from(list(FaultKind)), max_size=24),
       aborts=st.lists(st.booleans(), min_size=REQUESTS, max_size=REQUESTS),
       per_frame=st.integers(1, 3))
def test_any_fault_sequence_is_safe(kv, script, aborts, per_frame):
    before_threads = set(kv.kv_threads())
    rig = Rig(kv, FaultPlan(script, delay_s=0.002))
    keys = [TransferKey(100 + r, 1) for r in range(REQUESTS)]
    src_ids = [[r, r + 4] for r in range(REQUESTS)]
    dst_ids = [[2 * r + 1, 2 * r + 8] for r in range(REQUESTS)]
    for key, ids in zip(keys, dst_ids, strict=True):
        rig.sink.expect(key, ids)
    for r, key in enumerate(keys):
        sender = rig.sender()
        kv.send_request(sender, key, rig.src, src_ids[r], first_token=r,
                        layers_per_frame=per_frame, commit=not aborts[r])
        if aborts[r]:
            sender.send_abort(key)
            kv.send_request(sender, key, rig.src, src_ids[r], commit=False)  # fenced
    rig.close()
    touched = set()
    for r, key in enumerate(keys):
        outcomes = (key in rig.sink.completed) + (key in rig.sink.failed)
        assert outcomes <= 1
        if key in rig.sink.completed:
            assert not aborts[r]
            assert rig.sink.completed[key] == r
            assert kv.blocks_equal(rig.src, src_ids[r], rig.dst, dst_ids[r])
        elif outcomes == 0:  # no frame of it ever arrived: D's lease frees it
            assert kv.untouched(rig.dst, rig.before, dst_ids[r])
            assert rig.sink.forget(key)
        touched.update(dst_ids[r])
    if all(f in (FaultKind.NONE, FaultKind.DELAY, FaultKind.DUPLICATE) for f in script):
        assert set(rig.sink.completed) == {k for k, a in zip(keys, aborts, strict=True) if not a}
    assert not rig.sink.late_layers
    assert rig.sink.num_expected == 0
    others = [b for b in range(kv.NUM_BLOCKS) if b not in touched]
    assert kv.untouched(rig.dst, rig.before, others)
    assert kv.wait_until(lambda: set(kv.kv_threads()) <= before_threads, 5.0)
