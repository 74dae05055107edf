"""Byte corpus: real text with no download, and batches that replay exactly per (seed, lane, step)."""

from __future__ import annotations

import numpy as np
import pytest

from hetpeer.peer.data import Batch, Corpus, CorpusError
from hetpeer.peer.data.corpus import DEFAULT_MAX_BYTES

CYCLE = b"abcdefghij"


@pytest.fixture(scope="module")
def stdlib() -> Corpus:
    return Corpus.default()


@pytest.fixture()
def cyclic(tmp_path) -> Corpus:
    # Every byte's successor is known, so labels can be checked without knowing the offsets.
    (tmp_path / "cycle.txt").write_bytes(CYCLE * 100)
    return Corpus.from_folder(tmp_path)


def test_default_corpus_is_real_text(stdlib):
    assert stdlib.tokens.dtype == np.uint8 and stdlib.tokens.ndim == 1
    assert 1_000_000 <= stdlib.size_bytes <= DEFAULT_MAX_BYTES
    assert stdlib.files > 100
    assert str(stdlib.files) in stdlib.description and stdlib.source in stdlib.description
    assert b"def " in stdlib.tokens[:100_000].tobytes()
    assert not (stdlib.tokens == 0).any()
    with pytest.raises(ValueError):
        stdlib.tokens[0] = 1  # read-only


def test_default_corpus_stops_at_max_bytes():
    corpus = Corpus.default(max_bytes=100_000)
    assert corpus.size_bytes == 100_000
    assert corpus.tokens.tobytes() == Corpus.default().tokens[:100_000].tobytes()


def test_batch_shapes_and_types(stdlib):
    batch = stdlib.batch(lane=0, step=0, sequences=5, seq_len=33)
    tokens, labels = batch
    assert isinstance(batch, Batch)
    assert tokens.shape == labels.shape == (5, 33)
    assert tokens.dtype == labels.dtype == np.int64
    assert tokens.min() >= 0 and tokens.max() <= 255


def test_same_seed_lane_step_replays_the_same_batch(stdlib):
    a = stdlib.batch(lane=2, step=17, sequences=4, seq_len=64, seed=3)
    b = stdlib.batch(lane=2, step=17, sequences=4, seq_len=64, seed=3)
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.labels, b.labels)


@pytest.mark.parametrize("change", [{"lane": 1}, {"step": 1}, {"seed": 1}])
def test_other_lanes_steps_and_seeds_read_other_data(stdlib, change):
    base = {"lane": 0, "step": 0, "seed": 0}
    a = stdlib.batch(sequences=4, seq_len=64, **base)
    b = stdlib.batch(sequences=4, seq_len=64, **{**base, **change})
    assert not np.array_equal(a.tokens, b.tokens)


def test_labels_are_the_next_bytes(cyclic, stdlib):
    tokens, labels = cyclic.batch(lane=0, step=0, sequences=8, seq_len=25)
    successor = {CYCLE[i]: CYCLE[(i + 1) % len(CYCLE)] for i in range(len(CYCLE))}
    assert np.array_equal(labels, np.vectorize(successor.get)(tokens))
    tokens, labels = stdlib.batch(lane=1, step=5, sequences=8, seq_len=40)
    assert np.array_equal(tokens[:, 1:], labels[:, :-1])
    text = stdlib.tokens.tobytes()
    for row_tokens, row_labels in zip(tokens, labels):
        assert bytes(row_tokens.tolist()) + bytes(row_labels[-1:].tolist()) in text


def test_a_corpus_just_long_enough_gives_its_one_window(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"hello")
    tokens, labels = Corpus.from_folder(tmp_path).batch(lane=0, step=0, sequences=3, seq_len=4)
    assert (tokens == np.frombuffer(b"hell", np.uint8)).all() and (labels == np.frombuffer(b"ello", np.uint8)).all()


def test_split_into_micro_batches(stdlib):
    batch = stdlib.batch(lane=0, step=0, sequences=6, seq_len=16)
    parts = batch.split([1, 3, 2])
    assert [part.tokens.shape[0] for part in parts] == [1, 3, 2]
    assert np.array_equal(np.concatenate([part.tokens for part in parts]), batch.tokens)
    assert np.array_equal(np.concatenate([part.labels for part in parts]), batch.labels)
    for sizes in ([2, 2], [3, 3, 1], [6, 0], [7, -1]):
        with pytest.raises(CorpusError, match=str(sizes).replace("[", r"\[").replace("]", r"\]")):
            batch.split(sizes)


def test_folder_corpus_reads_text_in_sorted_order_and_skips_the_rest(tmp_path):
    (tmp_path / "b.txt").write_text("second file\n")
    (tmp_path / "a.txt").write_text("first file: caf\u00e9\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_text("# third\n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("hidden\n")
    (tmp_path / ".hidden.txt").write_text("hidden\n")
    (tmp_path / "image.bin").write_bytes(b"GIF89a\x00\x01\x02")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9".encode("latin-1"))
    corpus = Corpus.from_folder(tmp_path)
    assert corpus.tokens.tobytes() == "first file: caf\u00e9\nsecond file\n# third\n".encode()
    assert corpus.files == 3
    assert str(tmp_path) in corpus.description


def test_a_single_file_is_a_corpus(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("just this one file\n")
    corpus = Corpus.from_folder(path)
    assert corpus.tokens.tobytes() == b"just this one file\n" and corpus.files == 1


def test_max_bytes_cuts_inside_a_file(tmp_path):
    (tmp_path / "a.txt").write_text("0123456789")
    (tmp_path / "b.txt").write_text("abcdefghij")
    corpus = Corpus.from_folder(tmp_path, max_bytes=14)
    assert corpus.tokens.tobytes() == b"0123456789abcd" and corpus.files == 2


def test_folder_errors_name_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(CorpusError, match="nowhere.*does not exist"):
        Corpus.from_folder(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CorpusError, match="empty.*no UTF-8 text"):
        Corpus.from_folder(empty)
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "x.dat").write_bytes(b"\x00\x01\x02")
    with pytest.raises(CorpusError, match="binary.*no UTF-8 text"):
        Corpus.from_folder(binary)
    short = tmp_path / "short"
    short.mkdir()
    (short / "a.txt").write_text("tiny")
    with pytest.raises(CorpusError, match="short.*4 bytes.*65"):
        Corpus.from_folder(short, min_bytes=65)
    with pytest.raises(CorpusError, match="max_bytes"):
        Corpus.from_folder(short, max_bytes=1)
    assert issubclass(CorpusError, ValueError)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"lane": -1}, "lane.*-1"),
        ({"step": -2}, "step.*-2"),
        ({"seed": -3}, "seed.*-3"),
        ({"sequences": 0}, "sequences.*0"),
        ({"seq_len": 0}, "seq_len.*0"),
        ({"seq_len": 1000}, "seq_len 1000 needs 1001 bytes"),
    ],
)
def test_bad_batch_arguments(cyclic, kwargs, words):
    args = {"lane": 0, "step": 0, "sequences": 2, "seq_len": 8, "seed": 0, **kwargs}
    with pytest.raises(CorpusError, match=words):
        cyclic.batch(**args)


def test_corpus_rejects_arrays_that_are_not_bytes():
    with pytest.raises(CorpusError, match="int64"):
        Corpus(np.zeros(10, dtype=np.int64), "memory", 1)
    with pytest.raises(CorpusError, match="1 bytes"):
        Corpus(np.zeros(1, dtype=np.uint8), "memory", 1)
