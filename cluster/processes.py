"""Best-effort calls and process checks for starting and stopping a cluster on this machine:
a stop goes on whatever fails, within a time budget, and ends every process it started."""

from __future__ import annotations

import logging
import os
import signal
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


def pids_naming(folder: str) -> set[int]:
    """Every process of this user whose command line names ``folder`` (a local Ray's session
    folder: its processes, those a half-started raylet left behind included)."""
    found = set()
    for process in psutil.process_iter(["cmdline", "uids"]):
        try:
            if process.info["uids"] and process.info["uids"].real != os.getuid():
                continue
            if any(folder in part for part in process.info["cmdline"] or []):
                found.add(process.pid)
        except psutil.Error:
            continue
    return found - {os.getpid()}


def wait_gone(pids: set[int], timeout: float, quiet: bool = False) -> set[int]:
    """Wait until none of ``pids`` runs (zombies count as gone); returns the survivors (logged
    unless ``quiet``)."""
    deadline = time.monotonic() + timeout
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in alive if is_running(pid)}
        if alive:
            time.sleep(0.05)
    if alive and not quiet:
        logger.warning("processes still running after stop: %s", sorted(alive))
    return alive


def end_processes(pids: set[int], timeout: float) -> set[int]:
    """SIGTERM each of ``pids`` still running, wait up to ``timeout`` s, then SIGKILL what is
    left; only for processes the caller started. Returns the ones that needed SIGKILL."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    survivors = wait_gone(pids, timeout, quiet=True)
    for pid in survivors:
        logger.info("process %d (%s) still running after %.1f s: killed", pid, _name(pid),
                    timeout)
        _signal(pid, signal.SIGKILL)
    wait_gone(survivors, 2.0)
    return survivors


def _name(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:120]
    except psutil.Error:
        return "?"


def _signal(pid: int, sig: int) -> None:
    try:
        if is_running(pid):
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Deadline:
    """What is left of a time budget (a stop's steps each take at most that)."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self, share: float = 1.0) -> float:
        """``share`` of the time left (never below zero)."""
        return max(0.0, self.end - time.monotonic()) * share


def is_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
