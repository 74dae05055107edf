"""A peer's identity: in a swarm a readable name bound to its key's fingerprint (`name-fingerprint`); in a fixed
plan the device id the plan gives it, bound to its key by the address book's `key` (the key's whole SHA-256).
Checked without the DHT's schemas, so a direct link proves both ends of a fixed plan without hivemind."""

from __future__ import annotations

import base64
import hashlib
import os
import re
from pathlib import Path

NAME_RE = re.compile(r"[a-z0-9][a-z0-9_]{0,23}\Z")
DEVICE_RE = re.compile(r"[a-z0-9][a-z0-9_]{0,23}-[0-9a-f]{12}\Z")


def fingerprint(public_key: bytes) -> str:
    """Twelve hex digits (48 bits) of the SHA-256 of an RSA public key (OpenSSH form): what binds a device id to a key."""
    return hashlib.sha256(public_key).hexdigest()[:12]


def key_digest(public_key: bytes) -> str:
    """The whole SHA-256 of a public key (OpenSSH form), 64 hex digits: what a peer is told to trust for a key it
    has not seen (`--coordinator-key`, a fixed plan's address book)."""
    return hashlib.sha256(public_key).hexdigest()


def device_id(name: str, public_key: bytes) -> str:
    """`name-fingerprint`: readable, and only the key's holder can announce it."""
    if not NAME_RE.match(name):
        raise ValueError(f"peer name must be 1-24 of a-z, 0-9 and _ starting with a letter or digit, got {name!r}")
    return f"{name}-{fingerprint(public_key)}"


def bound(device: str, public_key: bytes) -> bool:
    """Whether `device` is a device id of `public_key`'s holder: a valid name and that key's fingerprint."""
    name, dash, print_ = device.rpartition("-")
    return bool(dash) and NAME_RE.match(name) is not None and print_ == fingerprint(public_key)


class KeyFileError(ValueError):
    """A key file that cannot be read, or holds no RSA private key."""


class LinkKey:
    """An RSA private key that proves a fixed plan's peer on its direct links. It signs as hivemind's RSAPrivateKey
    does (RSA-PSS over SHA-256, salt of the largest length, base64) and its public key is in OpenSSH form, so the
    handshake takes it and a swarm peer's key alike (`handshake.prove`), without loading hivemind."""

    def __init__(self, private_key) -> None:
        self._private_key = private_key

    def sign(self, data: bytes) -> bytes:
        from cryptography.hazmat.primitives import hashes

        return base64.b64encode(self._private_key.sign(data, _pss(), hashes.SHA256()))

    def get_public_key(self) -> "_PublicBytes":
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        return _PublicBytes(self._private_key.public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH))

    @property
    def digest(self) -> str:
        """The SHA-256 of the public key: what a fixed plan's address book gives its holder as `key`."""
        return key_digest(self.get_public_key().to_bytes())

    def to_bytes(self) -> bytes:
        from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

        return self._private_key.private_bytes(Encoding.DER, PrivateFormat.TraditionalOpenSSL, NoEncryption())


class _PublicBytes:
    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def to_bytes(self) -> bytes:
        return self.raw


def load_or_create_link_key(path: str | Path) -> LinkKey:
    """The RSA private key in `path` (DER, as hivemind writes its keys), created there (2048 bits, mode 0600) when
    the file does not exist; KeyFileError naming the file when it cannot be read or is not one."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        key = LinkKey(rsa.generate_private_key(public_exponent=65537, key_size=2048))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(key.to_bytes())
        return key
    try:
        loaded = serialization.load_der_private_key(path.read_bytes(), password=None)
    except OSError as error:
        raise KeyFileError(f"cannot read key file {path}: {error.strerror or error}") from None
    except (ValueError, TypeError):  # TypeError: a key file that is password-protected
        loaded = None
    if not isinstance(loaded, rsa.RSAPrivateKey):  # another kind of key would fail later, when signing
        raise KeyFileError(f"{path} is not an RSA private key in DER form (delete it to make a new identity)")
    return LinkKey(loaded)


def verify(public_key: bytes, data: bytes, signature: bytes) -> bool:
    """Whether `signature` (base64, as `LinkKey.sign` and hivemind's keys write it) is the holder of `public_key`'s
    (an RSA key in OpenSSH form) over `data`; ValueError when the key does not parse or is not RSA."""
    from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    try:
        key = serialization.load_ssh_public_key(public_key)
    except (ValueError, TypeError, UnsupportedAlgorithm) as error:  # what cryptography raises for keys it cannot load
        raise ValueError(str(error) or type(error).__name__) from None
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError(f"expected an RSA key, got {type(key).__name__}")
    try:
        key.verify(base64.b64decode(signature, validate=True), data, _pss(), hashes.SHA256())
    except (ValueError, InvalidSignature):  # binascii.Error (not base64) is a ValueError
        return False
    return True


def _pss():
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding

    return padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)
