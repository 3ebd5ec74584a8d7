"""The LoRA adapters a router serves, by the name clients put in a request's ``model``.

A front door resolves ``model`` once, before the preparation stage (:func:`resolve_model`):
the served model's name (or nothing, on gRPC) is the base model; a registered adapter's name
is that adapter, whose :class:`~pdserve.worker_api.adapters.AdapterRef` the request then
carries to every worker it runs on (``PreparedRequest.adapter`` -> ``WorkRequest.adapter``);
anything else is ``UnknownModelError`` naming the field (gRPC NOT_FOUND, HTTP 404
``model_not_found``).

:class:`ServedAdapters` is this router's view of the cluster's adapter registry
(``pdserve.cluster.adapters``), which keeps it current: a router without one serves the base
model alone. Unloading an adapter takes it out of this view, so new requests for it are
refused; a request already resolved keeps its ``AdapterRef`` and finishes.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.router.errors import UnknownModelError
from pdserve.worker_api.adapters import AdapterRef

__all__ = ["ServedAdapters", "resolve_model"]


class ServedAdapters:
    """The adapters a router serves now, by name."""

    def __init__(self, adapters: Iterable[AdapterRef] = ()) -> None:
        self._by_name: dict[str, AdapterRef] = {}
        self.replace(adapters)

    def get(self, name: str) -> AdapterRef | None:
        return self._by_name.get(name)

    def all(self) -> list[AdapterRef]:
        """Every adapter, by name."""
        return [self._by_name[name] for name in sorted(self._by_name)]

    def replace(self, adapters: Iterable[AdapterRef]) -> None:
        """Serve exactly ``adapters`` from now on."""
        self._by_name = {a.name: a for a in adapters}

    def put(self, adapter: AdapterRef) -> None:
        self._by_name[adapter.name] = adapter

    def remove(self, name: str) -> None:
        self._by_name.pop(name, None)

    def __len__(self) -> int:
        return len(self._by_name)


def resolve_model(field: str, name: str, base_names: Iterable[str],
                  adapters: ServedAdapters | None) -> AdapterRef | None:
    """The adapter a request's ``model`` (the wire field ``field``) names; None for the base
    model (one of ``base_names``); UnknownModelError for any other name."""
    base_names = tuple(n for n in base_names if n)
    if name in base_names:
        return None
    adapter = adapters.get(name) if adapters is not None else None
    if adapter is not None:
        return adapter
    served = [*base_names[:1], *(a.name for a in (adapters.all() if adapters else []))]
    listed = ", ".join(repr(n) for n in served[:20]) + (", ..." if len(served) > 20 else "")
    raise UnknownModelError(field, f"the model {name[:256]!r} does not exist; this server "
                                   f"serves {listed} (GET /v1/models lists them)")
