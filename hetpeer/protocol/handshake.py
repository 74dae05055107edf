"""The direct link's handshake: binds a TCP connection to the swarm keys of the peers at its two ends, and
gives them the keys that seal everything after it (`peer/transport/sealed.py`).

A swarm's device id is `NAME-<fingerprint of the peer's RSA key>` (records.py), a fixed plan's is bound to its
key by the address book (`key`, the key's whole SHA-256), so a peer proves it is the device it claims by
signing a fresh nonce with that key. Both ends prove themselves, each over the other's nonce,
and each brings a fresh X25519 key for this connection alone:

    listener -> dialer    b"HPA2" + 32-byte nonce + 32-byte X25519 key        (the challenge)
    dialer -> listener    proof(role "dialer", the listener's nonce) + 32-byte nonce + 32-byte X25519 key
    listener -> dialer    proof(role "listener", the dialer's nonce)

A proof is three little-endian uint16 lengths, then the prover's device id (UTF-8), its public key
(OpenSSH form, as in its record) and the signature (RSA-PSS over SHA-256, base64, as hivemind signs records)
of `signed_bytes(role, nonce, prover, verifier, keys)`, `keys` being both X25519 keys (the dialer's first).
Naming both devices, the role and both X25519 keys in what is signed means a proof cannot be replayed to
another peer, on another connection, or in the other direction, and that nobody between the two (a relay,
anyone on the path) can put keys of its own in: the two ends' Diffie-Hellman secret is theirs alone, and
`session_keys` derives from it one AES-256-GCM key per direction. Lengths are bounded before anything is
read past them, so a stranger cannot make a peer allocate more than a few KiB. A connection whose handshake
fails is closed before a frame is read; nothing on it reaches the inbox.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any, Mapping

from hetpeer.protocol.identity import bound, fingerprint, key_digest, verify

MAGIC = b"HPA2"
NONCE_BYTES = 32
KEY_BYTES = 32  # an X25519 public key
CHALLENGE_BYTES = len(MAGIC) + NONCE_BYTES + KEY_BYTES
LENGTHS = struct.Struct("<HHH")
MAX_DEVICE_BYTES = 128
MAX_KEY_BYTES = 2048  # an RSA-4096 key in OpenSSH form is about 720 bytes
MAX_SIGNATURE_BYTES = 1024  # base64 of an RSA-4096 signature is 684 bytes
ROLES = ("dialer", "listener")


class HandshakeError(ValueError):
    """A handshake message that does not parse, or a proof that does not hold."""


def nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


class Ephemeral:
    """This end's X25519 key for one connection."""

    def __init__(self) -> None:
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        self._private = X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def secret(self, theirs: bytes) -> bytes:
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

        try:
            return self._private.exchange(X25519PublicKey.from_public_bytes(theirs))
        except ValueError as error:  # a low-order point: no secret to share
            raise HandshakeError(f"the other end's X25519 key is unusable: {error}") from None


def challenge(fresh: bytes, key: bytes) -> bytes:
    """The listener's first message: the magic, its nonce and its X25519 key."""
    return MAGIC + fresh + key


def read_challenge(message: bytes) -> tuple[bytes, bytes]:
    """(nonce, X25519 key) of a challenge; HandshakeError when the message is not one (a peer that does not
    handshake, or speaks an older version of it)."""
    if len(message) != CHALLENGE_BYTES or message[:len(MAGIC)] != MAGIC:
        raise HandshakeError(f"expected a link challenge starting {MAGIC!r}, got {bytes(message[:8])!r}")
    return bytes(message[len(MAGIC):len(MAGIC) + NONCE_BYTES]), bytes(message[len(MAGIC) + NONCE_BYTES:])


def signed_bytes(role: str, nonce: bytes, prover: str, verifier: str, keys: bytes) -> bytes:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return b"\0".join((b"hetpeer link 2", role.encode(), nonce, prover.encode(), verifier.encode(), keys))


