"""Training data from local files: every lane reads its own reproducible batches.

Without a tokenizer, tokens are bytes (0..255), so a model needs no tokenizer and a corpus needs no
download: a folder of text files, or by default the Python standard library's own sources, which every
machine running a peer has. With a tokenizer (a `tokenizers` tokenizer.json), documents become its token
ids. Documents come from text files, from `.jsonl` files (one JSON object a line, its `"text"` string)
and from `.parquet` files (a `"text"` column, read one row group at a time). A batch is a set of
random windows of the token stream; its offsets come from a generator seeded by (seed, lane, step), so a
restarted lane replays exactly the batches it would have read and different lanes read different data.
Labels are the same windows shifted by one token. The last hundredth of the stream is held out: training
windows never reach into it, and validation windows (`validation_batch`, the same ones every time and
for every lane, so that validation losses compare across lanes, plans and runs) lie wholly inside it.

Loading reads files in sorted path order until `max_bytes` of text and is linear in what it reads (the
rest of a large dataset is never opened); a batch of n sequences of length L costs O(n L).
"""

from __future__ import annotations

import codecs
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np

DEFAULT_MAX_BYTES = 32 * 2**20
TOKEN_DTYPES = (np.uint8, np.uint16, np.uint32)
VALIDATION_SHARE = 0.01  # the end of the token stream held out for validation
ENCODE_BATCH = 256  # documents a tokenizer encodes at once
# Subtrees of the standard library that are not its own source: installed packages and test suites.
_STDLIB_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests"})


class CorpusError(ValueError):
    """A corpus path or a batch request that cannot give training data."""


