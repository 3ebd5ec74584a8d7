"""The refusals a worker raises and the router sees as the same types through every handle
(a Ray handle unwraps them from Ray's errors): :class:`NoRoomNow` (no free KV blocks now: try
another worker, or wait) and :class:`NeverFits` (this worker can never run the request), both
a :class:`Refusal`; :class:`DuplicateRequestId`, an id the worker holds already; and
:class:`RequestFaultError`, a request that made a step fail."""

from __future__ import annotations


class Refusal(Exception):
    """A worker declined a request; neither the request nor the worker is at fault."""


class NoRoomNow(Refusal):
    """No free KV blocks for the request right now: try another worker, or wait for room."""


class NeverFits(Refusal, ValueError):
    """This worker can never run the request: longer than its context, more KV blocks than its
    pool holds, or ids and values its model cannot take. A client error naming the limit."""


class DuplicateRequestId(ValueError):
    """A worker already holds a request under this id. Ids are the router's (one per
    attempt, never the client's), so a second one is a replay or a bug: refused, never merged
    into the first and never dropped with success."""


class RequestFaultError(RuntimeError):
    """The request itself made a step fail (a prefill worker's future fails with it; a
    streaming worker sends a ``faulted`` delta instead): it failed alone, and running it on
    another worker would fail the same way, so it is never retried or migrated."""
