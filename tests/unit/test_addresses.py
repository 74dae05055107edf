"""The address book: a book that parses is one a peer can dial; anything else names where it breaks."""

from __future__ import annotations

import copy
import json

import pytest

from hetpeer.protocol.addresses import AddressBook, PeerAddress
from hetpeer.protocol.wire import SchemaError

ID_A = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
ID_B = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"
KEY_0, KEY_2, KEY_3 = ("0" * 63 + "1", "ab" * 32, "0123456789abcdef" * 4)  # SHA-256s of link keys


def wire() -> dict:
    return {
        "version": 1,
        "peers": {
            "gpu-0": {"direct": "10.0.0.1:7000", "key": KEY_0, "p2p": [f"/ip4/10.0.0.1/tcp/7001/p2p/{ID_A}",
                                                                         f"/ip4/1.2.3.4/udp/7001/quic/p2p/{ID_A}"]},
            "gpu-1": {"p2p": [f"/ip4/1.2.3.5/tcp/4001/p2p/{ID_B}"]},
            "gpu-2": {"direct": "[::1]:65535", "key": KEY_2},
            "gpu-3": {"direct": "peer.example.org:1", "p2p": [], "key": KEY_3},
        },
    }


def test_round_trip_and_lookups():
    book = AddressBook.from_wire(wire())
    assert book.get("gpu-0") == PeerAddress(
        direct=("10.0.0.1", 7000), p2p=tuple(wire()["peers"]["gpu-0"]["p2p"]), key=KEY_0
    )
    assert book.get("gpu-1").direct is None and book.get("gpu-1").p2p_peer_id == ID_B
    assert book.get("gpu-2").direct == ("::1", 65535)
    assert book.get("gpu-3") == PeerAddress(direct=("peer.example.org", 1), key=KEY_3)
    assert book.keys() == {"gpu-0": KEY_0, "gpu-2": KEY_2, "gpu-3": KEY_3}  # gpu-1 is reached over P2P alone
    assert book.get("gpu-3").p2p_peer_id is None
    with pytest.raises(KeyError, match="gpu-9"):
        book.get("gpu-9")

    again = AddressBook.from_wire(book.to_wire())
    assert again == book
    assert AddressBook.from_wire(json.loads(json.dumps(book.to_wire()))) == book
    assert again.to_wire() == book.to_wire()
    assert list(book.to_wire()["peers"]) == sorted(wire()["peers"])


def test_device_of_p2p_id():
    book = AddressBook.from_wire(wire())
    assert book.device_of_p2p_id(ID_A) == "gpu-0"
    assert book.device_of_p2p_id(ID_B) == "gpu-1"
    assert book.device_of_p2p_id("QmSomeoneElse") is None
    assert book.device_of_p2p_id(ID_A[:-1]) is None  # a prefix is not the id


def test_load_reads_a_file(tmp_path):
    path = tmp_path / "addresses.json"
    path.write_text(json.dumps(wire()))
    assert AddressBook.load(path) == AddressBook.from_wire(wire())
    assert AddressBook.load(str(path)) == AddressBook.from_wire(wire())


def _with(edit) -> dict:
    raw = copy.deepcopy(wire())
    edit(raw)
    return raw


def _peer(record) -> dict:
    return _with(lambda r: r["peers"].update({"x": record}))


