"""Who may call the router and what each caller may do, checked the same way on every front
door (docs/security.md).

Keys. Every key travels as ``Authorization: Bearer KEY`` (HTTP) or ``authorization: Bearer KEY``
metadata (gRPC) and is compared in constant time over sha256 digests (:class:`ApiKey`), so
neither its bytes nor its length leak through timing. A router knows three kinds:

* inference keys (``api_keys``): gRPC Generation and reflection, and every HTTP path but
  ``/health`` and ``/version``. With none configured (and no priority key) these are open to
  whoever reaches the port: there are no tenants to tell apart, so nothing is gated either,
  and every caller may ask any priority.
* priority keys (``priority_keys``): inference keys that may also ask ``priority`` < 0, which
  runs ahead of the default and may shed other clients' queued requests. Any other caller that
  asks for it is refused (PERMISSION_DENIED on gRPC, 403 with ``param: "priority"`` on HTTP)
  by :func:`check_priority`, which the preparation stage (``pdserve.router.prepare``) calls
  for both front doors.
* the admin key (``admin_key``): ``pdserve.v1.Admin`` (``pdserve status`` / ``pdserve drain``)
  and the Prometheus ``/metrics`` port. Admin refuses inference keys (PERMISSION_DENIED), so
  an API client cannot drain workers or resize pools. Without an admin key, Admin answers only
  callers on a loopback address or a Unix socket (the operator on the router's own machine or
  pod; a remote caller is refused whatever key it sends), and ``/metrics`` stays open. The
  admin key must differ from every inference key.

Health (``grpc.health.v1``) stays open for load balancers and probes.

* :class:`Access`: one router's keys and the rules above.
* :class:`Caller` and :data:`CALLER`: who sent the request in hand, set by each front door's
  auth layer (:class:`AccessInterceptor` on gRPC, ``http_asgi.Guard`` on HTTP) for the handler
  that runs in the same task, which hands it to the preparation stage; :func:`check_priority`
  refuses a priority when none was set.
* Tenants (fair turns inside a priority level, ``pdserve.router.admission``): with inference
  keys, each key is one tenant, named by :func:`tenant_of_key` (a short hash, never the key);
  what a client claims as its tenant is ignored, so it cannot take another key's share.
  Without keys the client's claimed name is the tenant, at most ``MAX_TENANT_CHARS`` long.
  :func:`request_tenant` is the one rule, applied by the preparation stage.
* :class:`AccessInterceptor`: a ``grpc.aio`` server interceptor applying :class:`Access` to
  every method; a refused call ends with UNAUTHENTICATED (no or wrong key) or
  PERMISSION_DENIED (a known caller without the right).
* :func:`keys_from_file`: the keys of a key file (one a line), for the command line.
* :class:`TLSConfig`: PEM certificate chain and key, and optionally the CA that client
  certificates must chain to (mutual TLS). Read once from files where the command runs
  (:meth:`TLSConfig.from_files`), then carried as bytes, so the router process needs no access
  to the files; :meth:`grpc_credentials` and :meth:`ssl_context` serve gRPC and HTTP alike.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import ipaddress
import os
import ssl
import tempfile
from collections.abc import Awaitable, Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

import grpc

from pdserve.router.errors import PermissionDeniedError, RequestValidationError

OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/",)  # methods callable without a key
ADMIN_GRPC_PREFIX = "/pdserve.v1.Admin/"  # methods that need the admin key (or loopback)
_BEARER = "bearer "
_WRONG_KEY = "missing or wrong API key: send metadata 'authorization: Bearer <key>'"
MAX_TENANT_CHARS = 128  # a client-named tenant (routers without keys), at most


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


def _any_allows(keys: list[ApiKey], authorization: str | bytes | None) -> bool:
    """Whether one of ``keys`` matches; every key is compared (no early exit)."""
    return any([key.allows(authorization) for key in keys])


@dataclass(frozen=True)
class Caller:
    """Who sent the request in hand, as the front door's auth layer found it."""

    may_prioritize: bool  # may ask priority < 0 (a priority key, or a router with no keys)
    tenant: str | None = None  # its key's tenant (tenant_of_key); None: a router without keys


