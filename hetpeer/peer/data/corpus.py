"""Training data from local files, held in memory: every lane reads its own reproducible batches.

Without a tokenizer, tokens are bytes (0..255), so a model needs no tokenizer and a corpus needs no
download: a folder of text files, or by default the Python standard library's own sources, which every
machine running a peer has. With a tokenizer (a `tokenizers` tokenizer.json), documents become its token
ids. Documents come from text files, from `.jsonl` files (one JSON object a line, its `"text"` string)
and from `.parquet` files (a `"text"` column, read one row group at a time). The training part is cut
into windows of seq_len + 1 tokens, and `batch(position, n, seq_len)` reads positions [position, position + n)
of the swarm's order over them (`order.py`: each window once an epoch, shuffled), so a restarted lane
replays exactly the batches it would have read and different lanes read different data. Labels are the
same windows shifted by one token. The last hundredth of the stream is held out: training
windows never reach into it, and validation windows (`validation_batch`, the same ones every time and
for every lane, so that validation losses compare across lanes, plans and runs) lie wholly inside it.

Loading reads files in sorted path order and is linear in what it reads; a folder with more than
`max_bytes` of text is CorpusTooLarge, never cut (`source.open_data` prepares it into shards instead),
and the default corpus stops at `max_bytes` (the rest is never opened). A batch of n sequences of length
L costs O(n L).
"""

from __future__ import annotations

import codecs
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np

from hetpeer.peer.data.documents import json_text, lines, parquet_text
from hetpeer.peer.data.errors import CorpusError, CorpusTooLarge
from hetpeer.peer.data.order import WindowOrder

DEFAULT_MAX_BYTES = 32 * 2**20
TOKEN_DTYPES = (np.uint8, np.uint16, np.uint32)
VALIDATION_SHARE = 0.01  # the end of the token stream held out for validation
ENCODE_BATCH = 256  # documents a tokenizer encodes at once
# Subtrees of the standard library that are not its own source: installed packages and test suites.
_STDLIB_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests"})


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
    _orders: dict = field(default_factory=dict, repr=False)  # (seq_len, seed) -> its WindowOrder

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
    def from_folder(cls, path: str | os.PathLike, max_bytes: int | None = None, min_tokens: int = 2,
                    tokenizer: Any = None) -> "Corpus":
        """Every document under `path` (or in `path` itself, if a file), folder by folder in sorted order:
        UTF-8 text files (hidden entries, files with NUL bytes and files that are not UTF-8 are skipped),
        `.jsonl` and `.parquet` files (whose every record must hold a "text" string: a file that is not what
        its suffix says is an error naming it); more than `max_bytes` of text (default DEFAULT_MAX_BYTES) is
        CorpusTooLarge. `tokenizer` (`load_tokenizer`)
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
        return cls._read(paths, str(root), DEFAULT_MAX_BYTES if max_bytes is None else max_bytes, min_tokens, tokenizer, whole=True)

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
    def _read(cls, paths: Iterator[Path], source: str, max_bytes: int, min_tokens: int, tokenizer: Any,
              whole: bool = False) -> "Corpus":
        """Documents up to `max_bytes` of text; with `whole`, CorpusTooLarge when there is that much (never cut)."""
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
                    if whole:
                        raise CorpusTooLarge(f"{source} holds more than {max_bytes} bytes of text")
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

    def batch(self, position: int, sequences: int, seq_len: int, seed: int = 0) -> Batch:
        """The windows at positions [position, position + sequences) of the swarm's order (`order.py`) over the
        training part's windows of `seq_len` + 1 tokens, with the next token of each as its label."""
        for name, value, least in (("position", position, 0), ("seed", seed, 0), ("sequences", sequences, 1),
                                   ("seq_len", seq_len, 1)):
            if value < least:
                raise CorpusError(f"{name} must be at least {least}, got {value}")
        if seq_len + 1 > self.size_bytes:
            raise CorpusError(
                f"seq_len {seq_len} needs {seq_len + 1} tokens with its labels; "
                f"the corpus ({self.description}) has fewer"
            )
        if seq_len + 1 > self.train_end:
            raise CorpusError(f"seq_len {seq_len} needs {seq_len + 1} tokens; the corpus's training part has {self.train_end}")
        key = (seq_len, seed)
        if key not in self._orders:
            self._orders[key] = WindowOrder([(self.train_end - 1) // seq_len], seed)
        _, windows = self._orders[key].locate(np.arange(position, position + sequences))
        return self._windows(windows * seq_len, seq_len)

    def close(self) -> None:
        """Nothing to release (a prepared corpus's `close` stops its downloads)."""

    def windows(self, seq_len: int) -> int:
        """Training windows of `seq_len` + 1 tokens: one epoch of the swarm's order."""
        return max(0, (self.train_end - 1) // seq_len)

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
            for number, (_, line) in enumerate(lines(handle, 0, path.stat().st_size), 1):
                for text, _ in json_text(line, f"{path}:{number}"):
                    yield text
    except OSError as error:
        raise CorpusError(f"cannot read {path}: {error.strerror or error}") from None


def _parquet(path: Path) -> Iterator[bytes]:
    for text, _ in parquet_text(path):
        yield text


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