BAD = [
    ("not an object", lambda: ["version", 1], "addresses"),
    ("peers not an object", lambda: _with(lambda r: r.update(peers=[])), "addresses.peers"),
    ("entry not an object", lambda: _peer("10.0.0.1:7000"), "addresses.peers.x"),
    ("wrong version", lambda: _with(lambda r: r.update(version=2)), "addresses.version"),
    ("version as a string", lambda: _with(lambda r: r.update(version="1")), "addresses.version"),
    ("version missing", lambda: _with(lambda r: r.pop("version")), "addresses.version"),
    ("peers missing", lambda: _with(lambda r: r.pop("peers")), "addresses.peers"),
    ("extra top-level field", lambda: _with(lambda r: r.update(owner="me")), "addresses.owner"),
    ("extra entry field", lambda: _peer({"direct": "h:1", "tcp": "h:2"}), "addresses.peers.x.tcp"),
    ("no port", lambda: _peer({"direct": "10.0.0.1"}), "addresses.peers.x.direct"),
    ("empty port", lambda: _peer({"direct": "10.0.0.1:"}), "addresses.peers.x.direct"),
    ("no host", lambda: _peer({"direct": ":7000"}), "addresses.peers.x.direct"),
    ("no host inside brackets", lambda: _peer({"direct": "[]:7000"}), "addresses.peers.x.direct"),  # found by fuzzing
    ("port 0", lambda: _peer({"direct": "10.0.0.1:0"}), "addresses.peers.x.direct"),
    ("port 70000", lambda: _peer({"direct": "10.0.0.1:70000"}), "addresses.peers.x.direct"),
    ("port 65536", lambda: _peer({"direct": "10.0.0.1:65536"}), "addresses.peers.x.direct"),
    ("negative port", lambda: _peer({"direct": "10.0.0.1:-1"}), "addresses.peers.x.direct"),
    ("port as text", lambda: _peer({"direct": "10.0.0.1:http"}), "addresses.peers.x.direct"),
    ("port with a space", lambda: _peer({"direct": "10.0.0.1: 80"}), "addresses.peers.x.direct"),
    # str.isdigit() holds for these, but they are not a port: int("²") even raises a bare ValueError.
    ("port in superscript digits", lambda: _peer({"direct": "10.0.0.1:²"}), "addresses.peers.x.direct"),
    ("port in Arabic-Indic digits", lambda: _peer({"direct": "10.0.0.1:٨٠"}), "addresses.peers.x.direct"),
    ("direct as a number", lambda: _peer({"direct": 7000}), "addresses.peers.x.direct"),
    ("p2p not a list", lambda: _peer({"p2p": f"/ip4/1.2.3.4/tcp/1/p2p/{ID_A}"}), "addresses.peers.x.p2p"),
    ("p2p entry not a string", lambda: _peer({"p2p": [7]}), "addresses.peers.x.p2p[0]"),
    ("multiaddr without /p2p/", lambda: _peer({"p2p": ["/ip4/1.2.3.4/tcp/4001"]}), "addresses.peers.x.p2p[0]"),
    ("multiaddr not starting with /", lambda: _peer({"p2p": [f"ip4/1.2.3.4/tcp/1/p2p/{ID_A}"]}),
     "addresses.peers.x.p2p[0]"),
    ("bare peer id", lambda: _peer({"direct": "h:1", "p2p": [ID_A]}), "addresses.peers.x.p2p[0]"),
    ("multiaddr with an empty peer id", lambda: _peer({"p2p": ["/ip4/1.2.3.4/tcp/4001/p2p/"]}),
     "addresses.peers.x.p2p[0]"),
    ("two peer ids in one entry",
     lambda: _peer({"p2p": [f"/ip4/1.2.3.4/tcp/1/p2p/{ID_A}", f"/ip4/1.2.3.4/tcp/2/p2p/{ID_B}"]}),
     "addresses.peers.x.p2p"),
    ("neither address", lambda: _peer({}), "addresses.peers.x"),
    ("neither address, empty p2p", lambda: _peer({"p2p": []}), "addresses.peers.x"),
    ("empty device id", lambda: _with(lambda r: r["peers"].update({"": {"direct": "h:1"}})), "addresses.peers"),
    ("direct address without a link key", lambda: _peer({"direct": "h:1"}), "addresses.peers.x.key"),
    ("link key in capitals", lambda: _peer({"direct": "h:1", "key": KEY_2.upper()}), "addresses.peers.x.key"),
    ("link key cut short", lambda: _peer({"direct": "h:1", "key": KEY_2[:-1]}), "addresses.peers.x.key"),
    ("link key as a number", lambda: _peer({"direct": "h:1", "key": 7}), "addresses.peers.x.key"),
    ("link key with a prefix", lambda: _peer({"direct": "h:1", "key": f"sha256:{KEY_2}"}), "addresses.peers.x.key"),
]


@pytest.mark.parametrize("make, path", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_broken_books_are_refused_with_their_path(make, path):
    with pytest.raises(SchemaError) as caught:
        AddressBook.from_wire(make())
    assert caught.value.path == path
    assert str(caught.value).startswith(f"{path}: ")


def test_error_messages_say_what_is_wrong():
    with pytest.raises(SchemaError, match="HOST:PORT with a port in 1..65535, got '10.0.0.1:70000'"):
        AddressBook.from_wire(_peer({"direct": "10.0.0.1:70000"}))
    with pytest.raises(SchemaError, match="different peer ids"):
        AddressBook.from_wire(_peer({"p2p": [f"/ip4/1.2.3.4/tcp/1/p2p/{ID_A}", f"/ip4/1.2.3.4/tcp/2/p2p/{ID_B}"]}))
    with pytest.raises(SchemaError, match="neither a direct address nor a p2p multiaddr"):
        AddressBook.from_wire(_peer({}))
    with pytest.raises(SchemaError, match="must be 1, got 2"):
        AddressBook.from_wire(_with(lambda r: r.update(version=2)))
    with pytest.raises(SchemaError, match=r"missing: a peer with a direct address proves itself .*`hetpeer key FILE`"):
        AddressBook.from_wire(_peer({"direct": "h:1"}))
    with pytest.raises(SchemaError, match="64 lowercase hex digits"):
        AddressBook.from_wire(_peer({"direct": "h:1", "key": "f" * 65}))


def test_load_of_a_missing_file(tmp_path):
    missing = tmp_path / "nowhere.json"
    with pytest.raises(SchemaError, match=f"cannot read {missing}") as caught:
        AddressBook.load(missing)
    assert caught.value.path == "addresses"


def test_load_of_a_folder(tmp_path):
    with pytest.raises(SchemaError, match="cannot read") as caught:
        AddressBook.load(tmp_path)
    assert caught.value.path == "addresses"


@pytest.mark.parametrize("content", [b"", b"{\"version\": 1,", b"version: 1\n", b"\xff\xfe{}"],
                         ids=["empty", "cut short", "yaml", "not UTF-8"])
def test_load_of_a_file_that_is_not_json(tmp_path, content):
    path = tmp_path / "addresses.json"
    path.write_bytes(content)
    with pytest.raises(SchemaError, match="is not JSON") as caught:
        AddressBook.load(path)
    assert caught.value.path == "addresses"


def test_load_checks_the_schema(tmp_path):
    path = tmp_path / "addresses.json"
    path.write_text(json.dumps(_with(lambda r: r.update(version=3))))
    with pytest.raises(SchemaError) as caught:
        AddressBook.load(path)
    assert caught.value.path == "addresses.version"
