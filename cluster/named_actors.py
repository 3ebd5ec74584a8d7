"""A cluster's actors found in Ray by name: its worker actors (a stop reaches replacements
the router has not listed yet) and a running router that a launcher may adopt.

Every actor of a cluster lives in the Ray namespace ``cluster_namespace(cluster_name)``; the
routers are named by ``router_name``, the workers by their worker ids.
"""

from __future__ import annotations

import logging

from pdserve.cluster.actors import cluster_namespace
from pdserve.cluster.processes import quiet_value, quietly
from pdserve.cluster.redis_server import redact_url
from pdserve.cluster.router_actor import is_router_name

logger = logging.getLogger(__name__)


def named_workers(ray, cluster_name: str) -> list:
    """Every live worker actor of the cluster, found by name."""
    namespace = cluster_namespace(cluster_name)
    found = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == namespace and not is_router_name(entry["name"]):
            actor = quiet_value(lambda e=entry: ray.get_actor(e["name"], namespace=namespace),
                                None)
            if actor is not None:
                found.append(actor)
    return found


def adoptable_router(ray, name: str, cluster_name: str, redis_url: str, timeout: float):
    """The live router actor ``name`` of the cluster when it uses ``redis_url``, or None.
    A router of that name using another Redis is stale: it and the cluster's workers are
    killed, so a fresh router can take the name."""
    namespace = cluster_namespace(cluster_name)
    try:
        router = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None
    try:
        info = ray.get(router.info.remote(), timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - a broken leftover: replace it
        info = {"redis_url": None}
        logger.warning("leftover router of cluster %s does not answer: %s", cluster_name, exc)
    if info["redis_url"] == redis_url:
        logger.info("adopting the running router of cluster %s", cluster_name)
        return router
    logger.warning("removing a stale router of cluster %s (it uses Redis %s, this launcher %s)",
                   cluster_name, redact_url(info["redis_url"]), redact_url(redis_url))
    for actor in [router, *named_workers(ray, cluster_name)]:
        quietly(lambda actor=actor: ray.kill(actor, no_restart=True), "stale kill")
    return None
