"""What the CLI checks before it starts anything: can the router listen where it is asked to,
are the TLS files readable, and will each worker's engine fit its budget?

:func:`check_listen_addresses`: ``--host`` resolves to an address of this machine, and the
gRPC, HTTP and metrics ports (the default metrics port 9400 included) are free, by binding each
for a moment, so a busy port is one message naming its flag, not a Ray traceback from inside the
router actor after Ray and Redis started. On a joined Ray cluster (``--ray-address``) the
routers listen on their own nodes, and nothing is checked here.
:func:`check_tls_files`: the TLS files read and parsed as PEM.

Memory: :func:`check_cluster` runs ``engine.capacity.budget_check.check_engine_fits`` for the
workers the options describe, so a budget too small is one message naming the flag instead of a
failed actor. On a joined Ray cluster (``--ray-address``) the workers' devices may differ from this
machine's, and on CUDA without ``--memory-budget-mib`` the budget is the worker's free device
memory; there the worker's error, unwrapped by :func:`user_error`, is what the user sees.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import re
import socket

import torch
from ray.exceptions import RayError

from pdserve import net
from pdserve.cli.settings import SettingsError, name_flags
from pdserve.cluster.options import ClusterOptions
from pdserve.engine.capacity.budget_check import check_engine_fits
from pdserve.engine.capacity.memory import MemoryBudgetError
from pdserve.engine.config import EngineConfig
from pdserve.router.auth import TLSConfig

logger = logging.getLogger(__name__)


def check_cluster(options: ClusterOptions, model_dir: str) -> None:
    """:func:`check_engine_fits` for the workers ``options`` describes, and that a local Ray
    can hold the pools at their largest (``ClusterOptions.local_ray_cpus``), unless they run
    on a joined Ray cluster (their devices are not this machine's)."""
    if options.ray_address:
        logger.info("--ray-address: the memory budget is checked by the workers themselves")
        return
    config = EngineConfig(model=model_dir, **options.engine)
    for role in options.initial_targets():  # (first: a model that cannot split is named first)
        _check_pool_fits(options, role, config)
    try:
        options.local_ray_cpus()
        if torch.cuda.is_available():  # CUDA workers, one GPU per rank
            options.check_local_gpus(torch.cuda.device_count(), [
                role for role in options.initial_targets()
                if options.device_of(role, config.device) != "cpu"])
    except ValueError as exc:
        raise SettingsError(name_flags("cluster", str(exc))) from None


def _check_pool_fits(options: ClusterOptions, role: str, config: EngineConfig) -> None:
    """check_engine_fits for one pool's group size; a size the pool's own flag set and the
    model cannot split names that flag."""
    ranks = options.ranks_of(role)
    try:
        check_engine_fits(dataclasses.replace(config, tensor_parallel_size=ranks))
    except MemoryBudgetError:
        raise
    except ValueError as exc:
        pool = "prefill" if role == "prefill" else "decode"
        if "tensor_parallel_size" in str(exc) and \
                getattr(options, f"{pool}_tensor_parallel_size") is not None:
            raise SettingsError(f"argument --{pool}-tensor-parallel-size: {exc}") from None
        raise


def check_tls_files(options: ClusterOptions) -> None:
    """SettingsError naming the flag when a TLS file cannot be read or is not PEM."""

    try:
        TLSConfig.from_files(options.tls_cert, options.tls_key, options.tls_client_ca)
    except ValueError as exc:
        raise SettingsError(name_flags("cluster", str(exc))) from None


def _try_listen(host: str, port: int) -> None:
    with net.listening_socket(host, port):
        pass


def check_listen_addresses(options: ClusterOptions) -> None:
    """SettingsError naming the flag when ``--host`` does not resolve or is no address of this
    machine, or when ``--port``, ``--http-port`` or ``--metrics-port`` is in use or given twice
    (see the module docstring; nothing is checked with ``--ray-address``)."""
    if options.ray_address:
        return
    host = options.host
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        _try_listen(host, 0)
    except OSError as exc:
        why = "does not resolve" if isinstance(exc, socket.gaierror) else "is no address of " \
                                                                           "this machine"
        raise SettingsError(f"argument --host: {host!r} {why} ({exc.strerror}): give a name or "
                            f"address of this machine, e.g. 127.0.0.1, or 0.0.0.0 for every "
                            f"interface") from None
    taken: dict[int, str] = {}
    for flag, port in (("--port", options.port), ("--http-port", options.http_port),
                       ("--metrics-port", options.metrics_port)):
        if not port:  # None: off; 0: any free port
            continue
        if port in taken:
            raise SettingsError(f"arguments {taken[port]}, {flag}: both ask for port {port}; "
                                f"give each its own (0: any free port)")
        taken[port] = flag
        try:
            _try_listen(host, port)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise SettingsError(f"argument {flag}: cannot listen on {host}:{port} "
                                    f"({exc.strerror})") from None
            off = ", none: no metrics" if flag == "--metrics-port" else ""
            raise SettingsError(f"argument {flag}: port {port} on {host} is in use by another "
                                f"process: pick a free one ({flag} 0: any free port{off})"
                                ) from None


_WORKER_ERROR = re.compile(r"MemoryBudgetError: (.*)")


def user_error(exc: BaseException | None) -> MemoryBudgetError | None:
    """The :class:`MemoryBudgetError` behind a failed worker start, or None.

    A ``RayTaskError`` carries it as ``.cause``; an actor whose constructor raised it fails its
    calls with an ``ActorDiedError`` that keeps only the creation task's text, whose last line
    is ``...MemoryBudgetError: <message>``."""

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        cause = getattr(exc, "cause", None)
        if isinstance(exc, RayError) and isinstance(cause, BaseException):
            exc = cause
            continue
        if isinstance(exc, MemoryBudgetError):
            return exc
        found = _WORKER_ERROR.findall(str(exc)) if isinstance(exc, RayError) else []
        if found:
            return MemoryBudgetError(found[-1].strip())
        exc = exc.__cause__
    return None
