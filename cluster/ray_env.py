"""Starting or joining Ray on loopback, with the settings that keep it local and quiet."""

from __future__ import annotations

import logging
import os
import tempfile

logger = logging.getLogger(__name__)
NAMESPACE = "pdserve"


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
    import ray

    if ray.is_initialized():
        return ray
    if address:
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
        return ray
    # Ray's socket paths must stay short: keep its temp dir directly under /tmp.
    temp_dir = temp_dir or tempfile.mkdtemp(prefix="pdray-", dir="/tmp")
    ray.init(namespace=NAMESPACE, include_dashboard=False, _temp_dir=temp_dir,
             num_cpus=num_cpus, _node_ip_address="127.0.0.1", logging_level=logging.WARNING,
             configure_logging=False)
    logger.info("local Ray started, temp dir %s", temp_dir)
    return ray
