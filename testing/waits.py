"""Polling helpers for tests and benchmarks: wait for a condition, never a fixed sleep.

``wait_for(predicate)`` calls ``predicate()`` until it returns something truthy and returns
that value; after ``timeout`` seconds it raises AssertionError naming ``what`` and the last
value seen. An exception raised by ``predicate`` counts as "not yet" (a server coming back, a
worker starting) and is shown as the last value. ``async_wait_for`` is the same on an asyncio
loop; its predicate may be a plain function or a coroutine function.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], object], timeout: float = 30.0, what: str = "a condition",
             interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        last = _attempt(predicate)
        if last and not isinstance(last, Exception):
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what} "
                                 f"(last: {last!r})")
        time.sleep(interval)


async def async_wait_for(predicate: Callable[[], object], timeout: float = 30.0,
                         what: str = "a condition", interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        last = _attempt(predicate)
        if inspect.isawaitable(last):
            try:
                last = await last
            except Exception as exc:  # noqa: BLE001 - not yet
                last = exc
        if last and not isinstance(last, Exception):
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what} "
                                 f"(last: {last!r})")
        await asyncio.sleep(interval)


def _attempt(predicate):
    try:
        return predicate()
    except Exception as exc:  # noqa: BLE001 - not yet
        return exc
