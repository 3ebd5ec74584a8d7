"""What the ``pdserve`` commands share: one-line user errors, the refusal of secrets on the
command line, and the client flags for the server's keys and TLS files."""

from __future__ import annotations

import argparse
import os
import sys

from pdserve.api.client import ClientTLS
from pdserve.cluster.credentials import ENV_REDIS_PASSWORD, ENV_REDIS_URL, SecretError
from pdserve.cluster.options import ClusterOptions
from pdserve.cluster.redis_server import url_password
from pdserve.router.auth import keys_from_file

# A flag that would put a secret in argv -> what to use instead.
SECRET_FLAGS = {
    "--api-key": "put the key in a file and pass --api-key-file FILE, or set PDSERVE_API_KEY",
    "--admin-api-key": "put the key in a file and pass --admin-api-key-file FILE, or set "
                       "PDSERVE_ADMIN_API_KEY",
    "--priority-api-key": "put the keys in a file (one a line) and pass "
                          "--priority-api-key-file FILE, or set PDSERVE_PRIORITY_API_KEYS",
    "--redis-password": "put it in a file and pass --redis-password-file FILE, or set "
                        "PDSERVE_REDIS_PASSWORD",
}


def fail(prog: str, message: str):
    """A user error: one line on stderr, exit code 2 (as argparse's own errors)."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


class _SecretInArgv(argparse.Action):
    """A flag whose value would be a secret on the command line: it only says what to use."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"argument {option_string}: a secret on the command line shows in ps and "
                     f"in shell history; {SECRET_FLAGS[self.option_strings[0]]}")


def refuse_secret_flags(parser: argparse.ArgumentParser, *flags: str) -> None:
    """Add ``flags`` (keys of :data:`SECRET_FLAGS`) as flags that exit 2 with one line saying
    to use the file or the environment. They must exist: argparse would otherwise take
    ``--api-key KEY`` as an abbreviation of ``--api-key-file`` and read a file named KEY."""
    for flag in flags:
        parser.add_argument(flag, nargs="?", action=_SecretInArgv, default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)


def refuse_secret_in_argv(options: ClusterOptions) -> None:
    """SecretError when ``redis_url`` (as the command line gave it) holds a password."""
    if options.redis_url and url_password(options.redis_url) is not None:
        raise SecretError(
            f"argument --redis-url: the URL holds a password, which ps and shell history "
            f"show: give the URL without it and the password in --redis-password-file FILE "
            f"or ${ENV_REDIS_PASSWORD}, or put the whole URL in ${ENV_REDIS_URL}")


def add_client_security(parser, *, inference: bool = True, admin: bool = False) -> None:
    """The key files and TLS files of a client command: ``--api-key-file`` (``inference``, for
    Generation) and ``--admin-api-key-file`` (``admin``, for Admin)."""
    if inference:
        parser.add_argument("--api-key-file", default=None, metavar="FILE",
                            help="file holding the server's API key (default: "
                                 "$PDSERVE_API_KEY)")
    if admin:
        parser.add_argument("--admin-api-key-file", default=None, metavar="FILE",
                            help="file holding the server's admin key (default: "
                                 "$PDSERVE_ADMIN_API_KEY; a server without one answers "
                                 "Admin only on its own machine)")
    refuse_secret_flags(parser, "--api-key", "--admin-api-key")
    parser.add_argument("--tls-ca", default=None, metavar="FILE",
                        help="speak TLS, verifying the server with this PEM CA file")
    parser.add_argument("--tls-cert", default=None, metavar="FILE",
                        help="this client's PEM certificate, for mutual TLS (with --tls-key)")
    parser.add_argument("--tls-key", default=None, metavar="FILE",
                        help="this client's PEM private key")


def _key(prog: str, path: str | None, flag: str, env: str) -> str | None:
    """The key in the file ``path`` (exactly one), else ``$env``, else None."""


    if path is None:
        return os.environ.get(env) or None
    try:
        keys = keys_from_file(path, f"argument {flag}")
    except ValueError as exc:
        fail(prog, str(exc))
    if len(keys) != 1:
        fail(prog, f"argument {flag}: {path} holds {len(keys)} keys; a client sends one")
    return keys[0]


def _tls(prog: str, args):
    if not (args.tls_ca or args.tls_cert or args.tls_key):
        return None
    try:
        return ClientTLS.from_files(args.tls_ca, args.tls_cert, args.tls_key)
    except (OSError, ValueError) as exc:
        fail(prog, f"argument --tls-ca/--tls-cert/--tls-key: {exc}")


def client_security(prog: str, args) -> dict:
    """{"api_key", "tls"} for a Generation client, from --api-key-file (or $PDSERVE_API_KEY)
    and --tls-* (one-line exit 2 when bad)."""
    return {"api_key": _key(prog, args.api_key_file, "--api-key-file", "PDSERVE_API_KEY"),
            "tls": _tls(prog, args)}


def admin_security(prog: str, args) -> dict:
    """{"api_key", "tls"} for an Admin client: the key is the admin key, from
    --admin-api-key-file (or $PDSERVE_ADMIN_API_KEY)."""
    return {"api_key": _key(prog, args.admin_api_key_file, "--admin-api-key-file",
                            "PDSERVE_ADMIN_API_KEY"),
            "tls": _tls(prog, args)}
