"""Throwaway TLS certificates for tests: a CA, a server and a client certificate signed by it,
and a stranger's self-signed one. Needs ``cryptography`` (a test dependency), imported only when
a certificate is made."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path


def make_test_certificates(folder, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> dict:
    """A throwaway CA, a server certificate for ``hosts`` and a client certificate, all signed
    by that CA, written as PEM files into ``folder``; returns {"ca", "server_cert",
    "server_key", "client_cert", "client_key", "stranger_cert", "stranger_key"} -> path (the
    stranger's certificate is self-signed: a client no server here trusts). Needs
    ``cryptography`` (a test dependency)."""
    # lazy: cryptography is a test dependency
    from cryptography.x509.oid import ExtendedKeyUsageOID

    folder = Path(folder)
    ca_cert, ca_key = _issue("pdserve test CA", None, None, ca=True)
    out = {"ca": _write_pem(folder, "ca", ca_cert, ca_key)[0]}
    server = _issue(hosts[0], ca_key, ca_cert.subject, usage=ExtendedKeyUsageOID.SERVER_AUTH,
                    sans=hosts)
    client = _issue("pdserve test client", ca_key, ca_cert.subject,
                    usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    stranger = _issue("stranger", None, None, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    for stem, (cert, key) in (("server", server), ("client", client), ("stranger", stranger)):
        out[f"{stem}_cert"], out[f"{stem}_key"] = _write_pem(folder, stem, cert, key)
    return out


def _issue(subject: str, issuer_key, issuer_name, *, ca: bool = False, usage=None,
           sans: tuple[str, ...] = ()):
    """A certificate for ``subject`` valid for a day, and its new EC key; self-signed when
    ``issuer_key`` is None. ``sans``: IP addresses or DNS names."""
    # lazy: cryptography is a test dependency
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (x509.CertificateBuilder().subject_name(name(subject))
               .issuer_name(issuer_name or name(subject)).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        alt = []
        for host in sans:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                alt.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256()), key


def _write_pem(folder, stem: str, cert, key) -> tuple[str, str]:
    """``cert`` and ``key`` as ``folder/stem.pem`` and ``folder/stem.key``; their paths."""
    from cryptography.hazmat.primitives import serialization  # lazy: a test dependency

    cert_path, key_path = folder / f"{stem}.pem", folder / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)
