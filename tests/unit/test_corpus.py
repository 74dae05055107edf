"""The corpus: real text with no download, documents from .jsonl and .parquet files, a tokenizer's ids, and
batches that replay exactly per (seed, position) and visit every window once an epoch."""

from __future__ import annotations

import json
from pathlib import Path

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
    batch = stdlib.batch(position=0, sequences=5, seq_len=33)
    tokens, labels = batch
    assert isinstance(batch, Batch)
    assert tokens.shape == labels.shape == (5, 33)
    assert tokens.dtype == labels.dtype == np.int64
    assert tokens.min() >= 0 and tokens.max() <= 255


def test_same_seed_and_position_replay_the_same_batch(stdlib):
    a = stdlib.batch(position=170, sequences=4, seq_len=64, seed=3)
    b = stdlib.batch(position=170, sequences=4, seq_len=64, seed=3)
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.labels, b.labels)


@pytest.mark.parametrize("change", [{"position": 4}, {"seed": 1}])
def test_other_positions_and_seeds_read_other_data(stdlib, change):
    base = {"position": 0, "seed": 0}
    a = stdlib.batch(sequences=4, seq_len=64, **base)
    b = stdlib.batch(sequences=4, seq_len=64, **{**base, **change})
    assert not np.array_equal(a.tokens, b.tokens)


def test_labels_are_the_next_bytes(cyclic, stdlib):
    tokens, labels = cyclic.batch(position=0, sequences=8, seq_len=25)
    successor = {CYCLE[i]: CYCLE[(i + 1) % len(CYCLE)] for i in range(len(CYCLE))}
    assert np.array_equal(labels, np.vectorize(successor.get)(tokens))
    tokens, labels = stdlib.batch(position=48, sequences=8, seq_len=40)
    assert np.array_equal(tokens[:, 1:], labels[:, :-1])
    text = stdlib.tokens.tobytes()
    for row_tokens, row_labels in zip(tokens, labels):
        assert bytes(row_tokens.tolist()) + bytes(row_labels[-1:].tolist()) in text


def test_a_corpus_just_long_enough_gives_its_one_window(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"hello")
    tokens, labels = Corpus.from_folder(tmp_path).batch(position=0, sequences=3, seq_len=4)
    assert (tokens == np.frombuffer(b"hell", np.uint8)).all() and (labels == np.frombuffer(b"ello", np.uint8)).all()


def test_split_into_micro_batches(stdlib):
    batch = stdlib.batch(position=0, sequences=6, seq_len=16)
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


def test_a_folder_past_max_bytes_is_never_cut():
    from hetpeer.peer.data.corpus import CorpusTooLarge

    with pytest.raises(CorpusTooLarge, match="more than 100000 bytes"):
        Corpus.from_folder(Path(Corpus.default(max_bytes=2).source) / "email", max_bytes=100_000)


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
        Corpus.from_folder(short, min_tokens=65)
    with pytest.raises(CorpusError, match="max_bytes"):
        Corpus.from_folder(short, max_bytes=1)
    assert issubclass(CorpusError, ValueError)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"position": -1}, "position.*-1"),
        ({"seed": -3}, "seed.*-3"),
        ({"sequences": 0}, "sequences.*0"),
        ({"seq_len": 0}, "seq_len.*0"),
        ({"seq_len": 1000}, "seq_len 1000 needs 1001 tokens"),
    ],
)
def test_bad_batch_arguments(cyclic, kwargs, words):
    args = {"position": 0, "sequences": 2, "seq_len": 8, "seed": 0, **kwargs}
    with pytest.raises(CorpusError, match=words):
        cyclic.batch(**args)


def test_corpus_rejects_arrays_that_are_not_bytes():
    with pytest.raises(CorpusError, match="int64"):
        Corpus(np.zeros(10, dtype=np.int64), "memory", 1)
    with pytest.raises(CorpusError, match="holds 1 tokens"):
        Corpus(np.zeros(1, dtype=np.uint8), "memory", 1)


# -- documents from .jsonl and .parquet files, and a tokenizer --------------------------------------------


def bpe_tokenizer(tmp_path: Path, texts: list[str], vocab: int = 300) -> Path:
    """A byte-level BPE tokenizer trained on the fly (nothing downloaded), saved as tokenizer.json."""
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path


DOCS = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog. " * 3, "ünïcödé text\n"]


def write_parquet(path: Path, texts: list, column: str = "text", row_group_size: int = 2) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: texts}), str(path), row_group_size=row_group_size)


def test_jsonl_and_parquet_documents_in_sorted_order(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(DOCS[:2])) + "\n")
    write_parquet(tmp_path / "b.parquet", [DOCS[2], DOCS[0]])
    (tmp_path / "c.txt").write_text(DOCS[1])
    corpus = Corpus.from_folder(tmp_path)
    assert corpus.tokens.tobytes() == "".join([DOCS[0], DOCS[1], DOCS[2], DOCS[0], DOCS[1]]).encode()
    assert corpus.files == 3 and corpus.vocab == 256


