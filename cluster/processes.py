"""Best-effort calls and process checks for starting and stopping a cluster on this machine:
a stop goes on whatever fails, and checks that every process it started is gone."""

from __future__ import annotations

import logging
import time

import psutil

logger = logging.getLogger(__name__)


def quiet_value(fn, default):
    """``fn()``, or ``default`` (logged) when it raises."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - best effort while observing or stopping
        logger.warning("%s failed: %s", getattr(fn, "__name__", "call"), exc)
        return default


def quietly(fn, what: str) -> None:
    """``fn()``, its failure logged as ``what`` and not raised."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - stopping goes on whatever failed
        logger.warning("%s failed: %s", what, exc)


def child_pids() -> set[int]:
    """Every process descending from this one."""
    return {p.pid for p in psutil.Process().children(recursive=True)}


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    """Wait until none of ``pids`` runs (zombies count as gone); returns the survivors."""
    deadline = time.monotonic() + timeout
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in alive if is_running(pid)}
        if alive:
            time.sleep(0.05)
    if alive:
        logger.warning("processes still running after stop: %s", sorted(alive))
    return alive


def is_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
