"""Errors the router raises or receives from a backend, each mapped to one gRPC status code.

The mapping (applied by ``pdserve.router.grpc_server``) is part of the public API
(docs/interfaces.md):

| exception                 | gRPC code          | when                                           |
|---------------------------|--------------------|------------------------------------------------|
| RequestValidationError    | INVALID_ARGUMENT   | bad input; the message names the field         |
| QueueFullError            | RESOURCE_EXHAUSTED | admission queue full (retry later)             |
| RequestTooLargeError      | RESOURCE_EXHAUSTED | the request can never fit any worker           |
| NoWorkersError            | UNAVAILABLE        | no workers, backend not ready, or draining     |
| DeadlineExceededError     | DEADLINE_EXCEEDED  | the request's deadline passed                  |
| RequestFailedError        | INTERNAL           | the request made a worker's step fail (alone)  |
| PermissionDeniedError     | PERMISSION_DENIED  | the caller's key may not ask for this field    |
| UnknownModelError         | NOT_FOUND          | ``model`` names no model or LoRA adapter       |

This module imports no gRPC, so backends can raise these without depending on it.
"""

from __future__ import annotations


class RouterError(Exception):
    """Base of the errors the gRPC front door turns into a status code."""


class RequestValidationError(RouterError, ValueError):
    """A request field is invalid; ``field`` is its path in the proto (``sampling.top_p``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field  # proto field path, e.g. "sampling.temperature" or "token_ids"
        self.message = message  # what is wrong with it


class AdmissionError(RouterError):
    """The backend refused to admit the request."""


class QueueFullError(AdmissionError):
    """The admission queue is full (by requests or by tokens); the client may retry later."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # a hint: when a retry may find room (None: unknown)


class RequestTooLargeError(AdmissionError):
    """The request needs more KV blocks than any worker has in total; retrying cannot help."""


class NoWorkersError(RouterError):
    """No worker can take the request now: none registered, not ready, or draining."""


NOT_READY = ("not ready: no worker can take requests yet (the pools are starting or being "
             "replaced); health reports serving once one can, and generation requests wait "
             "for it")


class DeadlineExceededError(RouterError):
    """The request's deadline passed before it finished."""


class RequestFailedError(RouterError):
    """The request itself made a worker's step fail: it failed there alone (the worker and
    the other requests went on), and it is not retried or migrated, since it would fail the
    same way anywhere."""


class PermissionDeniedError(RouterError):
    """The caller is known but its key may not set ``field`` this way (``priority`` < 0 without
    a priority key); the HTTP front door answers 403 with ``param`` = ``field``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field  # the request field at fault, e.g. "priority"
        self.message = message  # why it is refused and what would allow it


class UnknownModelError(RouterError, LookupError):
    """The request's ``model`` names neither the served model nor a LoRA adapter registered
    now (never registered, or unloaded); the HTTP front door answers 404 ``model_not_found``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field  # the request field at fault: "model"
        self.message = message
