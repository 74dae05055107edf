"""`hetpeer data prepare`: a corpus tokenized once into shards of token ids and a manifest (`manifest.py`).

Inputs are files and folders: UTF-8 text files (each one document), `.jsonl`, `.jsonl.gz` and `.jsonl.zst`
(a "text" string a line), `.parquet` (a "text" column) and Hugging Face dataset folders (`save_to_disk`:
Arrow stream files listed by its state.json; a DatasetDict's "train" split). They are cut into parts of
about `PART_BYTES` (text and .jsonl at line boundaries, Parquet at row groups; a compressed file is one
part) that a pool of processes tokenizes, one per core: each writes its part's shards and then a record
of them under progress/, so an interrupted run (Ctrl+C) goes on where it stopped, redoing only the parts
with no record (a part whose input changed since is redone too). A worker holds one shard's tokens and one
batch of text at a time, so memory stays bounded whatever the input size; the whole run is linear in it.

Each document is followed by the end-of-text id (for bytes: 0, which text files never hold). A document
goes to validation when the first 8 bytes of its BLAKE2b hash, as a fraction of 2^64, fall under the
validation share: the choice depends on the document alone, not on the parts, the workers or the order.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from hetpeer.peer.data.corpus import CorpusError, load_tokenizer
from hetpeer.peer.data.documents import arrow_text, decompressed, json_text, lines, parquet_file, parquet_text
from hetpeer.protocol.dataset import MANIFEST, Manifest, Shard

PART_BYTES = 64 * 2**20
ENCODE_BYTES = 1 << 20  # text a tokenizer encodes at once
ENCODE_DOCUMENTS = 256
PIECE_BYTES = 1 << 20  # a long text file is encoded in pieces of about this, cut at line ends
EOT_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")
BYTES_EOT = 0
COMPRESSED = (".jsonl.gz", ".jsonl.zst")


class PrepareError(CorpusError):
    """Inputs or settings that cannot be prepared, named."""


@dataclass(frozen=True, slots=True)
class Settings:
    tokenizer: Path | None  # None: bytes
    shard_tokens: int = 4 * 2**20  # 8 MiB of uint16 ids (`hetpeer data prepare --shard-mb`)
    validation: float = 0.01
    eot: str | None = None  # the end-of-text token's text; None: found among EOT_CANDIDATES

    def __post_init__(self) -> None:
        if not 0 <= self.validation < 0.5:
            raise PrepareError(f"the validation share must be in [0, 0.5), got {self.validation}")
        if self.shard_tokens < 1024:
            raise PrepareError(f"shards must hold at least 1024 tokens, got {self.shard_tokens}")


@dataclass(frozen=True, slots=True)
class Part:
    """A piece of one input: bytes [start, end) of a text or .jsonl file, row groups [start, end) of a Parquet
    file, or all of a compressed or Arrow file (start = end = 0)."""

    index: int
    path: str
    kind: str  # text, jsonl, jsonl.gz, jsonl.zst, parquet, arrow
    start: int
    end: int
    size: int  # of the whole file
    mtime_ns: int
    bytes: int  # about how much text it holds, for progress

    @property
    def key(self) -> list:
        return [self.path, self.kind, self.start, self.end, self.size, self.mtime_ns]


@dataclass(frozen=True, slots=True)
class Tokens:
    """What a tokenizer gives: its vocabulary, end-of-text id, the dtype that holds its ids, and its identity."""

    vocab: int
    eot: int
    dtype: str
    name: str
    sha256: str


def prepare(inputs: list[Path], out: Path, settings: Settings, workers: int | None = None,
            say: Callable[[str], None] = print) -> tuple[Manifest, str]:
    """Prepare `inputs` into `out`; returns the manifest and its name (sha256). Says progress through `say`."""
    tokens = describe_tokenizer(settings)
    parts, skipped = plan_parts(inputs)
    if not parts:
        raise PrepareError(f"no text to prepare in {', '.join(map(str, inputs))}" + (f" ({skipped} skipped)" if skipped else ""))
    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST).exists():
        (out / MANIFEST).unlink()  # it names shards this run may replace: written again at the end
    setting_key = [tokens.sha256, settings.shard_tokens, settings.validation, tokens.eot]
    done = _records(out, parts, setting_key)
    _remove_stale(out, done)
    if settings.tokenizer is not None:
        shutil.copyfile(_tokenizer_file(settings.tokenizer), out / "tokenizer.json")
    todo = [p for p in parts if p.index not in done]
    total_bytes = sum(p.bytes for p in parts)
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1))
    say(f"prepare: {len(parts)} parts ({total_bytes / 1e9:.2f} GB of input) from {len(inputs)} input(s)"
        + (f", {skipped} file(s) skipped (not text)" if skipped else "")
        + (f"; {len(done)} done before, going on" if done else "") + f"; {workers} worker process(es)")
    started, last_said, read_bytes = time.perf_counter(), 0.0, 0
    if todo:
        if workers == 1:  # no pool to start: the parts in this process, one after another
            _start_worker(settings, tokens, str(out), setting_key, in_process=True)
            records = map(_prepare_part, todo)
        else:
            context = multiprocessing.get_context("spawn")  # safe in a peer process with threads running, where fork is not
            pool = context.Pool(workers, initializer=_start_worker, initargs=(settings, tokens, str(out), setting_key))
            records = pool.imap_unordered(_prepare_part, todo)
        try:
            for record in records:
                done[record["part"]] = record
                read_bytes += record["input_bytes"]
                now = time.perf_counter()
                if now - last_said >= 2.0 or len(done) == len(parts):
                    rate = read_bytes / max(now - started, 1e-9)
                    left = sum(p.bytes for p in parts if p.index not in done)
                    say(f"prepare: {len(done)}/{len(parts)} parts, {_gb(total_bytes - left)} of {_gb(total_bytes)} "
                        f"({rate / 1e6:.1f} MB/s), {sum(r['tokens'] for r in done.values()):,} tokens"
                        + (f", about {left / rate:.0f} s left" if left and rate > 0 and now - started > 10 else ""))
                    last_said = now
        finally:
            if workers > 1:
                pool.terminate()  # done, or interrupted: parts cut short leave no record and are redone next time
                pool.join()
    manifest = _manifest(done, parts, tokens)
    if not manifest.train:
        raise PrepareError(f"every document of {', '.join(map(str, inputs))} went to validation: lower --validation or give more")
    raw = manifest.to_bytes()
    temporary = out / f".{MANIFEST}.tmp"
    temporary.write_bytes(raw)
    os.replace(temporary, out / MANIFEST)
    return manifest, hashlib.sha256(raw).hexdigest()


def describe_tokenizer(settings: Settings) -> Tokens:
    if settings.tokenizer is None:
        if settings.eot is not None:
            raise PrepareError("--eot names a token of a tokenizer; bytes end documents with 0")
        return Tokens(256, BYTES_EOT, "uint8", "bytes", "")
    file = _tokenizer_file(settings.tokenizer)
    tokenizer = load_tokenizer(file)
    vocab = tokenizer.get_vocab_size()
    wanted = (settings.eot,) if settings.eot is not None else EOT_CANDIDATES
    eot = next((tokenizer.token_to_id(t) for t in wanted if tokenizer.token_to_id(t) is not None), None)
    if eot is None:
        raise PrepareError(f"{file} has no end-of-text token ({'tried ' + ', '.join(wanted)}): name one with --eot")
    dtype = "uint8" if vocab <= 2**8 else "uint16" if vocab <= 2**16 else "uint32"
    return Tokens(vocab, eot, dtype, "tokenizer.json", hashlib.sha256(file.read_bytes()).hexdigest())


def _tokenizer_file(path: Path) -> Path:
    return path / "tokenizer.json" if path.is_dir() else path


# -- parts ------------------------------------------------------------------------------------------
def plan_parts(inputs: list[Path]) -> tuple[list[Part], int]:
    """Every input's parts in a fixed order (inputs as given, folders sorted), and how many files were skipped."""
    files: list[tuple[Path, str]] = []
    skipped = 0
    for root in inputs:
        if not root.exists():
            raise PrepareError(f"input {str(root)!r} does not exist")
        if root.is_dir() and ((root / "state.json").is_file() or (root / "dataset_dict.json").is_file()):
            files += [(path, "arrow") for path in _arrow_files(root)]
        elif root.is_dir():
            for folder, dirs, names in os.walk(root):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(n for n in names if not n.startswith(".")):
                    kind = _kind(Path(folder, name))
                    if kind is None:
                        skipped += 1
                    else:
                        files.append((Path(folder, name), kind))
        else:
            kind = _kind(root)
            if kind is None:
                raise PrepareError(f"input {root} is not text (it holds NUL bytes or is not UTF-8)")
            files.append((root, kind))
    parts: list[Part] = []
    for path, kind in files:
        stat = path.stat()
        if stat.st_size == 0:
            continue
        for start, end, size in _cuts(path, kind, stat.st_size):
            parts.append(Part(len(parts), str(path.resolve()), kind, start, end, stat.st_size, stat.st_mtime_ns, size))
    return parts, skipped


