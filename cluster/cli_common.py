"""What the ``pdserve`` commands share: one-line user errors, and the client flags for the
server's API key and TLS files."""

from __future__ import annotations

import sys


def fail(prog: str, message: str):
    """A user error: one line on stderr, exit code 2 (as argparse's own errors)."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def add_client_security(parser) -> None:
    """--api-key and the TLS files of a client command."""
    parser.add_argument("--api-key", default=None,
                        help="the server's API key (default: $PDSERVE_API_KEY)")
    parser.add_argument("--tls-ca", default=None, metavar="FILE",
                        help="speak TLS, verifying the server with this PEM CA file")
    parser.add_argument("--tls-cert", default=None, metavar="FILE",
                        help="this client's PEM certificate, for mutual TLS (with --tls-key)")
    parser.add_argument("--tls-key", default=None, metavar="FILE",
                        help="this client's PEM private key")


def client_security(prog: str, args) -> dict:
    """{"api_key", "tls"} for a client from --api-key / --tls-* (one-line exit 2 when bad)."""
    import os

    from pdserve.api.client import ClientTLS

    api_key = args.api_key or os.environ.get("PDSERVE_API_KEY") or None
    tls = None
    if args.tls_ca or args.tls_cert or args.tls_key:
        try:
            tls = ClientTLS.from_files(args.tls_ca, args.tls_cert, args.tls_key)
        except (OSError, ValueError) as exc:
            fail(prog, f"argument --tls-ca/--tls-cert/--tls-key: {exc}")
    return {"api_key": api_key, "tls": tls}
