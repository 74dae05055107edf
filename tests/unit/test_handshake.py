"""The direct link's handshake messages: a proof holds only for its key, nonce, verifier and role."""

from __future__ import annotations

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from hetpeer.protocol.handshake import (
    LENGTHS, MAX_DEVICE_BYTES, MAX_KEY_BYTES, HandshakeError, Proof, check, nonce, nonce_of, prove,
)
from hetpeer.protocol.identity import device_id

KEY = RSAPrivateKey()
ME = device_id("alice", KEY.get_public_key().to_bytes())
NONCE = nonce()


def roundtrip(proof: Proof) -> Proof:
    wire = proof.encode()
    return Proof.decode(wire[:LENGTHS.size], wire[LENGTHS.size:])


def test_a_proof_survives_the_wire_and_checks():
    proof = roundtrip(prove(KEY, "dialer", NONCE, ME, "bob-000000000000"))
    assert check(proof, "dialer", NONCE, "bob-000000000000", expected=ME) == ME


@pytest.mark.parametrize("role, nonce, verifier, match", [
    ("listener", NONCE, "bob-000000000000", "does not verify"),  # the other direction
    ("dialer", nonce(), "bob-000000000000", "does not verify"),  # another connection
    ("dialer", NONCE, "carol-000000000000", "does not verify"),  # replayed to another peer
])
def test_a_proof_holds_for_nothing_else(role, nonce, verifier, match):
    proof = prove(KEY, "dialer", NONCE, ME, "bob-000000000000")
    with pytest.raises(HandshakeError, match=match):
        check(proof, role, nonce, verifier)


def test_a_device_id_must_be_bound_to_the_key_that_proves_it():
    other = RSAPrivateKey()
    proof = prove(other, "dialer", NONCE, ME, "bob-000000000000")  # signed fine, but ME is KEY's fingerprint
    with pytest.raises(HandshakeError, match="not bound to the key"):
        check(proof, "dialer", NONCE, "bob-000000000000")


def test_the_expected_device_is_enforced():
    proof = prove(KEY, "listener", NONCE, ME, "bob-000000000000")
    with pytest.raises(HandshakeError, match="not 'dave"):
        check(proof, "listener", NONCE, "bob-000000000000", expected="dave-000000000000")


@pytest.mark.parametrize("lengths", [(0, 10, 10), (MAX_DEVICE_BYTES + 1, 10, 10), (10, MAX_KEY_BYTES + 1, 10), (10, 10, 0), (65535, 65535, 65535)])
def test_declared_lengths_are_bounded_before_reading(lengths):
    with pytest.raises(HandshakeError, match="declares"):
        Proof.body_bytes(LENGTHS.pack(*lengths))


def test_garbage_is_refused_with_a_reason():
    with pytest.raises(HandshakeError, match="link challenge"):
        nonce_of(b"HPF1" + bytes(32))  # a frame, not a challenge
    with pytest.raises(HandshakeError, match="not UTF-8"):
        Proof.decode(LENGTHS.pack(1, 1, 1), b"\xff\x00\x00")
    with pytest.raises(HandshakeError, match="lengths say"):
        Proof.decode(LENGTHS.pack(1, 1, 1), b"ab")
    name = "x-" + "0" * 12
    with pytest.raises(HandshakeError):
        check(Proof(name, b"ssh-rsa AAAAnotakey", b"c2ln"), "dialer", NONCE, "bob")
