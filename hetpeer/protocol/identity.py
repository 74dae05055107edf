"""A peer's identity: a readable name bound to its key's fingerprint (`name-fingerprint`), checked without the DHT's
schemas, so a direct link can prove both ends of a fixed plan on a machine without hivemind."""

from __future__ import annotations

import hashlib
import re

NAME_RE = re.compile(r"[a-z0-9][a-z0-9_]{0,23}\Z")
DEVICE_RE = re.compile(r"[a-z0-9][a-z0-9_]{0,23}-[0-9a-f]{12}\Z")


def fingerprint(public_key: bytes) -> str:
    """Twelve hex digits (48 bits) of the SHA-256 of an RSA public key (OpenSSH form): what binds a device id to a key."""
    return hashlib.sha256(public_key).hexdigest()[:12]


def device_id(name: str, public_key: bytes) -> str:
    """`name-fingerprint`: readable, and only the key's holder can announce it."""
    if not NAME_RE.match(name):
        raise ValueError(f"peer name must be 1-24 of a-z, 0-9 and _ starting with a letter or digit, got {name!r}")
    return f"{name}-{fingerprint(public_key)}"


def bound(device: str, public_key: bytes) -> bool:
    """Whether `device` is a device id of `public_key`'s holder: a valid name and that key's fingerprint."""
    name, dash, print_ = device.rpartition("-")
    return bool(dash) and NAME_RE.match(name) is not None and print_ == fingerprint(public_key)
