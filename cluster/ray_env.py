"""Starting or joining Ray on loopback, with the settings that keep it local and quiet."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import tempfile
import threading
import time

from pdserve.cluster.redis_server import redact_url

logger = logging.getLogger(__name__)
NAMESPACE = "pdserve"
# Every worker of a Ray we start imports this first, so the source root that Ray puts on its
# sys.path (the driver's working directory) cannot shadow a third-party package; see
# pdserve.import_path. (A preload, not a runtime_env setup hook: that one delays every worker's
# start.) Ray starts its workers at nice 15 by default, below its own daemons, the Redis server
# and any client on the node; pdserve's actors are the serving path, so they run at nice 0.
SYSTEM_CONFIG = {"preload_python_modules": ["pdserve.import_path"], "worker_niceness": 0}
# How long joining an existing cluster keeps retrying: on Kubernetes the controller can start
# before the Ray head (or its client server) is ready.
CONNECT_TIMEOUT_S = 120.0


def set_loopback_env() -> None:
    """Must run before ``import ray`` (``pdserve.cluster`` runs it on import): keeps Ray on the
    loopback address, no usage stats, no log dedup."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def init_ray(address: str | None = None, temp_dir: str | None = None,
             num_cpus: int | None = None):
    """Join ``address`` or start a local Ray on 127.0.0.1 (no dashboard, own temp dir)."""
    set_loopback_env()
    # lazy: ray (about a second) only once a cluster starts: importing pdserve.cluster stays
    # light for the CLI
    import ray

    if ray.is_initialized():
        return ray
    if address:
        with callers_sigterm_handler():
            return _join(ray, address)
    # Ray's socket paths must stay short: keep its temp dir directly under /tmp.
    temp_dir = temp_dir or tempfile.mkdtemp(prefix="pdray-", dir="/tmp")
    with callers_sigterm_handler():
        ray.init(namespace=NAMESPACE, include_dashboard=False, _temp_dir=temp_dir,
                 _system_config=SYSTEM_CONFIG, num_cpus=num_cpus, _node_ip_address="127.0.0.1",
                 logging_level=logging.WARNING, configure_logging=False)
    logger.info("local Ray started, temp dir %s", temp_dir)
    return ray


@contextlib.contextmanager
def callers_sigterm_handler():
    """``ray.init`` replaces the SIGTERM handler with its own (``sys.exit(15)``) from its first
    line on. When the caller had a handler of its own (``pdserve serve``), it comes back once
    init returns or fails, and a SIGTERM during init goes to it, as if Ray had not replaced
    it: the caller then stops what was started, the half-started Ray included."""
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    try:
        yield
    except SystemExit as exc:
        if exc.code == signal.SIGTERM:
            previous(signal.SIGTERM, None)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _join(ray, address: str, timeout_s: float = CONNECT_TIMEOUT_S, pause_s: float = 5.0):
    """``ray.init(address)``, retried while the connection fails (a ``ray://`` client server
    that is starting, or whose per-client server failed to start) until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
            return ray
        except ConnectionError as exc:
            if time.monotonic() + pause_s > deadline:
                raise ConnectionError(
                    f"could not join the Ray cluster at {redact_url(address)} for "
                    f"{timeout_s:.0f} s: "
                    f"{exc}. Check that the Ray head is running and reachable (its client "
                    f"server's logs are ray_client_server*.err in the head's session "
                    f"logs)") from exc
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:200]
            logger.warning("joining Ray at %s failed (%s); retrying in %.0f s",
                           redact_url(address), why, pause_s)
            time.sleep(pause_s)