class Batch(NamedTuple):
    """Token ids and their next-byte labels, both int64 of shape (sequences, seq_len)."""

    tokens: np.ndarray
    labels: np.ndarray

    def split(self, sizes: Sequence[int]) -> tuple["Batch", ...]:
        """Consecutive micro-batches of `sizes` rows each; the sizes must cover every row exactly."""
        rows = self.tokens.shape[0]
        if any(size < 1 for size in sizes) or sum(sizes) != rows:
            raise CorpusError(f"micro-batch sizes {list(sizes)} must be positive and sum to the batch's {rows} rows")
        bounds = np.cumsum([0, *sizes])
        return tuple(Batch(self.tokens[a:b], self.labels[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))


@dataclass(frozen=True, slots=True, eq=False)
class Corpus:
    """A read-only stream of tokens and where it came from."""

    tokens: np.ndarray  # 1-D: uint8 bytes, or a tokenizer's ids as uint16 / uint32
    source: str
    files: int
    vocab: int = 256  # the ids are below this: 256 bytes, or the tokenizer's vocabulary

    def __post_init__(self) -> None:
        if self.tokens.dtype not in TOKEN_DTYPES or self.tokens.ndim != 1:
            raise CorpusError(
                f"corpus tokens must be a 1-D uint8, uint16 or uint32 array, got {self.tokens.dtype} of shape {self.tokens.shape}"
            )
        if self.tokens.size < 2:
            raise CorpusError(
                f"corpus from {self.source} holds {self.tokens.size} tokens; one token and its label need 2"
            )
        view = self.tokens.view()
        view.flags.writeable = False
        object.__setattr__(self, "tokens", view)

    @property
    def size_bytes(self) -> int:
        return int(self.tokens.size)

    @property
    def train_end(self) -> int:
        """Training windows lie in tokens [0, train_end); the rest is held out."""
        return self.size_bytes - int(self.size_bytes * VALIDATION_SHARE)

    @property
    def description(self) -> str:
        unit = "bytes" if self.tokens.dtype == np.uint8 else f"tokens (vocabulary {self.vocab})"
        return f"{self.tokens.size} {unit} from {self.files} files under {self.source}"

    @classmethod
    def from_folder(cls, path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES, min_tokens: int = 2,
                    tokenizer: Any = None) -> "Corpus":
        """Every document under `path` (or in `path` itself, if a file), folder by folder in sorted order:
        UTF-8 text files (hidden entries, files with NUL bytes and files that are not UTF-8 are skipped),
        `.jsonl` and `.parquet` files (whose every record must hold a "text" string: a file that is not what
        its suffix says is an error naming it); at most `max_bytes` of text. `tokenizer` (`load_tokenizer`)
        turns each document into its ids; without one the tokens are its bytes. Pass `min_tokens = seq_len +
        1` to fail here rather than at the first batch."""
        root = Path(path)
        if not root.exists():
            raise CorpusError(f"corpus path {str(root)!r} does not exist")
        if root.is_file():
            paths: Iterator[Path] = iter([root])
        elif root.is_dir():
            paths = _walk(root, keep_dir=_visible, keep_file=_visible)
        else:
            raise CorpusError(f"corpus path {str(root)!r} is neither a file nor a folder")
        return cls._read(paths, str(root), max_bytes, min_tokens, tokenizer)

    @classmethod
    def default(cls, max_bytes: int = DEFAULT_MAX_BYTES, min_tokens: int = 2, tokenizer: Any = None) -> "Corpus":
        """The `.py` sources of this interpreter's standard library, without site-packages and test suites."""
        root = Path(sysconfig.get_paths()["stdlib"])
        if not root.is_dir():
            raise CorpusError(f"the standard library folder {str(root)!r} does not exist")
        paths = _walk(
            root,
            keep_dir=lambda name: name not in _STDLIB_SKIPPED_DIRS and not name.startswith((".", "__pycache__")),
            keep_file=lambda name: name.endswith(".py"),
        )
        return cls._read(paths, str(root), max_bytes, min_tokens, tokenizer)

    @classmethod
    def _read(cls, paths: Iterator[Path], source: str, max_bytes: int, min_tokens: int, tokenizer: Any) -> "Corpus":
        if max_bytes < 2:
            raise CorpusError(f"max_bytes must be at least 2, got {max_bytes}")
        if tokenizer is None and min_tokens > max_bytes:
            raise CorpusError(f"min_tokens {min_tokens} is more than max_bytes {max_bytes}")
        documents: list[bytes] = []
        files = total_bytes = 0
        for file in paths:
            if total_bytes >= max_bytes:
                break
            found = False
            for text in _documents(file, max_bytes - total_bytes):
                documents.append(text)
                total_bytes += len(text)
                found = True
                if total_bytes >= max_bytes:
                    break
            files += found
        if not documents:
            raise CorpusError(f"corpus path {source!r} holds no UTF-8 text files")
        if tokenizer is None:
            tokens, vocab = np.frombuffer(b"".join(documents), dtype=np.uint8), 256
        else:
            tokens, vocab = _encode(tokenizer, documents), tokenizer.get_vocab_size()
        if tokens.size < max(min_tokens, 2):
            unit = "bytes of text" if tokenizer is None else "tokens"
            raise CorpusError(
                f"corpus path {source!r} holds {tokens.size} {unit}, fewer than the {max(min_tokens, 2)} needed"
            )
        return cls(tokens, source, files, vocab)

    def batch(self, lane: int, step: int, sequences: int, seq_len: int, seed: int = 0) -> Batch:
        """`sequences` windows of `seq_len` bytes at offsets drawn by default_rng([seed, lane, step]),
        with the next byte of each as its label."""
        for name, value, least in (("lane", lane, 0), ("step", step, 0), ("seed", seed, 0),
                                   ("sequences", sequences, 1), ("seq_len", seq_len, 1)):
            if value < least:
                raise CorpusError(f"{name} must be at least {least}, got {value}")
        if seq_len + 1 > self.size_bytes:
            raise CorpusError(
                f"seq_len {seq_len} needs {seq_len + 1} tokens with its labels; "
                f"the corpus ({self.description}) has fewer"
            )
        if seq_len + 1 > self.train_end:
            raise CorpusError(f"seq_len {seq_len} needs {seq_len + 1} tokens; the corpus's training part has {self.train_end}")
        rng = np.random.default_rng([seed, lane, step])
        return self._windows(rng.integers(0, self.train_end - seq_len, size=sequences), seq_len)

    def validation_batch(self, sequences: int, seq_len: int, seed: int = 0) -> Batch:
        """`sequences` windows of the held-out part, the same every time (offsets drawn by
        default_rng([seed, 0, 0, 1]), a stream no training batch uses)."""
        held_out = self.size_bytes - self.train_end
        if seq_len + 1 > held_out:
            raise CorpusError(f"validation needs {seq_len + 1} held-out tokens a sequence; the corpus ({self.description}) "
                              f"holds out {held_out}: give more data")
        if seed < 0 or sequences < 1:
            raise CorpusError(f"seed must be at least 0 and sequences at least 1, got {seed}, {sequences}")
        rng = np.random.default_rng([seed, 0, 0, 1])
        return self._windows(rng.integers(self.train_end, self.size_bytes - seq_len, size=sequences), seq_len)

    def _windows(self, offsets: np.ndarray, seq_len: int) -> Batch:
        windows = np.lib.stride_tricks.sliding_window_view(self.tokens, seq_len + 1)[offsets].astype(np.int64)
        return Batch(windows[:, :-1], windows[:, 1:])


def open_corpus(data: str | None, tokenizer: str | None, vocab: int, seq_len: int) -> Corpus:
    """The corpus a peer trains on: `data` (default: the standard library's sources), tokenized by the
    tokenizer.json at `tokenizer` (default: bytes), checked against the model's vocabulary."""
    loaded = None
    if tokenizer is not None:
        loaded = load_tokenizer(tokenizer)
        if loaded.get_vocab_size() > vocab:
            raise CorpusError(f"tokenizer {tokenizer} has {loaded.get_vocab_size()} tokens, more than the model's "
                              f"vocabulary of {vocab}")
    elif vocab < 256:
        raise CorpusError(f"the model's vocabulary of {vocab} cannot hold bytes: give a tokenizer (--tokenizer)")
    if data:
        return Corpus.from_folder(data, min_tokens=seq_len + 1, tokenizer=loaded)
    return Corpus.default(min_tokens=seq_len + 1, tokenizer=loaded)


def load_tokenizer(path: str | os.PathLike) -> Any:
    """A `tokenizers` tokenizer from a tokenizer.json file (or a model folder holding one)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise CorpusError("a tokenizer needs the tokenizers package: pip install hetpeer[hf]") from None
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise CorpusError(f"no tokenizer at {file}")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as error:  # tokenizers raises its own Exception for a file it cannot parse
        raise CorpusError(f"{file} is not a tokenizer.json ({error})") from None


def _encode(tokenizer: Any, documents: list[bytes]) -> np.ndarray:
    vocab = tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    parts = []
    for i in range(0, len(documents), ENCODE_BATCH):
        texts = [d.decode("utf-8", errors="replace") for d in documents[i : i + ENCODE_BATCH]]
        parts += [np.asarray(e.ids, dtype=dtype) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _documents(path: Path, limit_bytes: int) -> Iterator[bytes]:
    """The documents of one file, as UTF-8 bytes, up to about `limit_bytes`: a text file is one document."""
    if path.suffix == ".jsonl":
        yield from _jsonl(path)
    elif path.suffix == ".parquet":
        yield from _parquet(path)
    else:
        text = _read_text(path, limit_bytes)
        if text:
            yield text


def _jsonl(path: Path) -> Iterator[bytes]:
    try:
        with path.open("rb") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (ValueError, UnicodeDecodeError):
                    raise CorpusError(f"{path}:{number} is not a JSON object: a .jsonl file holds one a line") from None
                text = record.get("text") if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise CorpusError(f"{path}:{number} has no \"text\" string")
                yield text.encode("utf-8")
    except OSError as error:
        raise CorpusError(f"cannot read {path}: {error.strerror or error}") from None


def _parquet(path: Path) -> Iterator[bytes]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CorpusError(f"{path}: .parquet files need the pyarrow package: pip install hetpeer[hf]") from None
    try:
        table = pq.ParquetFile(str(path))
    except Exception as error:  # pyarrow's ArrowInvalid for a file that is not Parquet
        raise CorpusError(f"{path} is not a Parquet file ({error})") from None
    if "text" not in table.schema_arrow.names:
        raise CorpusError(f"{path} has no \"text\" column (columns: {', '.join(table.schema_arrow.names)})")
    for group in range(table.num_row_groups):  # one row group in memory at a time
        for text in table.read_row_group(group, columns=["text"]).column("text").to_pylist():
            if not isinstance(text, str):
                raise CorpusError(f"{path}: a \"text\" value is {type(text).__name__}, not a string")
            yield text.encode("utf-8")


def _visible(name: str) -> bool:
    return not name.startswith(".")


def _walk(root: Path, keep_dir: Callable[[str], bool], keep_file: Callable[[str], bool]) -> Iterator[Path]:
    """Files under `root`, folder by folder in sorted order; folder links are not followed, so no cycles."""
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(name for name in dirs if keep_dir(name))
        for name in sorted(names):
            path = Path(folder, name)
            if keep_file(name) and path.is_file():
                yield path


def _read_text(path: Path, limit_bytes: int) -> bytes:
    """Up to `limit_bytes` of the file, or nothing if it is not NUL-free UTF-8 (a cut character at the
    limit is fine: tokens are bytes)."""
    try:
        with path.open("rb") as handle:
            data = handle.read(limit_bytes)
    except OSError:
        return b""
    if b"\0" in data:
        return b""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=len(data) < limit_bytes)
    except UnicodeDecodeError:
        return b""
    return data