def session_keys(secret: bytes, dialer_nonce: bytes, listener_nonce: bytes, dialer: str, listener: str) -> tuple[bytes, bytes]:
    """(dialer-to-listener key, listener-to-dialer key): HKDF-SHA256 over the X25519 secret, salted with both
    nonces and bound to both devices."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    info = b"\0".join((b"hetpeer link 2 keys", dialer.encode(), listener.encode()))
    both = HKDF(hashes.SHA256(), 64, salt=dialer_nonce + listener_nonce, info=info).derive(secret)
    return both[:32], both[32:]


@dataclass(frozen=True, slots=True)
class Proof:
    device: str
    public_key: bytes
    signature: bytes

    def encode(self) -> bytes:
        device = self.device.encode()
        return LENGTHS.pack(len(device), len(self.public_key), len(self.signature)) + device + self.public_key + self.signature

    @staticmethod
    def body_bytes(lengths: bytes) -> int:
        """How many bytes follow the lengths; HandshakeError when a length is over its bound."""
        device, key, signature = LENGTHS.unpack(lengths)
        for what, got, most in (("device id", device, MAX_DEVICE_BYTES), ("public key", key, MAX_KEY_BYTES),
                                ("signature", signature, MAX_SIGNATURE_BYTES)):
            if not 0 < got <= most:
                raise HandshakeError(f"link proof declares a {what} of {got} bytes (1 to {most} allowed)")
        return device + key + signature

    @classmethod
    def decode(cls, lengths: bytes, body: bytes) -> "Proof":
        device, key, _ = LENGTHS.unpack(lengths)
        if len(body) != cls.body_bytes(lengths):
            raise HandshakeError(f"link proof body is {len(body)} bytes, its lengths say {cls.body_bytes(lengths)}")
        try:
            name = bytes(body[:device]).decode()
        except UnicodeDecodeError:
            raise HandshakeError("link proof's device id is not UTF-8") from None
        return cls(name, bytes(body[device:device + key]), bytes(body[device + key:]))


def prove(private_key: Any, role: str, nonce: bytes, prover: str, verifier: str, keys: bytes) -> Proof:
    """`prover`'s proof (signed with its key: a swarm peer's hivemind RSAPrivateKey, a fixed plan peer's `LinkKey`)
    for the peer that sent `nonce`, over the connection's two X25519 keys (`keys`, the dialer's first)."""
    public_key = private_key.get_public_key().to_bytes()
    return Proof(prover, public_key, private_key.sign(signed_bytes(role, nonce, prover, verifier, keys)))


def check(proof: Proof, role: str, nonce: bytes, verifier: str, keys: bytes, expected: str | None = None,
          book: Mapping[str, str] | None = None) -> str:
    """The device `proof` proves (HandshakeError saying why not): its id is bound to the key (its name's
    fingerprint, `device_id`; given a fixed plan's `book` of device -> key digest, the digest the book gives it),
    the key signed this connection's nonce for `verifier` in `role`, and, given `expected`, it is that device."""
    if expected is not None and proof.device != expected:
        raise HandshakeError(f"the peer at this address is {proof.device!r}, not {expected!r}")
    if book is not None:
        if proof.device not in book:
            raise HandshakeError(f"{proof.device!r} has no link key in this plan's address book")
        if key_digest(proof.public_key) != book[proof.device]:
            raise HandshakeError(f"{proof.device!r} presented a key whose SHA-256 is {key_digest(proof.public_key)[:16]}..., "
                                 f"the address book gives it {book[proof.device][:16]}...")
    elif not bound(proof.device, proof.public_key):
        raise HandshakeError(f"device id {proof.device!r} is not bound to the key it presented (fingerprint "
                             f"{fingerprint(proof.public_key)})")
    try:
        verified = verify(proof.public_key, signed_bytes(role, nonce, proof.device, verifier, keys), proof.signature)
    except ValueError as error:
        raise HandshakeError(f"{proof.device}'s public key does not parse: {error}") from None
    if not verified:
        raise HandshakeError(f"{proof.device!r}'s signature over this connection's nonce and keys does not verify: "
                             "it does not hold that device's key, meant another peer, or someone between swapped a key")
    return proof.device
