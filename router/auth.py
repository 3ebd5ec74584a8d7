"""Who may call the router, checked the same way on every front door (DESIGN.md section 8).

* :class:`ApiKey`: the one check. A request is allowed when its ``Authorization`` header (HTTP)
  or ``authorization`` metadata (gRPC) is ``Bearer KEY``; the comparison runs in constant time
  over sha256 digests, so neither the key's bytes nor its length leak through timing.
* :class:`ApiKeyInterceptor`: a ``grpc.aio`` server interceptor that applies it to every
  method (Generation, Admin, reflection) except ``grpc.health.v1.Health``, which stays open
  for load balancers and probes; a refused call ends with UNAUTHENTICATED.
* :class:`TLSConfig`: PEM certificate chain and key, and optionally the CA that client
  certificates must chain to (mutual TLS). Read once from files where the command runs
  (:meth:`TLSConfig.from_files`), then carried as bytes, so the router process needs no access
  to the files; :meth:`grpc_credentials` and :meth:`ssl_context` serve gRPC and HTTP alike.

The HTTP front door (``pdserve.router.http_server``) applies :class:`ApiKey` in an ASGI
middleware with the same open set: its health and version endpoints.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc

OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/",)  # methods callable without the key
_BEARER = "bearer "


class ApiKey:
    """``ApiKey("k").allows("Bearer k")`` is True; ``None`` or any other value is not."""

    def __init__(self, key: str) -> None:
        if not key or any(c.isspace() for c in key):
            raise ValueError("api_key must be non-empty without whitespace")
        self._digest = hashlib.sha256(key.encode()).digest()

    def allows(self, authorization: str | bytes | None) -> bool:
        """Whether an ``Authorization`` value carries the key (constant time in the key)."""
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        given = ""
        if authorization and authorization[:len(_BEARER)].lower() == _BEARER:
            given = authorization[len(_BEARER):].strip()
        digest = hashlib.sha256(given.encode("utf-8", "surrogateescape")).digest()
        return hmac.compare_digest(digest, self._digest) and bool(given)


def _denied(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends every call UNAUTHENTICATED."""

    async def deny(_request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(deny, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health without ``authorization: Bearer KEY`` metadata."""

    def __init__(self, api_key: ApiKey) -> None:
        self._key = api_key

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(OPEN_GRPC_PREFIXES):
            return await continuation(handler_call_details)
        authorization = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                authorization = value
                break
        handler = await continuation(handler_call_details)
        if handler is None or self._key.allows(authorization):
            return handler
        return _denied(handler, "missing or wrong API key: send metadata "
                                "'authorization: Bearer <key>'")


@dataclass(frozen=True)
class TLSConfig:
    """A server's TLS material, PEM bytes (see the module docstring)."""

    cert_chain: bytes  # the server certificate, then any intermediates
    private_key: bytes  # the certificate's private key
    client_ca: bytes | None = None  # clients must present a certificate signed by this CA

    def __post_init__(self) -> None:
        if b"-----BEGIN" not in self.cert_chain:
            raise ValueError("tls_cert must be a PEM certificate")
        if b"-----BEGIN" not in self.private_key or b"PRIVATE KEY" not in self.private_key:
            raise ValueError("tls_key must be a PEM private key")
        if self.client_ca is not None and b"-----BEGIN" not in self.client_ca:
            raise ValueError("tls_client_ca must be a PEM certificate")

    @classmethod
    def from_files(cls, cert: str | os.PathLike | None, key: str | os.PathLike | None,
                   client_ca: str | os.PathLike | None = None) -> TLSConfig | None:
        """Read the files (None when neither ``cert`` nor ``key`` is given); a missing half
        or an unreadable file is a ValueError naming the setting."""
        if cert is None and key is None:
            if client_ca is not None:
                raise ValueError("tls_client_ca needs tls_cert and tls_key (mutual TLS is TLS)")
            return None
        if cert is None or key is None:
            raise ValueError("tls_cert and tls_key must be given together")

        def read(name: str, path) -> bytes:
            try:
                return Path(path).read_bytes()
            except OSError as exc:
                raise ValueError(f"{name}: cannot read {path}: {exc.strerror}") from None

        return cls(read("tls_cert", cert), read("tls_key", key),
                   None if client_ca is None else read("tls_client_ca", client_ca))

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)],
                                           root_certificates=self.client_ca,
                                           require_client_auth=self.mutual)

    def ssl_context(self) -> ssl.SSLContext:
        """A server context (TLS 1.2+); with ``client_ca``, client certificates required."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        with tempfile.TemporaryDirectory(prefix="pdserve-tls-") as folder:
            cert, key = Path(folder, "cert.pem"), Path(folder, "key.pem")
            for path, data in ((cert, self.cert_chain), (key, self.private_key)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            context.load_cert_chain(cert, key)  # the files go with the folder right after
        if self.client_ca is not None:
            context.load_verify_locations(cadata=self.client_ca.decode("ascii"))
            context.verify_mode = ssl.CERT_REQUIRED
        return context