def test_a_tokenizer_turns_documents_into_its_ids(tmp_path):
    path = bpe_tokenizer(tmp_path, DOCS * 20)
    from hetpeer.peer.data.corpus import load_tokenizer

    tokenizer = load_tokenizer(path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS * 10))
    corpus = Corpus.from_folder(tmp_path / "data", tokenizer=tokenizer)
    expected = [i for t in DOCS * 10 for i in tokenizer.encode(t, add_special_tokens=False).ids]
    assert corpus.tokens.dtype == np.uint16 and corpus.tokens.tolist() == expected
    assert corpus.vocab == tokenizer.get_vocab_size() and corpus.tokens.size < len("".join(DOCS * 10).encode())
    assert f"tokens (vocabulary {corpus.vocab})" in corpus.description
    first = corpus.batch(position=6, sequences=2, seq_len=8)
    np.testing.assert_array_equal(first.tokens, corpus.batch(position=6, sequences=2, seq_len=8).tokens)
    np.testing.assert_array_equal(first.labels[:, :-1], first.tokens[:, 1:])
    assert first.tokens.dtype == np.int64 and int(first.tokens.max()) < corpus.vocab


def test_reading_stops_at_max_bytes_without_opening_the_rest(tmp_path):
    from hetpeer.peer.data.corpus import CorpusTooLarge

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": "x" * 100}) + "\n" for _ in range(10)))
    (tmp_path / "b.parquet").write_bytes(b"never opened: not a parquet file")
    with pytest.raises(CorpusTooLarge):  # the parquet file's error would come first, had it been opened
        Corpus.from_folder(tmp_path, max_bytes=250)


@pytest.mark.parametrize(
    "name, content, words",
    [
        ("bad.jsonl", '{"text": "ok"}\n{not json\n', ["bad.jsonl:2", "not a JSON object"]),
        ("bad.jsonl", '{"text": "ok"}\n{"body": "no text"}\n', ["bad.jsonl:2", "no \"text\" string"]),
        ("bad.jsonl", '["a list"]\n', ["bad.jsonl:1", "no \"text\" string"]),
        ("bad.parquet", "this is not parquet", ["bad.parquet is not a Parquet file"]),
    ],
)
def test_a_file_that_is_not_what_its_suffix_says_is_named(tmp_path, name, content, words):
    (tmp_path / name).write_text(content)
    with pytest.raises(CorpusError) as error:
        Corpus.from_folder(tmp_path)
    for word in words:
        assert word in str(error.value)


def test_parquet_without_a_text_column_is_named(tmp_path):
    write_parquet(tmp_path / "d.parquet", ["a", "b"], column="content")
    with pytest.raises(CorpusError, match=r"d.parquet has no \"text\" column \(columns: content\)"):
        Corpus.from_folder(tmp_path)


def test_a_tokenizer_that_does_not_fit_the_model_is_refused(tmp_path):
    from hetpeer.peer.data.source import open_data as open_corpus

    path = bpe_tokenizer(tmp_path, DOCS * 20, vocab=300)
    (tmp_path / "t.txt").write_text("".join(DOCS) * 50)
    with pytest.raises(CorpusError, match=r"has 300 tokens, more than the model's vocabulary of 256"):
        open_corpus(str(tmp_path / "t.txt"), str(path), vocab=256, seq_len=8)
    assert open_corpus(str(tmp_path / "t.txt"), str(path), vocab=512, seq_len=8).vocab == 300
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(CorpusError, match="junk.json is not a tokenizer.json"):
        open_corpus(None, str(tmp_path / "junk.json"), vocab=512, seq_len=8)
    with pytest.raises(CorpusError, match="cannot hold bytes"):
        open_corpus(None, None, vocab=100, seq_len=8)


def test_held_out_windows_never_meet_training_windows():
    """Token i is i, so a window's first token is its offset: training windows end before the held-out last
    hundredth, validation windows lie inside it and are the same each time (and for every lane)."""
    corpus = Corpus(np.arange(20_000, dtype=np.uint32), "positions", 1, vocab=20_000)
    assert corpus.train_end == 19_800
    seq = 16
    firsts = corpus.batch(0, 4 * 19_800 // seq, seq).tokens[:, 0]  # four epochs
    assert firsts.max() + seq < corpus.train_end  # its label too: the last token a training window reads
    held = corpus.validation_batch(64, seq)
    assert held.tokens[:, 0].min() >= corpus.train_end and held.labels[:, -1].max() < 20_000
    np.testing.assert_array_equal(held.tokens, corpus.validation_batch(64, seq).tokens)
    assert not np.array_equal(held.tokens, corpus.validation_batch(64, seq, seed=1).tokens)
    with pytest.raises(CorpusError, match="validation needs 201 held-out tokens a sequence"):
        corpus.validation_batch(1, 200)


def test_an_epoch_reads_every_training_window_once_in_a_shuffled_order():
    corpus = Corpus(np.arange(20_000, dtype=np.uint32), "positions", 1, vocab=20_000)
    seq = 16
    windows = corpus.windows(seq)
    assert windows == (19_800 - 1) // seq
    firsts = np.concatenate([corpus.batch(p, 7, seq).tokens[:, 0] for p in range(0, windows, 7)])[:windows]
    assert sorted(firsts.tolist()) == list(range(0, windows * seq, seq))  # each window once: starts at multiples of seq
    assert not np.array_equal(firsts, np.sort(firsts))  # shuffled
    second = corpus.batch(windows, windows, seq).tokens[:, 0]
    assert sorted(second.tolist()) == sorted(firsts.tolist()) and not np.array_equal(second, firsts)  # another order