OPEN_CALLER = Caller(may_prioritize=True)  # any caller of a router without inference keys
CALLER: ContextVar[Caller | None] = ContextVar("pdserve_caller", default=None)


def tenant_of_key(key: str) -> str:
    """The tenant an inference key stands for: stable, short, and not the key (a hash of it)."""
    return "key-" + hashlib.sha256(b"pdserve-tenant\0" + key.encode()).hexdigest()[:12]


def request_tenant(claimed: str | None, caller: Caller | None) -> str | None:
    """The tenant a request counts under (see the module docstring): ``caller``'s key's when it
    has one, ``claimed`` ignored; otherwise ``claimed`` ("" or None: the anonymous tenant),
    RequestValidationError naming ``tenant`` when it is too long."""
    if caller is not None and caller.tenant is not None:
        return caller.tenant
    if claimed and len(claimed) > MAX_TENANT_CHARS:
        raise RequestValidationError("tenant", f"at most {MAX_TENANT_CHARS} characters")
    return claimed or None


def check_priority(priority: int, caller: Caller | None) -> None:
    """Refuse ``priority`` < 0 (PermissionDeniedError naming ``priority``) unless ``caller``
    may ask for it (None, no caller known, may not)."""
    if priority >= 0:
        return
    if caller is not None and caller.may_prioritize:
        return
    raise PermissionDeniedError(
        "priority", f"{priority} runs ahead of the default (0) and needs a priority key "
                    "(the server's --priority-api-key-file or PDSERVE_PRIORITY_API_KEYS); "
                    "send priority >= 0 or use such a key")


def is_loopback_peer(peer: str) -> bool:
    """Whether a gRPC peer (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, ``unix:/path``)
    is on this machine: a loopback address or a Unix socket."""
    kind, _, address = unquote(peer or "").partition(":")
    if kind in ("unix", "unix-abstract"):
        return True
    if kind not in ("ipv4", "ipv6"):
        return False
    host = address.rsplit(":", 1)[0].strip("[]").split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


