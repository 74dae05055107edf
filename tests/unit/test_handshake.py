"""The direct link's handshake messages: a proof holds only for its key, nonce, verifier, role and the
connection's X25519 keys; both ends derive the same pair of session keys, nobody else can."""

from __future__ import annotations

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from hetpeer.protocol.handshake import (
    LENGTHS, MAX_DEVICE_BYTES, MAX_KEY_BYTES, Ephemeral, HandshakeError, Proof, challenge, check, nonce, prove,
    read_challenge, session_keys,
)
from hetpeer.protocol.identity import device_id

KEY = RSAPrivateKey()
ME = device_id("alice", KEY.get_public_key().to_bytes())
NONCE = nonce()
KEYS = Ephemeral().public + Ephemeral().public


def roundtrip(proof: Proof) -> Proof:
    wire = proof.encode()
    return Proof.decode(wire[:LENGTHS.size], wire[LENGTHS.size:])


def test_a_proof_survives_the_wire_and_checks():
    proof = roundtrip(prove(KEY, "dialer", NONCE, ME, "bob-000000000000", KEYS))
    assert check(proof, "dialer", NONCE, "bob-000000000000", KEYS, expected=ME) == ME


@pytest.mark.parametrize("role, nonce, verifier, keys", [
    ("listener", NONCE, "bob-000000000000", KEYS),  # the other direction
    ("dialer", nonce(), "bob-000000000000", KEYS),  # another connection
    ("dialer", NONCE, "carol-000000000000", KEYS),  # replayed to another peer
    ("dialer", NONCE, "bob-000000000000", KEYS[:32] + Ephemeral().public),  # a key swapped by someone between
])
def test_a_proof_holds_for_nothing_else(role, nonce, verifier, keys):
    proof = prove(KEY, "dialer", NONCE, ME, "bob-000000000000", KEYS)
    with pytest.raises(HandshakeError, match="does not verify"):
        check(proof, role, nonce, verifier, keys)


def test_both_ends_derive_the_same_session_keys_and_a_third_party_cannot():
    dialer, listener, stranger = Ephemeral(), Ephemeral(), Ephemeral()
    mine, theirs = nonce(), nonce()
    ours = session_keys(dialer.secret(listener.public), mine, theirs, "a", "b")
    assert ours == session_keys(listener.secret(dialer.public), mine, theirs, "a", "b")
    assert ours[0] != ours[1] and len(ours[0]) == 32
    assert session_keys(stranger.secret(listener.public), mine, theirs, "a", "b") != ours
    assert session_keys(dialer.secret(listener.public), mine, theirs, "a", "c") != ours
    with pytest.raises(HandshakeError, match="unusable"):
        dialer.secret(bytes(32))  # a low-order point: no secret


def test_a_device_id_must_be_bound_to_the_key_that_proves_it():
    other = RSAPrivateKey()
    proof = prove(other, "dialer", NONCE, ME, "bob-000000000000", KEYS)  # signed fine, but ME is KEY's fingerprint
    with pytest.raises(HandshakeError, match="not bound to the key"):
        check(proof, "dialer", NONCE, "bob-000000000000", KEYS)


def test_the_expected_device_is_enforced():
    proof = prove(KEY, "listener", NONCE, ME, "bob-000000000000", KEYS)
    with pytest.raises(HandshakeError, match="not 'dave"):
        check(proof, "listener", NONCE, "bob-000000000000", KEYS, expected="dave-000000000000")


@pytest.mark.parametrize("lengths", [(0, 10, 10), (MAX_DEVICE_BYTES + 1, 10, 10), (10, MAX_KEY_BYTES + 1, 10), (10, 10, 0), (65535, 65535, 65535)])
def test_declared_lengths_are_bounded_before_reading(lengths):
    with pytest.raises(HandshakeError, match="declares"):
        Proof.body_bytes(LENGTHS.pack(*lengths))


def test_garbage_is_refused_with_a_reason():
    with pytest.raises(HandshakeError, match="link challenge"):
        read_challenge(b"HPF1" + bytes(64))  # a frame, not a challenge
    with pytest.raises(HandshakeError, match="link challenge"):
        read_challenge(b"HPA1" + bytes(32))  # the previous version's
    assert read_challenge(challenge(NONCE, KEYS[:32])) == (NONCE, KEYS[:32])
    with pytest.raises(HandshakeError, match="not UTF-8"):
        Proof.decode(LENGTHS.pack(1, 1, 1), b"\xff\x00\x00")
    with pytest.raises(HandshakeError, match="lengths say"):
        Proof.decode(LENGTHS.pack(1, 1, 1), b"ab")
    name = "x-" + "0" * 12
    with pytest.raises(HandshakeError):
        check(Proof(name, b"ssh-rsa AAAAnotakey", b"c2ln"), "dialer", NONCE, "bob", KEYS)
