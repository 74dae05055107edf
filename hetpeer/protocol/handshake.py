"""The direct link's handshake: binds a TCP connection to the swarm keys of the peers at its two ends.

A device id is `NAME-<fingerprint of the peer's RSA key>` (records.py), so a peer proves it is the device
it claims by signing a fresh nonce with that key. Both ends prove themselves, each over the other's nonce:

    listener -> dialer    b"HPA1" + 32-byte nonce                      (the challenge)
    dialer -> listener    proof(role "dialer", the listener's nonce) + 32-byte nonce of its own
    listener -> dialer    proof(role "listener", the dialer's nonce)

A proof is three little-endian uint16 lengths, then the prover's device id (UTF-8), its public key
(OpenSSH form, as in its record) and the signature (RSA-PSS over SHA-256, base64, as hivemind signs records)
of `signed_bytes(role, nonce, prover, verifier)`. Naming both devices and the role in what is signed means a
proof cannot be replayed to another peer, on another connection, or in the other direction. Lengths are
bounded before anything is read past them, so a stranger cannot make a peer allocate more than a few KiB.
A connection whose handshake fails is closed before a frame is read; nothing on it reaches the inbox.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

from hetpeer.protocol.identity import bound, fingerprint

MAGIC = b"HPA1"
NONCE_BYTES = 32
CHALLENGE_BYTES = len(MAGIC) + NONCE_BYTES
LENGTHS = struct.Struct("<HHH")
MAX_DEVICE_BYTES = 128
MAX_KEY_BYTES = 2048  # an RSA-4096 key in OpenSSH form is about 720 bytes
MAX_SIGNATURE_BYTES = 1024  # base64 of an RSA-4096 signature is 684 bytes
ROLES = ("dialer", "listener")


class HandshakeError(ValueError):
    """A handshake message that does not parse, or a proof that does not hold."""


def nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def challenge(fresh: bytes) -> bytes:
    """The listener's first message: the magic and its nonce."""
    return MAGIC + fresh


def nonce_of(message: bytes) -> bytes:
    """The nonce in a challenge; HandshakeError when the message is not one (a peer that does not handshake)."""
    if len(message) != CHALLENGE_BYTES or message[:len(MAGIC)] != MAGIC:
        raise HandshakeError(f"expected a link challenge starting {MAGIC!r}, got {bytes(message[:8])!r}")
    return bytes(message[len(MAGIC):])


def signed_bytes(role: str, nonce: bytes, prover: str, verifier: str) -> bytes:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return b"\0".join((b"hetpeer link 1", role.encode(), nonce, prover.encode(), verifier.encode()))


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


def prove(private_key: Any, role: str, nonce: bytes, prover: str, verifier: str) -> Proof:
    """`prover`'s proof (signed with its hivemind RSAPrivateKey) for the peer that sent `nonce`."""
    public_key = private_key.get_public_key().to_bytes()
    return Proof(prover, public_key, private_key.sign(signed_bytes(role, nonce, prover, verifier)))


def check(proof: Proof, role: str, nonce: bytes, verifier: str, expected: str | None = None) -> str:
    """The device `proof` proves (HandshakeError saying why not): its id is bound to the key (`device_id`),
    the key signed this connection's nonce for `verifier` in `role`, and, given `expected`, it is that device."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from hivemind.utils.crypto import RSAPublicKey

    if expected is not None and proof.device != expected:
        raise HandshakeError(f"the peer at this address is {proof.device!r}, not {expected!r}")
    if not bound(proof.device, proof.public_key):
        raise HandshakeError(f"device id {proof.device!r} is not bound to the key it presented (fingerprint "
                             f"{fingerprint(proof.public_key)})")
    try:
        key = RSAPublicKey.from_bytes(proof.public_key)
    except (ValueError, TypeError, UnsupportedAlgorithm) as error:  # what cryptography raises for keys it cannot load
        raise HandshakeError(f"{proof.device}'s public key does not parse: {error}") from None
    if not key.verify(signed_bytes(role, nonce, proof.device, verifier), proof.signature):
        raise HandshakeError(f"{proof.device!r}'s signature over this connection's nonce does not verify: "
                             "it does not hold that device's key, or meant another peer")
    return proof.device
