"""Reading documents out of corpus files: `.jsonl` lines (plain, gzip or zstd), Parquet row groups and the Arrow
stream files of a dataset's `save_to_disk`, each a "text" string. Shared by the in-memory corpus (`corpus.py`) and
`prepare.py`; a record that is not what its file's kind says is a CorpusError naming the file and the line (or
the byte offset, in a part of a file read from the middle)."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path
from typing import Iterator

from hetpeer.peer.data.errors import CorpusError


def parquet_file(path: Path):
    """A pyarrow ParquetFile (its metadata read, no row yet)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CorpusError(f"{path}: .parquet files need the pyarrow package: pip install hetpeer[hf]") from None
    try:
        return pq.ParquetFile(str(path))
    except Exception as error:  # pyarrow's ArrowInvalid for a file that is not Parquet
        raise CorpusError(f"{path} is not a Parquet file ({error})") from None


def parquet_text(path: Path, row_groups: range | None = None) -> Iterator[tuple[bytes, bool]]:
    """The "text" of row groups `row_groups` (default: all), a batch of rows in memory at a time."""
    parquet = parquet_file(path)
    if "text" not in parquet.schema_arrow.names:
        raise CorpusError(f"{path} has no \"text\" column (columns: {', '.join(parquet.schema_arrow.names)})")
    groups = range(parquet.num_row_groups) if row_groups is None else row_groups
    for batch in parquet.iter_batches(batch_size=1024, row_groups=groups, columns=["text"]):
        yield from column_text(batch.column("text").to_pylist(), path)


def lines(handle: io.BufferedReader, start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of the lines that begin in bytes [start, end): a line belongs to the part its first byte is in."""
    if start > 0:
        handle.seek(start - 1)
        handle.readline()  # the rest of the line that began before `start`
    offset = handle.tell()
    while offset < end:
        line = handle.readline()
        if not line:
            return
        yield offset, line
        offset += len(line)


def json_text(line: bytes, where: str) -> Iterator[tuple[bytes, bool]]:
    """The document of one .jsonl line, as (UTF-8 text, True: it ends its document); nothing for a blank line."""
    if not line.strip():
        return
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        raise CorpusError(f"{where} is not a JSON object: a .jsonl file holds one a line") from None
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise CorpusError(f"{where} has no \"text\" string")
    yield text.encode("utf-8"), True


def column_text(values: list, path: Path) -> Iterator[tuple[bytes, bool]]:
    for text in values:
        if not isinstance(text, str):
            raise CorpusError(f"{path}: a \"text\" value is {type(text).__name__}, not a string")
        yield text.encode("utf-8"), True


def arrow_text(path: Path) -> Iterator[tuple[bytes, bool]]:
    import pyarrow as pa

    try:
        reader = pa.ipc.open_stream(pa.memory_map(str(path)))
    except Exception as error:  # pyarrow's ArrowInvalid
        raise CorpusError(f"{path} is not an Arrow stream file (a dataset's save_to_disk writes them) ({error})") from None
    if "text" not in reader.schema.names:
        raise CorpusError(f"{path} has no \"text\" column (columns: {', '.join(reader.schema.names)})")
    for batch in reader:
        yield from column_text(batch.column("text").to_pylist(), path)


def decompressed(path: Path, kind: str):
    if kind == "jsonl.gz":
        return gzip.open(path, "rb")
    try:
        import zstandard
    except ImportError:
        raise CorpusError(f"{path}: .zst files need the zstandard package: pip install hetpeer[hf]") from None
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(path.open("rb"), closefd=True))


