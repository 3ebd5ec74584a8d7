"""The router's waiting queue on a simulated clock: priority order, aging, tenant turns,
shedding from the lowest priority."""

from __future__ import annotations

import asyncio

import pytest

from pdserve import SamplingParams
from pdserve.router.admission import AdmissionQueue
from pdserve.router.errors import QueueFullError
from pdserve.router.flight import Flight
from pdserve.worker_api import WorkRequest


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def flight(request_id: str, priority: int = 0, tenant: str | None = None,
           arrival: float = 0.0) -> Flight:
    params = SamplingParams(max_tokens=1, priority=priority)
    f = Flight(WorkRequest(request_id, [1], params, 1, 0.0), tenant=tenant)
    f.arrival = arrival
    return f


async def grant_order(queue: AdmissionQueue, flights: list[Flight]) -> list[str]:
    """Queue every flight behind a held turn, then let each take and release its turn."""
    holder = flight("holder", -100)
    await queue.turn(holder, 1)
    order: list[str] = []

    async def wait(f: Flight) -> None:
        await queue.turn(f, 5)
        order.append(f.request_id)
        queue.done(f)

    tasks = [asyncio.create_task(wait(f)) for f in flights]
    await asyncio.sleep(0.01)  # every flight is queued
    queue.done(holder)
    await asyncio.gather(*tasks)
    return order


@pytest.mark.parametrize("policy, expected", [("priority", ["b", "c", "a"]),
                                              ("fcfs", ["a", "b", "c"])])
def test_turns_follow_the_policy(policy, expected):
    flights = [flight("a", 5, arrival=1), flight("b", -1, arrival=2), flight("c", 0, arrival=3)]
    assert asyncio.run(grant_order(AdmissionQueue(policy), flights)) == expected


def test_aging_lets_low_priority_through_within_its_bound():
    """A priority-3 request behind an endless stream of priority-0 ones, each turn taking 1 s
    of the clock: with aging 2 s per level it goes within (3 - 0 + 1) * 2 s."""
    clock = Clock()
    queue = AdmissionQueue("priority", aging_s=2.0, clock=clock)
    granted: list[str] = []

    async def take(f: Flight) -> None:
        await queue.turn(f, 60)
        granted.append(f.request_id)
        if f.request_id != "low" and len(granted) < 100:  # the stream goes on
            tasks.append(asyncio.create_task(take(flight(f"hi{len(granted)}", 0,
                                                         arrival=clock.now))))
            await asyncio.sleep(0.001)  # the newcomer is queued before the turn moves
        clock.now += 1.0
        queue.done(f)

    async def main():
        holder = flight("holder", -100)
        await queue.turn(holder, 1)
        tasks.extend([asyncio.create_task(take(flight("low", 3, arrival=0.0))),
                      asyncio.create_task(take(flight("hi", 0, arrival=0.0)))])
        await asyncio.sleep(0.01)
        queue.done(holder)
        while "low" not in granted:
            await asyncio.sleep(0.001)
        for task in tasks:  # the stream's last newcomers
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    tasks: list[asyncio.Task] = []
    asyncio.run(main())
    assert 1 < granted.index("low") <= (3 - 0 + 1) * 2  # it waited, but not forever


def test_tenants_take_turns_inside_a_priority_level():
    flood = [flight(f"a{i}", 0, tenant="a", arrival=i) for i in range(6)]
    few = [flight(f"b{i}", 0, tenant="b", arrival=10 + i) for i in range(3)]
    order = asyncio.run(grant_order(AdmissionQueue("priority"), flood + few))
    first_six = order[:6]
    assert sum(r.startswith("b") for r in first_six) == 3  # equal shares while both wait


def test_shedding_takes_the_lowest_priority_waiter_first():
    queue = AdmissionQueue("priority")

    async def main():
        holder = flight("holder", -100)
        await queue.turn(holder, 1)
        waiters = {name: flight(name, p) for name, p in [("hi", 0), ("lo", 9), ("mid", 4)]}
        tasks = {name: asyncio.create_task(queue.turn(f, 5)) for name, f in waiters.items()}
        await asyncio.sleep(0)
        assert queue.shed_worst(queue.key(flight("new", 1)))  # lo (9) goes, not mid or hi
        assert not queue.shed_worst(queue.key(flight("worse", 20)))  # ranks last: refused
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError) as err:
            await tasks["lo"]
        assert err.value.retry_after_s and "retry" in str(err.value)
        assert not tasks["hi"].done() and not tasks["mid"].done()
        for task in tasks.values():
            task.cancel()
        queue.done(holder)

    asyncio.run(main())


def test_a_timed_out_waiter_leaves_and_the_turn_moves_on():
    queue = AdmissionQueue("fcfs")

    async def main():
        holder = flight("holder")
        await queue.turn(holder, 1)
        with pytest.raises(TimeoutError):
            await queue.turn(flight("late"), 0.01)
        assert len(queue) == 0
        queue.done(holder)
        await queue.turn(flight("next"), 1)  # granted at once

    asyncio.run(main())


def test_the_tenant_table_empties_when_the_requests_leave():
    """Granted and done, timed out or shed: whichever way a request leaves, a tenant with
    nothing left waiting or holding is forgotten, so clients naming ever new tenants cannot
    grow the table."""
    queue = AdmissionQueue("priority")

    async def take(f: Flight) -> None:
        await queue.turn(f, 5)
        queue.done(f)

    async def main():
        holder = flight("holder", -100, tenant="h")
        await queue.turn(holder, 1)
        with pytest.raises(TimeoutError):
            await queue.turn(flight("late", tenant="late"), 0.01)
        shed = asyncio.create_task(queue.turn(flight("worst", 9, tenant="worst"), 5))
        tasks = [asyncio.create_task(take(flight(f"r{i}", 0, tenant=f"t{i}", arrival=i)))
                 for i in range(20)]
        await asyncio.sleep(0.01)  # all queued
        assert queue.num_tenants == 22  # the holder's and one per waiting request
        assert queue.shed_worst(queue.key(flight("new", 1)))
        with pytest.raises(QueueFullError):
            await shed
        queue.done(holder)
        await asyncio.gather(*tasks)
        assert queue.num_tenants == 0 and len(queue) == 0

    asyncio.run(main())
