"""The secrets of ``pdserve serve`` and ``demo``: API keys and the Redis password come from files
or the environment, never from the command line, where ``ps`` and shell history show them
(docs/security.md).

| secret            | flag (a file, or a URL)     | environment                              |
|-------------------|-----------------------------|------------------------------------------|
| inference API key | ``--api-key-file``          | ``PDSERVE_API_KEY``                      |
| admin API key     | ``--admin-api-key-file``    | ``PDSERVE_ADMIN_API_KEY``                |
| priority API keys | ``--priority-api-key-file`` | ``PDSERVE_PRIORITY_API_KEYS`` (a,b,...)  |
| Redis password    | ``--redis-password-file``   | ``PDSERVE_REDIS_PASSWORD``               |
| Redis URL         | ``--redis-url`` (no password) | ``PDSERVE_REDIS_URL`` (may hold one)   |

Key files hold one key a line (blank lines and ``#`` comments skipped); the API key and admin
key files hold exactly one.

A flag wins over its variable. :func:`resolve_secrets` reads them into ``ClusterOptions``'
secret fields (``api_key``, ``admin_api_key``, ``priority_api_keys``, ``redis_password``, and
the password into ``redis_url``), which are never flags and never shown in a repr.
The launcher reads them for any caller; what the command line itself may not hold is the CLI's
check (``pdserve.cli.common``: ``refuse_secret_flags``, ``refuse_secret_in_argv``). Every error
names the flag or the variable, never the secret.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from pdserve.cluster.options import ClusterOptions
from pdserve.cluster.redis_server import url_password, with_password
from pdserve.router.auth import keys_from_file

ENV_API_KEY = "PDSERVE_API_KEY"
ENV_ADMIN_API_KEY = "PDSERVE_ADMIN_API_KEY"
ENV_PRIORITY_API_KEYS = "PDSERVE_PRIORITY_API_KEYS"
ENV_REDIS_PASSWORD = "PDSERVE_REDIS_PASSWORD"
ENV_REDIS_URL = "PDSERVE_REDIS_URL"


class SecretError(ValueError):
    """A secret's file or variable is unusable; the message names the flag or the variable."""


def _one_key(path: str, flag: str) -> str:
    keys = _keys(path, flag)
    if len(keys) != 1:
        raise SecretError(f"argument {flag}: {path} holds {len(keys)} keys; one expected")
    return keys[0]


def _keys(path: str, flag: str) -> tuple[str, ...]:
    try:
        return keys_from_file(path, f"argument {flag}")
    except ValueError as exc:
        raise SecretError(str(exc)) from None


def _password_file(path: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise SecretError(f"argument --redis-password-file: cannot read {path}: {why}") from None
    if not text or any(c.isspace() for c in text):
        raise SecretError(f"argument --redis-password-file: {path} must hold one password "
                          f"without whitespace")
    return text


def _env_keys(environ: Mapping[str, str], name: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in environ.get(name, "").split(",") if k.strip())


def _keys_from(options: ClusterOptions, environ: Mapping[str, str]) -> dict:
    """The API keys the files (else the variables) give; {} where neither does."""
    found = {}
    if options.api_key_file is not None:
        found["api_key"] = _one_key(options.api_key_file, "--api-key-file")
    elif environ.get(ENV_API_KEY) and options.api_key is None:
        found["api_key"] = environ[ENV_API_KEY]
    if options.admin_api_key_file is not None:
        found["admin_api_key"] = _one_key(options.admin_api_key_file, "--admin-api-key-file")
    elif environ.get(ENV_ADMIN_API_KEY) and options.admin_api_key is None:
        found["admin_api_key"] = environ[ENV_ADMIN_API_KEY]
    if options.priority_api_key_file is not None:
        found["priority_api_keys"] = _keys(options.priority_api_key_file,
                                           "--priority-api-key-file")
    elif _env_keys(environ, ENV_PRIORITY_API_KEYS) and not options.priority_api_keys:
        found["priority_api_keys"] = _env_keys(environ, ENV_PRIORITY_API_KEYS)
    return found


def _redis_from(options: ClusterOptions, environ: Mapping[str, str]) -> dict:
    """``redis_url`` (from the variable when no flag gave one) and ``redis_password`` (from
    the file, else the variable), the password put into the URL when there is one."""
    url = options.redis_url or environ.get(ENV_REDIS_URL) or None
    password = options.redis_password
    if options.redis_password_file is not None:
        password = _password_file(options.redis_password_file)
    elif environ.get(ENV_REDIS_PASSWORD) and password is None:
        password = environ[ENV_REDIS_PASSWORD]
    if url is not None and password is not None:
        if url_password(url) is not None:
            if url_password(url) == password:
                return {"redis_url": url, "redis_password": password}
            raise SecretError(f"${ENV_REDIS_URL} holds a password and --redis-password-file "
                              f"(or ${ENV_REDIS_PASSWORD}) gives another: keep one of them")
        url = with_password(url, password)
    return {"redis_url": url, "redis_password": password}


def resolve_secrets(options: ClusterOptions, environ: Mapping[str, str]) -> ClusterOptions:
    """``options`` with its secret fields read from the files it names and from ``environ``
    (pass ``{}`` to read the files only). SecretError names what is wrong."""
    found = {**_keys_from(options, environ), **_redis_from(options, environ)}
    try:
        return dataclasses.replace(options, **found)
    except ValueError as exc:  # a malformed key, or the admin key among the inference keys
        sources = (f"--api-key-file/${ENV_API_KEY}, --admin-api-key-file/${ENV_ADMIN_API_KEY}, "
                   f"--priority-api-key-file/${ENV_PRIORITY_API_KEYS}")
        raise SecretError(f"the API keys ({sources}): {exc}") from None
