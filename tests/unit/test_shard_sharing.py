"""Shards from other peers, in one process over MemoryTransport: a joiner takes what its group holds, checks it,
rejects a peer that sends a changed shard and falls back to the next source; requests are screened."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hetpeer.peer.data import fetch, sharing
from hetpeer.peer.data.fetch import DataFetchError, ShardStore
from hetpeer.peer.data.prepare import Settings, prepare
from hetpeer.peer.data.shards import ShardedCorpus
from hetpeer.peer.data.sharing import ShardServer, dataset_tag, from_peers
from hetpeer.peer.transport import MemoryHub, MemoryTransport
from hetpeer.protocol.dataset import read_folder
from hetpeer.protocol.frame import FrameHeader

SEQ = 16


@pytest.fixture()
def swarm(tmp_path):
    texts = [f"{i:04d} " + "shard sharing " * (2 + i % 9) + "\n" for i in range(300)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepare([tmp_path / "d.jsonl"], tmp_path / "p", Settings(None, shard_tokens=2048, validation=0.0), workers=1,
            say=lambda _: None)
    manifest, name = read_folder(tmp_path / "p")
    hub = MemoryHub()
    peers = {}
    for device in ("holder", "joiner", "other"):
        transport = MemoryTransport(device, hub)
        transport.start()
        server = ShardServer(transport, device, known=lambda d: d in ("holder", "joiner", "other"))
        transport.set_policy(server.accept)
        transport.headers = []  # every frame delivered to it, refused or not

        def recording(header, payload, authenticated=None, deliver=transport.deliver, seen=transport.headers):
            seen.append(header)
            return deliver(header, payload, authenticated)

        transport.deliver = recording
        peers[device] = (transport, server)
    holder_store = ShardStore(manifest, name, local=tmp_path / "p")
    for shard in manifest.train:
        holder_store.path(shard)  # read once, so held (checked)
    peers["holder"][1].offer(holder_store)
    yield manifest, name, peers, tmp_path
    for transport, _ in peers.values():
        transport.shutdown()


def frames_to(peers, device: str) -> list[FrameHeader]:
    return peers[device][0].headers


def joiner_store(manifest, name, peers, tmp_path, url="http://127.0.0.1:9/nowhere/") -> ShardStore:
    store = ShardStore(manifest, name, url=url, cache_folder=tmp_path / "cache", cache_bytes=10**9)
    store.peers = from_peers(peers["joiner"][1], store, lambda: ["other", "holder"], timeout_s=10.0)
    return store


def test_a_joiner_reads_the_whole_dataset_from_its_group(swarm, monkeypatch):
    monkeypatch.setattr(sharing, "CHUNK_BYTES", 1000)  # several chunks a shard: a peer without it is asked for one
    manifest, name, peers, tmp_path = swarm
    store = joiner_store(manifest, name, peers, tmp_path)
    data = ShardedCorpus(store, "peers")
    local = ShardedCorpus(ShardStore(manifest, name, local=tmp_path / "p"), "local")
    try:
        for position in range(0, data.windows(SEQ), 32):
            assert np.array_equal(data.batch(position, 32, SEQ).tokens, local.batch(position, 32, SEQ).tokens)
    finally:
        data.close()
    total = sum(manifest.shard_bytes(s) for s in data.train)  # (prepared without validation: the last shard is held out)
    assert store.from_peers_bytes == total and store.downloaded_bytes == 0  # "other" holds nothing: "holder" served
    assert not peers["joiner"][0].inbox.rejections and not peers["joiner"][0].inbox.misbehaving
    asked_other = [h for h in frames_to(peers, "other") if h.kind == "shard_request"]
    assert len(asked_other) == len(data.train)  # the first chunk of each shard, and nothing more


def test_a_changed_shard_from_a_peer_is_rejected_and_the_url_is_next(swarm, monkeypatch):
    monkeypatch.setattr(fetch, "TRIES", 1)
    manifest, name, peers, tmp_path = swarm
    victim = tmp_path / "p" / manifest.train[0].file
    victim.write_bytes(bytes(b ^ 1 for b in victim.read_bytes()))  # changed after the holder checked it
    store = joiner_store(manifest, name, peers, tmp_path)
    with pytest.raises(DataFetchError, match="127.0.0.1:9"):  # then the URL, which is down here
        store.path(manifest.train[0])
    store.close()
    rejected = peers["joiner"][0].inbox.rejections
    assert rejected and rejected[0][0] == "holder" and "does not match the manifest's sha256" in rejected[0][1]
    assert not (tmp_path / "cache" / manifest.train[0].file).exists()


def test_requests_are_screened(swarm):
    manifest, name, peers, _ = swarm
    server = peers["holder"][1]
    header = lambda **kw: FrameHeader(**{"kind": "shard_request", "dtype": "int64", "shape": (4,), "sender": "joiner",
                                         "step": 1, "micro": 0, **kw})
    assert server.accept(header()) is None
    assert "not a known peer" in server.accept(header(sender="stranger"))
    assert "four int64" in server.accept(header(shape=(3,)))
    assert "was not asked of" in server.accept(header(kind="shard", dtype="uint8", shape=(10,)))
    # a request past the shard's end is refused and counted, nothing is sent
    transport = peers["holder"][0]
    server.serve(header(), torch.tensor([dataset_tag(name), 0, 0, manifest.shard_bytes(manifest.train[0]) + 1]))
    assert transport.inbox.rejections and "outside it" in transport.inbox.rejections[-1][1]
    assert sharing.CHUNK_BYTES <= 4 << 20  # a chunk stays far under the frame limit
