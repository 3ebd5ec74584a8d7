"""A worker's figures on their way to the operator: WorkerStats (the worker's message) ->
WorkerRecord (cluster/registry.py) -> its Redis hash -> WorkerRecord -> WorkerInfo
(cluster/admin.py) -> the Admin proto's Worker (router/admin_server.py).

Each step is derived from the dataclass fields with a short named list of the fields renamed
or filled elsewhere. The first tests fail when a field is added to one side and not handled
on the other; then every value goes the whole way (random values, real Redis)."""

from __future__ import annotations

import dataclasses
import json
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.api import admin_pb2
from pdserve.cluster.admin import (
    INFO_FROM_MEMBER,
    INFO_FROM_STATS,
    INFO_FROM_UTILIZATION,
    worker_info,
)
from pdserve.cluster.pools.manager import Member
from pdserve.cluster.pools.store import MemberRecord
from pdserve.cluster.registry import (
    REGISTRY_ONLY,
    STATS_STORED,
    Registry,
    WorkerRecord,
    stats_stored,
)
from pdserve.router.admin_server import WORKER_PB_ENCODED, WORKER_STATES, WorkerInfo, worker_pb
from pdserve.worker_api import Utilization, WorkerStats

from .conftest import AUTH

WORKER_PB = admin_pb2.Worker.DESCRIPTOR


def test_every_stats_field_is_kept_in_the_record_and_every_record_field_is_named():
    """A WorkerStats field the record lacks (or a record field nothing fills) would be silently
    lost between the worker and the router: each stats field has its own record field of its
    kind, or a named encoding; every other record field is the registry's own."""
    stats_kinds = {f.name: f.type for f in dataclasses.fields(WorkerStats)}
    record_kinds = {f.name: f.type for f in dataclasses.fields(WorkerRecord)}
    kept = [stats_stored(name).field for name in stats_kinds]
    assert len(set(kept)) == len(kept), "two WorkerStats fields kept in one record field"
    assert set(STATS_STORED) <= set(stats_kinds), "STATS_STORED names no WorkerStats field"
    assert set(kept).isdisjoint(REGISTRY_ONLY)
    assert not set(kept) - set(record_kinds), "WorkerStats fields the record lacks"
    assert not set(record_kinds) - set(kept) - set(REGISTRY_ONLY), \
        "WorkerRecord fields no WorkerStats field fills, not in REGISTRY_ONLY"
    for name, kind in stats_kinds.items():
        if name not in STATS_STORED:
            assert record_kinds[name] == kind, f"WorkerRecord.{name} is not a {kind}"


def test_every_info_field_has_one_named_source():
    stats_names = {f.name for f in dataclasses.fields(WorkerStats)}
    info_names = [f.name for f in dataclasses.fields(WorkerInfo)]
    tables = (INFO_FROM_MEMBER, INFO_FROM_STATS, INFO_FROM_UTILIZATION)
    for name in info_names:
        named = sum(name in table for table in tables)
        assert named == 1 or (named == 0 and name in stats_names), \
            f"WorkerInfo.{name} has no source, or more than one"
    assert {n for table in tables for n in table} <= set(info_names), "a stale entry"
    assert set(INFO_FROM_STATS.values()) <= stats_names
    for attribute in INFO_FROM_UTILIZATION.values():
        assert hasattr(Utilization(), attribute), attribute


def test_every_worker_proto_field_is_filled_from_one_info_field():
    filled = [WORKER_PB_ENCODED.get(f.name, (f.name,))[0] for f in dataclasses.fields(WorkerInfo)]
    assert sorted(filled) == sorted(f.name for f in WORKER_PB.fields)
    for f in dataclasses.fields(WorkerInfo):
        if f.default is None:  # None is sent as unset: the proto field must have presence
            assert WORKER_PB.fields_by_name[f.name].has_presence, f.name


