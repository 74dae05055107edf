"""Byte-level training data from local text: every lane reads its own reproducible batches.

Tokens are bytes (0..255), so a model needs no tokenizer and a corpus needs no download: a folder of
text files, or by default the Python standard library's own sources, which every machine running a
peer has. A batch is a set of random windows of the byte stream; its offsets come from a generator
seeded by (seed, lane, step), so a restarted lane replays exactly the batches it would have read and
different lanes read different data. Labels are the same windows shifted by one byte.

Loading reads files in sorted path order until `max_bytes` and is linear in the bytes read; a batch of
n sequences of length L costs O(n L).
"""

from __future__ import annotations

import codecs
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np

DEFAULT_MAX_BYTES = 32 * 2**20
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
    """A read-only stream of byte tokens and where it came from."""

    tokens: np.ndarray  # uint8, 1-D
    source: str
    files: int

    def __post_init__(self) -> None:
        if self.tokens.dtype != np.uint8 or self.tokens.ndim != 1:
            raise CorpusError(
                f"corpus tokens must be a 1-D uint8 array, got {self.tokens.dtype} of shape {self.tokens.shape}"
            )
        if self.tokens.size < 2:
            raise CorpusError(
                f"corpus from {self.source} holds {self.tokens.size} bytes; one token and its label need 2"
            )
        view = self.tokens.view()
        view.flags.writeable = False
        object.__setattr__(self, "tokens", view)

    @property
    def size_bytes(self) -> int:
        return int(self.tokens.size)

    @property
    def description(self) -> str:
        return f"{self.size_bytes} bytes from {self.files} files under {self.source}"

    @classmethod
    def from_folder(cls, path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES, min_bytes: int = 2) -> "Corpus":
        """Every UTF-8 text file under `path` (or `path` itself, if a file), folder by folder in sorted order,
        skipping hidden entries, files with NUL bytes and files that are not UTF-8; at most `max_bytes`.
        Pass `min_bytes = seq_len + 1` to fail here rather than at the first batch."""
        root = Path(path)
        if not root.exists():
            raise CorpusError(f"corpus path {str(root)!r} does not exist")
        if root.is_file():
            paths: Iterator[Path] = iter([root])
        elif root.is_dir():
            paths = _walk(root, keep_dir=_visible, keep_file=_visible)
        else:
            raise CorpusError(f"corpus path {str(root)!r} is neither a file nor a folder")
        return cls._read(paths, str(root), max_bytes, min_bytes)

    @classmethod
    def default(cls, max_bytes: int = DEFAULT_MAX_BYTES, min_bytes: int = 2) -> "Corpus":
        """The `.py` sources of this interpreter's standard library, without site-packages and test suites."""
        root = Path(sysconfig.get_paths()["stdlib"])
        if not root.is_dir():
            raise CorpusError(f"the standard library folder {str(root)!r} does not exist")
        paths = _walk(
            root,
            keep_dir=lambda name: name not in _STDLIB_SKIPPED_DIRS and not name.startswith((".", "__pycache__")),
            keep_file=lambda name: name.endswith(".py"),
        )
        return cls._read(paths, str(root), max_bytes, min_bytes)

    @classmethod
    def _read(cls, paths: Iterator[Path], source: str, max_bytes: int, min_bytes: int) -> "Corpus":
        if max_bytes < 2:
            raise CorpusError(f"max_bytes must be at least 2, got {max_bytes}")
        if min_bytes > max_bytes:
            raise CorpusError(f"min_bytes {min_bytes} is more than max_bytes {max_bytes}")
        chunks: list[bytes] = []
        total_bytes = 0
        for file in paths:
            if total_bytes >= max_bytes:
                break
            text = _read_text(file, max_bytes - total_bytes)
            if text:
                chunks.append(text)
                total_bytes += len(text)
        if not chunks:
            raise CorpusError(f"corpus path {source!r} holds no UTF-8 text files")
        if total_bytes < max(min_bytes, 2):
            raise CorpusError(
                f"corpus path {source!r} holds {total_bytes} bytes of text, fewer than the {max(min_bytes, 2)} needed"
            )
        return cls(np.frombuffer(b"".join(chunks), dtype=np.uint8), source, len(chunks))

    def batch(self, lane: int, step: int, sequences: int, seq_len: int, seed: int = 0) -> Batch:
        """`sequences` windows of `seq_len` bytes at offsets drawn by default_rng([seed, lane, step]),
        with the next byte of each as its label."""
        for name, value, least in (("lane", lane, 0), ("step", step, 0), ("seed", seed, 0),
                                   ("sequences", sequences, 1), ("seq_len", seq_len, 1)):
            if value < least:
                raise CorpusError(f"{name} must be at least {least}, got {value}")
        if seq_len + 1 > self.size_bytes:
            raise CorpusError(
                f"seq_len {seq_len} needs {seq_len + 1} bytes with its labels; "
                f"the corpus ({self.description}) has fewer"
            )
        rng = np.random.default_rng([seed, lane, step])
        offsets = rng.integers(0, self.size_bytes - seq_len, size=sequences)
        windows = np.lib.stride_tricks.sliding_window_view(self.tokens, seq_len + 1)[offsets].astype(np.int64)
        return Batch(windows[:, :-1], windows[:, 1:])


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
