"""pdserve.api: the gRPC contract (``generation.proto`` and its generated code) and the
Python clients.

``from pdserve.api import PdserveClient`` works; the client module (and grpc) is imported
only on first use, so importing ``pdserve.api.generation_pb2`` stays light.
"""

from __future__ import annotations

_CLIENT_NAMES = frozenset({"PdserveClient", "AsyncPdserveClient", "PdserveError", "Usage",
                           "GenerateChunk", "GenerateResult", "ModelInfo",
                           "build_generate_request"})

__all__ = sorted(_CLIENT_NAMES)


def __getattr__(name: str):
    if name in _CLIENT_NAMES:
        # lazy: the clients import grpc's aio stack; the generated messages alone do not
        from pdserve.api import client

        return getattr(client, name)
    raise AttributeError(f"module 'pdserve.api' has no attribute {name!r}")