class Access:
    """One router's keys and what each may do (see the module docstring). Keys are given as
    strings and kept only as digests."""

    def __init__(self, api_keys: Iterable[str] = (), admin_key: str | None = None,
                 priority_keys: Iterable[str] = ()) -> None:
        api_keys, priority_keys = tuple(api_keys), tuple(priority_keys)
        if admin_key is not None and admin_key in (*api_keys, *priority_keys):
            raise ValueError("admin_api_key must differ from every inference and priority key: "
                             "Admin refuses inference keys")
        inference = tuple(dict.fromkeys((*api_keys, *priority_keys)))
        self._inference = [ApiKey(k) for k in inference]
        self._tenants = [tenant_of_key(k) for k in inference]  # one per inference key
        self._priority = [ApiKey(k) for k in dict.fromkeys(priority_keys)]
        self._admin = None if admin_key is None else ApiKey(admin_key)

    @property
    def is_open(self) -> bool:
        """No inference key: Generation and the HTTP API take anyone's requests."""
        return not self._inference

    @property
    def has_admin_key(self) -> bool:
        return self._admin is not None

    def inference_caller(self, authorization: str | bytes | None) -> Caller | None:
        """The caller an inference request comes from; None when its key is missing or
        wrong (the admin key is no inference key)."""
        if self.is_open:
            return OPEN_CALLER
        matches = [key.allows(authorization) for key in self._inference]  # no early exit
        if not any(matches):
            return None
        return Caller(may_prioritize=_any_allows(self._priority, authorization),
                      tenant=self._tenants[matches.index(True)])

    def admin_refusal(self, authorization: str | bytes | None,
                      peer: str) -> tuple[grpc.StatusCode, str] | None:
        """Why an Admin call from ``peer`` is refused, as (code, message); None: allowed."""
        if self._admin is None:
            if is_loopback_peer(peer):
                return None
            return (grpc.StatusCode.PERMISSION_DENIED,
                    "Admin answers only loopback callers when the server has no admin key: "
                    "start it with --admin-api-key-file or PDSERVE_ADMIN_API_KEY, or call "
                    "from the router's machine")
        if self._admin.allows(authorization):
            return None
        if _any_allows(self._inference, authorization):
            return (grpc.StatusCode.PERMISSION_DENIED,
                    "an inference key cannot call Admin: send the admin key (pdserve status "
                    "--admin-api-key-file FILE, or PDSERVE_ADMIN_API_KEY)")
        return (grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong admin key: send metadata 'authorization: Bearer <admin key>'")

    def metrics_allowed(self, authorization: str | bytes | None) -> bool:
        """Whether a ``/metrics`` scrape may read: always without an admin key, else only
        with it."""
        return self._admin is None or self._admin.allows(authorization)


def keys_from_file(path: str | os.PathLike, name: str) -> tuple[str, ...]:
    """The keys in a key file: one a line, blank lines and ``#`` comments skipped. ValueError
    naming the setting ``name`` when it cannot be read, holds no key, or a line holds
    whitespace inside a key (the key itself is never in the message)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ValueError(f"{name}: cannot read {path}: {why}") from None
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if any(c.isspace() for c in line):
            raise ValueError(f"{name}: line {number} of {path} holds whitespace; put one key "
                             f"on each line")
        keys.append(line)
    if not keys:
        raise ValueError(f"{name}: {path} holds no key (one key a line)")
    return tuple(keys)


_HANDLER_KINDS = {(False, False): grpc.unary_unary_rpc_method_handler,
                  (False, True): grpc.unary_stream_rpc_method_handler,
                  (True, False): grpc.stream_unary_rpc_method_handler,
                  (True, True): grpc.stream_stream_rpc_method_handler}


def _guarded(handler: grpc.RpcMethodHandler,
             prologue: Callable[[grpc.aio.ServicerContext], Awaitable[None]]
             ) -> grpc.RpcMethodHandler:
    """``handler`` with ``prologue(context)`` awaited first in the call's task (it aborts the
    call, or sets :data:`CALLER` for the method)."""
    behavior = (handler.unary_unary or handler.unary_stream or handler.stream_unary
                or handler.stream_stream)
    if inspect.isasyncgenfunction(behavior):
        async def run(request, context):
            await prologue(context)
            async for response in behavior(request, context):
                yield response
    else:
        async def run(request, context):
            await prologue(context)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
    make = _HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
    return make(run, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def _authorization(metadata) -> str | bytes | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value
    return None


class AccessInterceptor(grpc.aio.ServerInterceptor):
    """Applies :class:`Access` to every gRPC method but health: Admin by the admin rule, the
    rest by the inference keys, with the :class:`Caller` set for the method."""

    def __init__(self, access: Access) -> None:
        self._access = access

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        authorization = _authorization(handler_call_details.invocation_metadata)
        if method.startswith(ADMIN_GRPC_PREFIX):
            async def admin(context: grpc.aio.ServicerContext) -> None:
                refusal = self._access.admin_refusal(authorization, context.peer())
                if refusal is not None:
                    await context.abort(*refusal)

            return _guarded(handler, admin)
        caller = self._access.inference_caller(authorization)

        async def inference(context: grpc.aio.ServicerContext) -> None:
            if caller is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, _WRONG_KEY)
            CALLER.set(caller)

        return _guarded(handler, inference)


@dataclass(frozen=True)
class TLSConfig:
    """A server's TLS material, PEM bytes (see the module docstring)."""

    cert_chain: bytes  # the server certificate, then any intermediates
    private_key: bytes = field(repr=False)  # the certificate's private key (never shown)
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
