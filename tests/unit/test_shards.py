"""A prepared corpus read from its folder: windows from memory-mapped shards in the swarm's order, validation from
its own shards, damage refused, and local text too large to hold in memory prepared once instead of cut."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hetpeer.peer.data import corpus as corpora
from hetpeer.peer.data import shards as sharding
from hetpeer.peer.data.corpus import CorpusError
from hetpeer.peer.data.fetch import DataFetchError, ShardStore
from hetpeer.peer.data.prepare import Settings, prepare
from hetpeer.peer.data.shards import ShardedCorpus
from hetpeer.peer.data.source import DataCache, open_data
from hetpeer.protocol.dataset import read_folder
from hetpeer.protocol.plan import Dataset

SEQ = 16


@pytest.fixture()
def prepared(tmp_path) -> Path:
    texts = [f"{i:04d} " + "abcdefghij" * (3 + i % 11) + "\n" for i in range(400)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepare([tmp_path / "d.jsonl"], tmp_path / "p", Settings(None, shard_tokens=1024, validation=0.1), workers=1,
            say=lambda _: None)
    return tmp_path / "p"


def test_an_epoch_reads_every_window_of_every_shard_once(prepared):
    manifest, name = read_folder(prepared)
    data = ShardedCorpus(ShardStore(manifest, name, local=prepared), str(prepared))
    tokens = [np.fromfile(prepared / s.file, dtype=np.uint8) for s in manifest.train]
    expected = sorted(bytes(t[w * SEQ : w * SEQ + SEQ + 1]) for t in tokens for w in range((t.size - 1) // SEQ))
    assert data.windows(SEQ) == len(expected) and len(manifest.train) > 8
    rows = []
    for position in range(0, data.windows(SEQ), 5):
        batch = data.batch(position, 5, SEQ)
        assert np.array_equal(batch.tokens[:, 1:], batch.labels[:, :-1]) and batch.tokens.dtype == np.int64
        rows += [bytes(np.concatenate([t, l[-1:]]).astype(np.uint8)) for t, l in zip(batch.tokens, batch.labels)]
    assert sorted(rows[: len(expected)]) == expected  # each window once, every one
    assert len(data._files) <= sharding.OPEN_SHARDS  # the files of shards read long ago are closed
    assert data.train == manifest.train and data.held_out == manifest.validation
    held = data.validation_batch(4, SEQ)
    again = data.validation_batch(4, SEQ)
    assert np.array_equal(held.tokens, again.tokens)
    validation = b"".join((prepared / s.file).read_bytes() for s in manifest.validation)
    assert all(bytes(row.astype(np.uint8)) in validation for row in held.tokens)


def test_a_damaged_shard_is_refused_by_name(prepared):
    manifest, name = read_folder(prepared)
    damaged = prepared / manifest.train[0].file
    damaged.write_bytes(bytes(b ^ 1 for b in damaged.read_bytes()))
    data = ShardedCorpus(ShardStore(manifest, name, local=prepared), str(prepared))
    with pytest.raises(DataFetchError, match=f"{manifest.train[0].file}.*sha256"):
        data.batch(0, data.windows(SEQ), SEQ)


def test_open_data_takes_a_prepared_folder_checks_it_and_refuses_another_plans(prepared, tmp_path):
    data = open_data(str(prepared), None, vocab=256, seq_len=SEQ)
    assert isinstance(data, ShardedCorpus) and "training bytes" in data.description
    with pytest.raises(CorpusError, match="more than the model's vocabulary of 100"):
        open_data(str(prepared), None, vocab=100, seq_len=SEQ)
    other = Dataset("0" * 64)
    with pytest.raises(CorpusError, match="plan's dataset is 0000.*gives no URL"):
        open_data(str(prepared), None, vocab=256, seq_len=SEQ, dataset=other, cache=DataCache(tmp_path / "cache"))
    with pytest.raises(CorpusError, match="not in a local --data folder"):
        open_data(None, None, vocab=256, seq_len=SEQ, dataset=other, cache=DataCache(tmp_path / "cache"))
    (prepared / "manifest.json").write_text("{}")
    with pytest.raises(CorpusError, match="not a hetpeer shard manifest"):
        open_data(str(prepared), None, vocab=256, seq_len=SEQ)


def test_local_text_past_what_memory_holds_is_prepared_once_not_cut(tmp_path, monkeypatch):
    monkeypatch.setattr(corpora, "DEFAULT_MAX_BYTES", 50_000)
    folder = tmp_path / "text"
    folder.mkdir()
    for i in range(6):
        (folder / f"{i}.txt").write_text(f"file {i} " + "the quick brown fox " * 1000)
    said = []
    cache = DataCache(tmp_path / "cache")
    data = open_data(str(folder), None, vocab=256, seq_len=SEQ, cache=cache, say=said.append)
    assert isinstance(data, ShardedCorpus) and any("preparing it once" in line for line in said)
    assert data.manifest.documents == 6 and data.manifest.text_bytes > 50_000  # all of it: nothing cut
    said.clear()
    again = open_data(str(folder), None, vocab=256, seq_len=SEQ, cache=cache, say=said.append)
    assert again.store.name == data.store.name and not said  # prepared once
    small = tmp_path / "small"
    small.mkdir()
    (small / "a.txt").write_text("short text " * 100)
    assert isinstance(open_data(str(small), None, vocab=256, seq_len=SEQ, cache=cache), corpora.Corpus)


def test_a_corpus_prepared_without_validation_holds_out_its_last_shard(prepared, tmp_path):
    text = (prepared.parent / "d.jsonl")
    prepare([text], tmp_path / "none", Settings(None, shard_tokens=1024, validation=0.0), workers=1, say=lambda _: None)
    manifest, name = read_folder(tmp_path / "none")
    data = ShardedCorpus(ShardStore(manifest, name, local=tmp_path / "none"), "none")
    assert not manifest.validation and data.held_out == manifest.train[-1:] and data.train == manifest.train[:-1]
    last = (tmp_path / "none" / manifest.train[-1].file).read_bytes()
    assert all(bytes(row.astype(np.uint8)) in last for row in data.validation_batch(4, SEQ).tokens)
    read = data.batch(0, data.windows(SEQ), SEQ).tokens
    assert data.windows(SEQ) == sum((s.tokens - 1) // SEQ for s in manifest.train[:-1]) and read.shape[0] == data.windows(SEQ)