_TEXT = st.text(max_size=12)
_KINDS = {  # a strategy per WorkerStats field type, within the record's bounds
    "str": _TEXT,
    "int": st.integers(0, (1 << 63) - 1),
    "float": st.floats(min_value=0.0, allow_nan=False, allow_infinity=False),
    "bool": st.booleans(),
    "str | None": st.none() | st.text(min_size=1, max_size=40),
    "dict": st.dictionaries(_TEXT.filter(lambda key: key != "block_size"),
                            st.none() | st.booleans() | st.integers() | _TEXT, max_size=4),
    "tuple[str, ...]": st.lists(st.text("0123456789abcdef", min_size=64, max_size=64),
                                max_size=3).map(tuple),  # LoRA adapter digests
    "dict[str, int]": st.dictionaries(_TEXT, st.integers(0, (1 << 63) - 1), max_size=4),
}


def _stats() -> st.SearchStrategy[WorkerStats]:
    fields = {f.name: _KINDS[f.type] for f in dataclasses.fields(WorkerStats)}
    fields.update(worker_id=st.text(min_size=1, max_size=12),
                  role=st.sampled_from(["prefill", "decode", "colocated"]))
    return st.builds(WorkerStats, **fields)


@pytest.fixture(scope="module")
def registry(redis_url):
    registry = Registry(redis_url, cluster=uuid.uuid4().hex, auth=AUTH)
    yield registry
    registry.close()


@settings(max_examples=60, deadline=None)
@given(stats=_stats(), pid=st.integers(0, 1 << 31), node=_TEXT,
       member_pid=st.sampled_from([0, 4242]), restarts=st.integers(0, 100),
       state=st.sampled_from(WORKER_STATES), member_error=st.sampled_from(["", "actor died"]))
def test_every_value_survives_from_the_stats_to_the_proto(registry, stats, pid, node,
                                                          member_pid, restarts, state,
                                                          member_error):
    registry.heartbeat(WorkerRecord.from_stats(stats, pid=pid))
    try:
        [record] = registry.workers()
    finally:
        registry.remove(stats.worker_id)
    assert record.to_stats() == stats and record.pid == pid

    member = Member(MemberRecord(stats.worker_id, stats.role, restarts, pid=member_pid,
                                 node_ip=node), actor=None, state=state, error=member_error)
    now = record.heartbeat_time + 2.5
    worker = worker_pb(worker_info(member, record, now))
    util = stats.utilization
    expected = {  # every proto field, from where an operator expects it
        "worker_id": stats.worker_id, "role": stats.role, "node": node,
        "pid": member_pid or pid, "state": admin_pb2.WorkerState.Value(
            f"WORKER_STATE_{state.upper()}"),
        "running": stats.num_running, "waiting": stats.num_waiting,
        "kv_used_blocks": stats.used_blocks, "kv_total_blocks": stats.total_blocks,
        "heartbeat_age_s": now - record.heartbeat_time, "restarts": restarts,
        "error": member_error or stats.error or "",
        "compute_utilization": util.compute, "bandwidth_utilization": util.bandwidth,
        "busy_fraction": stats.busy_fraction, "binding": util.binding,
        "ledger_json": stats.ledger,
        "prefix_hit_tokens": stats.prefix_hit_tokens,
        "prefix_query_tokens": stats.prefix_query_tokens,
        "lora_slots": stats.lora_slots, "lora_resident": list(stats.lora_resident),
        "kv_host_blocks": stats.kv_host_blocks, "kv_disk_blocks": stats.kv_disk_blocks,
    }
    assert sorted(expected) == sorted(f.name for f in WORKER_PB.fields)
    got = {f.name: getattr(worker, f.name) for f in WORKER_PB.fields}
    got["ledger_json"] = json.loads(got["ledger_json"])
    got["lora_resident"] = list(got["lora_resident"])
    assert got == expected


def test_a_member_without_a_record_reports_only_what_the_manager_knows():
    member = Member(MemberRecord("decode-1", "decode", 2, pid=7, node_ip="10.0.0.1"),
                    actor=None, state="dead", error="actor died")
    worker = worker_pb(worker_info(member, None, 100.0))
    assert not worker.HasField("heartbeat_age_s")
    assert (worker.worker_id, worker.role, worker.pid, worker.node, worker.restarts,
            worker.error) == ("decode-1", "decode", 7, "10.0.0.1", 2, "actor died")
    assert (worker.running, worker.kv_total_blocks, worker.ledger_json) == (0, 0, "{}")