def _kind(path: Path) -> str | None:
    name = path.name
    for suffix in COMPRESSED:
        if name.endswith(suffix):
            return suffix[1:]
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".arrow"):
        return "arrow"
    try:
        with path.open("rb") as handle:
            head = handle.read(65536)
    except OSError:
        return None
    if b"\0" in head:
        return None
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as error:
        if error.start < len(head) - 4:  # a character cut at the end of the sample is fine
            return None
    return "text"


def _cuts(path: Path, kind: str, size: int) -> list[tuple[int, int, int]]:
    """(start, end, about how many bytes) of each part of one file."""
    if kind in ("text", "jsonl"):
        return [(a, min(a + PART_BYTES, size), min(a + PART_BYTES, size) - a) for a in range(0, max(size, 1), PART_BYTES)]
    if kind == "parquet":
        parquet = parquet_file(path)
        cuts, start, held = [], 0, 0
        for group in range(parquet.num_row_groups):
            held += parquet.metadata.row_group(group).total_byte_size
            if held >= PART_BYTES or group == parquet.num_row_groups - 1:
                cuts.append((start, group + 1, held))
                start, held = group + 1, 0
        return cuts
    return [(0, 0, size)]


def _arrow_files(root: Path) -> list[Path]:
    """The Arrow files of a `save_to_disk` folder: its state.json's data files, or a DatasetDict's train split's."""
    if (root / "dataset_dict.json").is_file():
        if not (root / "train" / "state.json").is_file():
            raise PrepareError(f"{root} is a DatasetDict without a train split: give the folder of the split to prepare")
        root = root / "train"
    try:
        state = json.loads((root / "state.json").read_text())
        files = [root / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise PrepareError(f"{root / 'state.json'} does not list a dataset's data files ({error})") from None
    for file in files:
        if file.parent != root or not file.is_file():
            raise PrepareError(f"{root / 'state.json'} names {file.name}, which is not a file in {root}")
    return files


# -- one part, in a worker process ---------------------------------------------------------------------
_WORKER: dict[str, Any] = {}  # the worker process's tokenizer and settings, set once by the pool's initializer


def _start_worker(settings: Settings, tokens: Tokens, out: str, setting_key: list, in_process: bool = False) -> None:
    if not in_process:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the parent's to handle: it stops the pool
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process a core already uses every core
    encoder = None if settings.tokenizer is None else load_tokenizer(_tokenizer_file(settings.tokenizer))
    _WORKER.update(settings=settings, tokens=tokens, out=Path(out), encoder=encoder, setting_key=setting_key)


def _prepare_part(part: Part) -> dict[str, Any]:
    settings, tokens, out = _WORKER["settings"], _WORKER["tokens"], _WORKER["out"]
    writers = {split: _ShardWriter(out, split, part.index, np.dtype(tokens.dtype), settings.shard_tokens)
               for split in ("train", "validation")}
    documents = 0
    batch: list[bytes] = []
    batch_bytes = 0
    for document, ends in _documents(part):
        batch.append((document, ends))
        batch_bytes += len(document)
        if batch_bytes >= ENCODE_BYTES or len(batch) >= ENCODE_DOCUMENTS:
            documents += _encode_into(batch, writers, tokens, settings.validation)
            batch, batch_bytes = [], 0
    documents += _encode_into(batch, writers, tokens, settings.validation)
    record = {"part": part.index, "key": part.key, "settings": _WORKER["setting_key"], "documents": documents,
              "input_bytes": part.bytes, "text_bytes": sum(w.text_bytes for w in writers.values()),
              **{split: writer.close() for split, writer in writers.items()}}
    record["tokens"] = sum(s["tokens"] for s in record["train"]) + sum(s["tokens"] for s in record["validation"])
    path = out / "progress" / f"{part.index:06d}.json"
    path.parent.mkdir(exist_ok=True)
    path.with_suffix(".tmp").write_text(json.dumps(record))
    os.replace(path.with_suffix(".tmp"), path)
    return record


def _encode_into(batch: list[tuple[bytes, bool]], writers: dict, tokens: Tokens, share: float) -> int:
    """Encode a batch of (text, whether it ends its document); returns the documents it ended."""
    if not batch:
        return 0
    encoder = _WORKER["encoder"]
    if encoder is None:
        ids = [np.frombuffer(text, dtype=np.uint8) for text, _ in batch]
    else:
        encoded = encoder.encode_batch([text.decode("utf-8", errors="replace") for text, _ in batch], add_special_tokens=False)
        ids = [np.asarray(e.ids, dtype=tokens.dtype) for e in encoded]
    ended = 0
    for (text, ends), part_ids in zip(batch, ids):
        split = "validation" if share and _held_out(text, share) else "train"
        writers[split].add(part_ids, len(text))
        if ends:
            writers[split].add(np.asarray([tokens.eot], dtype=tokens.dtype), 0)
            ended += 1
    return ended


def _held_out(text: bytes, share: float) -> bool:
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") < share * 2**64


class _ShardWriter:
    """Tokens of one split of one part, written as shards of about `shard_tokens` each."""

    def __init__(self, out: Path, split: str, part: int, dtype: np.dtype, shard_tokens: int) -> None:
        self.out, self.split, self.part, self.dtype, self.shard_tokens = out, split, part, dtype, shard_tokens
        self.held: list[np.ndarray] = []
        self.count = 0
        self.text_bytes = 0
        self.shards: list[dict[str, Any]] = []

    def add(self, ids: np.ndarray, text_bytes: int) -> None:
        self.held.append(ids)
        self.count += ids.size
        self.text_bytes += text_bytes
        if self.count >= self.shard_tokens:
            self._write()

    def close(self) -> list[dict[str, Any]]:
        if self.count:
            self._write()
        return self.shards

    def _write(self) -> None:
        data = np.concatenate(self.held).astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
        file = f"{self.split}/{self.part:06d}-{len(self.shards):05d}.bin"
        path = self.out / file
        path.parent.mkdir(exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_bytes(data)
        os.replace(temporary, path)
        self.shards.append({"file": file, "tokens": self.count, "sha256": hashlib.sha256(data).hexdigest()})
        self.held, self.count = [], 0


def _documents(part: Part) -> Iterator[tuple[bytes, bool]]:
    """(text, whether it ends its document) of one part, in order; long text comes in pieces."""
    path = Path(part.path)
    if part.kind == "text":
        yield from _text_pieces(path, part)
    elif part.kind == "jsonl":
        with path.open("rb") as handle:  # lines are numbered in a file's first part; later parts say byte offsets
            for number, (offset, line) in enumerate(lines(handle, part.start, part.end), 1):
                yield from json_text(line, f"{path}:{number}" if part.start == 0 else f"{path} at byte {offset}")
    elif part.kind in ("jsonl.gz", "jsonl.zst"):
        with decompressed(path, part.kind) as handle:
            for number, line in enumerate(handle, 1):
                yield from json_text(line, f"{path}:{number}")
    elif part.kind == "parquet":
        yield from parquet_text(path, range(part.start, part.end))
    else:
        yield from arrow_text(path)


def _text_pieces(path: Path, part: Part) -> Iterator[tuple[bytes, bool]]:
    piece: list[bytes] = []
    held = 0
    with path.open("rb") as handle:
        for _, line in lines(handle, part.start, part.end):
            piece.append(line)
            held += len(line)
            if held >= PIECE_BYTES:
                yield b"".join(piece), False
                piece, held = [], 0
    text = b"".join(piece)
    if text or part.end == part.size:
        yield text, part.end == part.size  # a file's last part ends its document


# -- records and the manifest -----------------------------------------------------------------------------
def _records(out: Path, parts: list[Part], setting_key: list) -> dict[int, dict[str, Any]]:
    """The parts an earlier run finished with these inputs and settings, by index."""
    done = {}
    for part in parts:
        path = out / "progress" / f"{part.index:06d}.json"
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if record.get("key") == part.key and record.get("settings") == setting_key:
            done[part.index] = record
    return done


def _remove_stale(out: Path, done: dict[int, dict[str, Any]]) -> None:
    """Delete shards and records that no finished part of this run lists: a part cut short, or other inputs'."""
    kept = {s["file"] for r in done.values() for split in ("train", "validation") for s in r[split]}
    for split in ("train", "validation"):
        for path in (out / split).glob("*") if (out / split).is_dir() else ():
            if f"{split}/{path.name}" not in kept:
                path.unlink()
    for path in (out / "progress").glob("*") if (out / "progress").is_dir() else ():
        if path.suffix != ".json" or not path.stem.isdigit() or int(path.stem) not in done:
            path.unlink()


def _manifest(done: dict[int, dict[str, Any]], parts: list[Part], tokens: Tokens) -> Manifest:
    records = [done[p.index] for p in parts]
    shards = lambda split: tuple(Shard(s["file"], s["tokens"], s["sha256"]) for r in records for s in r[split])
    return Manifest(tokens.name, tokens.sha256, tokens.vocab, tokens.eot, tokens.dtype, shards("train"), shards("validation"),
                    sum(r["documents"] for r in records), sum(r["text_bytes"] for r in records))


def _gb(size: float) -> str:
    return f"{size / 1e9:.2f} GB"
