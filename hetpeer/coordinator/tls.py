"""The TLS identities of the coordinator's API and dashboard, checked as they load.

`ServerTls` is a certificate and its key, which the gRPC API (`api.py`) and the dashboard (`web.py`)
serve with; `ClientTls` the certificates a client of the API trusts (`api_client.py`), often the
server's own self-signed one. Both check their files when they load them, so a certificate that does
not parse or a key that is not the certificate's is one clear `ApiTlsError`, not a failed bind.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from hetpeer.coordinator.api_errors import ApiTlsError


def _read(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ApiTlsError(f"cannot read the {what} {path}: {error.strerror or error}") from None


def _certificate(pem: bytes, path: Path, what: str) -> x509.Certificate:
    """The file's first certificate (the server's own, or the CA to trust), valid now."""
    try:
        certificate = x509.load_pem_x509_certificates(pem)[0]
    except ValueError:
        raise ApiTlsError(f"the {what} {path} holds no PEM certificate") from None
    now = datetime.datetime.now(datetime.timezone.utc)
    if not certificate.not_valid_before_utc <= now <= certificate.not_valid_after_utc:
        raise ApiTlsError(
            f"the {what} {path} is valid from {certificate.not_valid_before_utc:%Y-%m-%d %H:%M} to "
            f"{certificate.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now"
        )
    return certificate


def _public_der(key: Any) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


@dataclass(frozen=True, slots=True)
class ServerTls:
    """The API's certificate (PEM, the server's first, then any chain) and its private key (PEM, unencrypted)."""

    cert_pem: bytes
    key_pem: bytes

    @classmethod
    def load(cls, cert_path: Path, key_path: Path) -> "ServerTls":
        """Read and check them: ApiTlsError naming the file that does not read or parse, is out of its
        validity, or does not match the other."""
        cert_pem, key_pem = _read(cert_path, "TLS certificate"), _read(key_path, "TLS key")
        certificate = _certificate(cert_pem, cert_path, "TLS certificate")
        try:
            key = serialization.load_pem_private_key(key_pem, password=None)
        except TypeError:
            raise ApiTlsError(f"the TLS key {key_path} is encrypted: give it without a passphrase") from None
        except (ValueError, UnsupportedAlgorithm):
            raise ApiTlsError(f"the TLS key {key_path} holds no PEM private key") from None
        if _public_der(key.public_key()) != _public_der(certificate.public_key()):
            raise ApiTlsError(f"the TLS key {key_path} is not the key of the certificate {cert_path}")
        return cls(cert_pem, key_pem)


@dataclass(frozen=True, slots=True)
class ClientTls:
    """The certificates (PEM) a client trusts: the server's own self-signed one, or the CA that signed it."""

    ca_pem: bytes

    @classmethod
    def load(cls, ca_path: Path) -> "ClientTls":
        ca_pem = _read(ca_path, "TLS CA certificate")
        _certificate(ca_pem, ca_path, "TLS CA certificate")
        return cls(ca_pem)
