"""The worker API: what the router and a worker say to each other, whatever hosts the worker
(a Ray actor or this process). The floor below the engine, the workers, the router and the
cluster: the engine builds its messages, the workers answer through them, the router and the
cluster call the handle.

- ``handle``: :class:`WorkerHandle`, the one protocol every handle implements and every
  holder of a handle names as its type;
- ``messages``: :class:`WorkRequest` in, :class:`Reservation` and :class:`PrefillResult`
  back, a worker's KV events (:class:`KVEvents`, :class:`KVSnapshot`);
- ``deltas``: a step's :class:`RequestDelta`\\ s, polled as :class:`StepDeltas`; the
  request ids of a forked request's sequences (:func:`choice_request_id`);
- ``stats``: :class:`WorkerStats` (load and memory), :class:`Utilization`, :data:`ROLES`;
- ``refusals``: :class:`NoRoomNow`, :class:`NeverFits` (both a :class:`Refusal`),
  :class:`DuplicateRequestId`, :class:`RequestFaultError`;
- ``sampling_params``: :class:`SamplingParams`, how a request samples (a field of
  :class:`WorkRequest`; the offline API takes it too).
"""

from pdserve.worker_api.deltas import (
    PrefixSource,
    RequestDelta,
    StepDeltas,
    choice_request_id,
    split_choice,
)
from pdserve.worker_api.handle import WorkerHandle
from pdserve.worker_api.messages import (
    KV_TIER_ASSUMED_READ_BYTES_PER_S,
    KV_TIER_DISK,
    KV_TIER_HOST,
    KV_TIER_NAMES,
    KV_TIER_POOL,
    MAX_KV_SENDS,
    KVEvents,
    KVSend,
    KVSnapshot,
    PrefillResult,
    Reservation,
    WorkRequest,
)
from pdserve.worker_api.refusals import (
    DuplicateRequestId,
    NeverFits,
    NoRoomNow,
    Refusal,
    RequestFaultError,
)
from pdserve.worker_api.sampling_params import SamplingParams
from pdserve.worker_api.stats import ROLES, Utilization, WorkerStats

__all__ = [
    "KV_TIER_ASSUMED_READ_BYTES_PER_S",
    "KV_TIER_DISK",
    "KV_TIER_HOST",
    "KV_TIER_NAMES",
    "KV_TIER_POOL",
    "MAX_KV_SENDS",
    "ROLES",
    "DuplicateRequestId",
    "KVEvents",
    "KVSend",
    "KVSnapshot",
    "NeverFits",
    "NoRoomNow",
    "PrefillResult",
    "PrefixSource",
    "Refusal",
    "RequestDelta",
    "RequestFaultError",
    "Reservation",
    "SamplingParams",
    "StepDeltas",
    "Utilization",
    "WorkRequest",
    "WorkerHandle",
    "WorkerStats",
    "choice_request_id",
    "split_choice",
]
