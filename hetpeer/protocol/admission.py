"""Who may join a swarm: join tokens signed by the coordinator's key, and allow-lists of peer keys.

A join token (`hetpeer invite`) is `hpt1.<claims>.<signature>`: the claims are JSON in URL-safe base64
(`swarm`, `expires` as Unix time, an optional peer `name`, and a random `id` so two tokens differ), the
signature is the coordinator's RSA-PSS signature over the claims' base64 text, in URL-safe base64. A peer
puts its token in its signed record; the coordinator admits the record while the token verifies under its
own key, names this swarm, has not expired and, when it names a peer, the record's device id has that name.
Anyone who holds a token can use it until it expires: hand tokens out as you would a password.

An allow-list file names admitted peers, one a line: a device id (`NAME-<12 hex>`), or a key fingerprint
(the 12 hex digits, any name). `#` starts a comment.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetpeer.protocol.identity import DEVICE_RE, NAME_RE
from hetpeer.protocol.records import MAX_TOKEN_CHARS

TOKEN_PREFIX = "hpt1"
FINGERPRINT_RE = re.compile(r"[0-9a-f]{12}\Z")
_FROM_URLSAFE = str.maketrans("-_", "+/")
MAX_ALLOWLIST_LINES = 100_000


class AdmissionError(ValueError):
    """A token that does not admit its holder, or an allow-list that does not parse; the message says why."""


@dataclass(frozen=True, slots=True)
class TokenClaims:
    swarm: str
    expires: float  # Unix time
    name: str | None = None  # the peer name it is for; None: any
    id: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"swarm": self.swarm, "expires": self.expires, "name": self.name, "id": self.id}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text.translate(_FROM_URLSAFE) + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise AdmissionError(f"token's {what} is not URL-safe base64") from None


def mint_token(private_key: Any, swarm: str, expires: float, name: str | None = None) -> str:
    """A join token for `swarm`, signed with the coordinator's hivemind RSAPrivateKey."""
    if name is not None and not NAME_RE.match(name):
        raise ValueError(f"peer name must be 1-24 of a-z, 0-9 and _ starting with a letter or digit, got {name!r}")
    if not math.isfinite(expires):
        raise ValueError(f"expiry must be a finite time, got {expires}")
    claims = _b64(json.dumps(TokenClaims(swarm, float(expires), name, os.urandom(6).hex()).to_wire(),
                             separators=(",", ":")).encode())
    signature = base64.b64decode(private_key.sign(claims.encode()))  # hivemind signs in standard base64
    return f"{TOKEN_PREFIX}.{claims}.{_b64(signature)}"


def read_token(token: str, coordinator_key: bytes) -> TokenClaims:
    """The claims of a token signed by `coordinator_key` (an OpenSSH public key); AdmissionError when it is
    malformed or another key signed it."""
    from hivemind.utils.crypto import RSAPublicKey

    if len(token) > MAX_TOKEN_CHARS:
        raise AdmissionError(f"token is {len(token)} characters, at most {MAX_TOKEN_CHARS}")
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        raise AdmissionError(f"not a hetpeer join token (expected {TOKEN_PREFIX}.<claims>.<signature>)")
    signature = base64.b64encode(_unb64(parts[2], "signature"))
    if not RSAPublicKey.from_bytes(coordinator_key).verify(parts[1].encode(), signature):
        raise AdmissionError("token is not signed by this swarm's coordinator")
    try:
        raw = json.loads(_unb64(parts[1], "claims"))
    except (ValueError, RecursionError):
        raise AdmissionError("token's claims are not JSON") from None
    if (not isinstance(raw, dict) or set(raw) != {"swarm", "expires", "name", "id"} or not isinstance(raw["swarm"], str)
            or not isinstance(raw["expires"], float) or not isinstance(raw["id"], str)
            or not (raw["name"] is None or isinstance(raw["name"], str))):
        raise AdmissionError("token's claims do not have the fields of a join token")  # only we sign them: a bug or an old version
    return TokenClaims(raw["swarm"], raw["expires"], raw["name"], raw["id"])


def token_refusal(token: str | None, device_id: str, swarm: str, coordinator_key: bytes, now: float) -> str | None:
    """Why `token` does not admit `device_id` to `swarm` at `now` (Unix time), or None when it does."""
    if token is None:
        return "its record carries no join token"
    try:
        claims = read_token(token, coordinator_key)
    except AdmissionError as error:
        return str(error)
    if claims.swarm != swarm:
        return f"its token is for swarm {claims.swarm!r}"
    if claims.expires <= now:
        return f"its token expired at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(claims.expires))}"
    if claims.name is not None and device_id.rpartition("-")[0] != claims.name:
        return f"its token is for a peer named {claims.name!r}"
    return None


@dataclass(frozen=True, slots=True)
class Allowlist:
    devices: frozenset[str]
    fingerprints: frozenset[str]

    def admits(self, device_id: str) -> bool:
        return device_id in self.devices or device_id.rpartition("-")[2] in self.fingerprints

    @staticmethod
    def parse(text: str, source: str) -> "Allowlist":
        devices, fingerprints = set(), set()
        lines = text.splitlines()
        if len(lines) > MAX_ALLOWLIST_LINES:
            raise AdmissionError(f"{source}: {len(lines)} lines, at most {MAX_ALLOWLIST_LINES}")
        for number, line in enumerate(lines, 1):
            entry = line.split("#", 1)[0].strip()
            if not entry:
                continue
            if DEVICE_RE.match(entry):
                devices.add(entry)
            elif FINGERPRINT_RE.match(entry):
                fingerprints.add(entry)
            else:
                raise AdmissionError(f"{source} line {number}: {entry[:80]!r} is neither a device id (NAME-<12 hex>) "
                                     "nor a key fingerprint (12 hex digits)")
        return Allowlist(frozenset(devices), frozenset(fingerprints))

    @staticmethod
    def read(path: Path) -> "Allowlist":
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise AdmissionError(f"cannot read allow-list {path}: {getattr(error, 'strerror', None) or error}") from None
        return Allowlist.parse(text, str(path))
