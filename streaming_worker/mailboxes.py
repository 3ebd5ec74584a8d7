"""Which router owns each request a streaming worker holds, the deltas waiting for each router,
and each router's orphan clock.

Several routers (``--routers N``) poll the same decode or colocated worker. A request belongs
to the router that reserved or submitted it (its *owner*, named by the router's actor name).
A poll drains the worker's whole outbox: the poller keeps its own deltas and every other
router's wait in that router's box, in the order the worker made them; a delta of a request
nobody owns (any more) goes to the poller, whose router ignores a final delta it does not
know and aborts a live one.

The orphan clock is per router: the time of its latest poll (or of its first claim, before it
ever polled). A router silent for longer than the worker's ``orphan_timeout_s`` is gone (dead,
cut off or stuck), whatever the other routers do: :meth:`RouterMailboxes.silent` names it and
the requests it owns, :meth:`RouterMailboxes.forget` drops its box and its clock and marks its
requests as a gone router's, and the worker fails them. A gone router's token deltas are
dropped; its requests' final deltas go to whichever router polls first (the router itself,
if it was only slow, learns why its streams ended; another ignores them).

Identity: the owner table is the worker's one record of the request ids it holds; a second
claim of an id it holds is refused (:meth:`RouterMailboxes.claim`).

Bounds: an owner entry lives from a successful reserve or submit until the request's final
delta is sorted (every end of a request on a worker makes one: finish, abort, failure, and a
gone router's requests are failed at once); a box holds deltas of live routers only and goes
with its router. At idle both are empty once every router has polled; a dead router's share
goes within ``orphan_timeout_s``. :meth:`RouterMailboxes.sizes` reports them.

Threads: the engine loop claims and checks the clocks, poll threads sort and take; one lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.worker_api import DuplicateRequestId, StepDeltas


@dataclass(frozen=True)
class MailboxSizes:
    """What a worker's mailboxes hold now (tests and operators check they stay bounded)."""

    num_owned: int  # requests with an owner entry
    num_boxed: int  # per-request deltas waiting in boxes for a router's next poll
    num_routers: int  # routers with a clock (seen polling or claiming, not forgotten)


@dataclass(frozen=True)
class SilentRouter:
    """A router past its orphan timeout and the requests it owns on this worker."""

    router: str
    silent_s: float  # since its latest poll (or first claim)
    request_ids: list[str]


class RouterMailboxes:
    """See the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        # request_id -> (router, attempt); router None: a forgotten router's (deltas dropped)
        self._owners: dict[str, tuple[str | None, int]] = {}
        self._boxes: dict[str, StepDeltas] = {}  # router -> deltas another's poll drained
        self._heard: dict[str, float] = {}  # router -> its latest poll (clock time)

    # -- engine loop ------------------------------------------------------------------------
    def claim(self, request_id: str, attempt: int, router: str) -> None:
        """``router`` owns ``request_id`` (this attempt) from now on; its clock starts if it
        never polled. DuplicateRequestId, changing nothing, when the id has an owner already:
        every way in (reserve, submit) claims first, so this is where a worker holds one
        request per id."""
        with self._lock:
            if request_id in self._owners:
                raise DuplicateRequestId(f"request_id {request_id!r} is already held here")
            self._owners[request_id] = (router, attempt)
            self._heard.setdefault(router, self._clock())

    def claim_forks(self, request_id: str, fork_ids: list[str]) -> None:
        """The sequences ``request_id`` forked into (``n`` > 1), each with an id of its own
        (``choice_request_id``), belong to its owner; each entry ends with its own final
        delta. Nothing when ``request_id`` has no owner entry (its deltas go to the poller)."""
        with self._lock:
            entry = self._owners.get(request_id)
            if entry is not None:
                for fork_id in fork_ids:
                    self._owners.setdefault(fork_id, entry)

    def release(self, request_id: str) -> None:
        """Undo a claim whose request was refused after all."""
        with self._lock:
            self._owners.pop(request_id, None)

    def silent(self, timeout_s: float) -> list[SilentRouter]:
        """Routers that owned requests here and have not polled for ``timeout_s``; a silent
        router that owns nothing is forgotten at once."""
        now = self._clock()
        with self._lock:
            late = {r: now - t for r, t in self._heard.items() if now - t > timeout_s}
            owned: dict[str, list[str]] = {router: [] for router in late}
            for request_id, (router, _attempt) in self._owners.items():
                if router in owned:
                    owned[router].append(request_id)
            for router, request_ids in owned.items():
                if not request_ids:
                    self._drop(router)
        return [SilentRouter(r, late[r], ids) for r, ids in owned.items() if ids]

    def forget(self, router: str) -> None:
        """``router`` is gone: drop its box and clock; its requests' deltas are dropped from
        now on (their owner entries end with their final deltas, as ever)."""
        with self._lock:
            for request_id, (owner, attempt) in self._owners.items():
                if owner == router:
                    self._owners[request_id] = (None, attempt)
            self._drop(router)

    def _drop(self, router: str) -> None:
        self._boxes.pop(router, None)
        self._heard.pop(router, None)

    # -- poll threads -----------------------------------------------------------------------
    def polled(self, router: str) -> None:
        """``router`` is polling now: its orphan clock starts again."""
        with self._lock:
            self._heard[router] = self._clock()

    def take(self, router: str) -> StepDeltas:
        """The deltas other routers' polls left for ``router``."""
        with self._lock:
            return self._boxes.pop(router, None) or StepDeltas()

    def sort(self, deltas: StepDeltas, router: str) -> StepDeltas:
        """``router``'s share of freshly drained ``deltas``; the rest wait in their owners'
        boxes (a forgotten router's are dropped, but for final ones: the poller's). A final
        delta ends its request's owner entry (of the same attempt)."""
        def owner(request_id: str, attempt: int, final: bool) -> str | None:
            owner, owned_attempt = self._owners.get(request_id, (router, None))
            if final:
                if owned_attempt == attempt:
                    del self._owners[request_id]
                return router if owner is None else owner
            return owner

        with self._lock:
            shares = deltas.split(owner)
            for other, share in shares.items():
                if other != router:
                    self._boxes.setdefault(other, StepDeltas()).extend(share)
        return shares.get(router) or StepDeltas()

    def sizes(self) -> MailboxSizes:
        with self._lock:
            return MailboxSizes(len(self._owners), sum(map(len, self._boxes.values())),
                                len(self._heard))
