"""A prepared corpus's manifest: what `hetpeer data prepare` writes, a coordinator serves and every peer checks
its shards against.

A prepared folder holds `manifest.json` and its shards, `train/UNIT-PART.bin` and `validation/UNIT-PART.bin`:
flat arrays of token ids (little-endian, the manifest's dtype: uint8 for bytes, uint16 up to 65,536 ids,
else uint32), documents separated by the end-of-text id. The manifest's wire form:

    {"format": "hetpeer-shards", "version": 1,
     "tokenizer": {"name": "bytes" | "tokenizer.json", "sha256": str | "", "vocab": int, "eot": int},
     "dtype": "uint8" | "uint16" | "uint32",
     "train": [{"file": "train/000000-00000.bin", "tokens": int, "sha256": str}, ...],
     "validation": [same],
     "documents": int, "text_bytes": int}

A dataset is named by the sha256 of its manifest.json's bytes: a plan names it so, and a peer that fetched
a manifest checks it against that name before it believes one shard size or checksum in it. File names
are checked against a strict pattern (no path leaves the folder).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "hetpeer-shards"
VERSION = 1
MANIFEST = "manifest.json"
DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}
MAX_SHARD_BYTES = 2**30  # a peer downloads no larger file
MAX_MANIFEST_BYTES = 64 * 2**20  # a million shards' entries
_FILE = re.compile(r"^(train|validation)/[0-9]{6,9}-[0-9]{5,9}\.bin$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(ValueError):
    """A manifest that does not parse, or a folder that holds none."""


@dataclass(frozen=True, slots=True)
class Shard:
    file: str  # relative to the prepared folder
    tokens: int
    sha256: str


@dataclass(frozen=True, slots=True)
class Manifest:
    tokenizer: str  # "bytes" or "tokenizer.json"
    tokenizer_sha256: str  # of the tokenizer.json it was made with ("" for bytes)
    vocab: int
    eot: int
    dtype: str
    train: tuple[Shard, ...]
    validation: tuple[Shard, ...]
    documents: int = 0
    text_bytes: int = 0

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(DTYPES[self.dtype])

    @property
    def train_tokens(self) -> int:
        return sum(s.tokens for s in self.train)

    def shard_bytes(self, shard: Shard) -> int:
        return shard.tokens * self.numpy_dtype.itemsize

    def describe(self) -> str:
        unit = "bytes" if self.tokenizer == "bytes" else f"tokens (vocabulary {self.vocab})"
        held_out = sum(s.tokens for s in self.validation)
        return (f"{self.train_tokens:,} training {unit} in {len(self.train)} shards, {held_out:,} held out in "
                f"{len(self.validation)}")

    def to_bytes(self) -> bytes:
        shards = lambda group: [{"file": s.file, "tokens": s.tokens, "sha256": s.sha256} for s in group]
        wire = {"format": FORMAT, "version": VERSION,
                "tokenizer": {"name": self.tokenizer, "sha256": self.tokenizer_sha256, "vocab": self.vocab, "eot": self.eot},
                "dtype": self.dtype, "train": shards(self.train), "validation": shards(self.validation),
                "documents": self.documents, "text_bytes": self.text_bytes}
        return (json.dumps(wire, indent=1) + "\n").encode()

    @staticmethod
    def from_bytes(raw: bytes, where: str) -> "Manifest":
        """Parse and check a manifest; `where` names it in errors."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{where}: {len(raw)} bytes, more than a manifest may have ({MAX_MANIFEST_BYTES})")
        try:
            wire = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as error:
            raise ManifestError(f"{where} is not JSON ({error})") from None
        if not isinstance(wire, dict) or wire.get("format") != FORMAT:
            raise ManifestError(f"{where} is not a hetpeer shard manifest (no \"format\": \"{FORMAT}\")")
        if wire.get("version") != VERSION:
            raise ManifestError(f"{where}: manifest version {wire.get('version')!r}, this peer reads {VERSION}")
        tokenizer = wire.get("tokenizer")
        if not isinstance(tokenizer, dict):
            raise ManifestError(f"{where}: \"tokenizer\" must be an object")
        name, sha, vocab, eot = (tokenizer.get(k) for k in ("name", "sha256", "vocab", "eot"))
        if name not in ("bytes", "tokenizer.json") or not isinstance(sha, str) or (sha and not _SHA256.match(sha)):
            raise ManifestError(f"{where}: tokenizer must be named bytes or tokenizer.json with a sha256, got {tokenizer}")
        dtype = wire.get("dtype")
        if dtype not in DTYPES:
            raise ManifestError(f"{where}: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        top = np.iinfo(DTYPES[dtype]).max + 1
        if not _count(vocab) or not 2 <= vocab <= top or not _count(eot) or eot >= vocab:
            raise ManifestError(f"{where}: vocab must be 2 to {top} for {dtype} and eot an id below it, got {vocab}, {eot}")
        groups = {}
        for group in ("train", "validation"):
            entries = wire.get(group)
            if not isinstance(entries, list):
                raise ManifestError(f"{where}: \"{group}\" must be a list of shards")
            groups[group] = tuple(_shard(entry, f"{where}: {group}[{i}]", group, np.dtype(DTYPES[dtype]).itemsize)
                                  for i, entry in enumerate(entries))
        if not groups["train"]:
            raise ManifestError(f"{where}: no training shard")
        files = [s.file for g in groups.values() for s in g]
        if len(set(files)) != len(files):
            raise ManifestError(f"{where}: a shard file is listed twice")
        documents, text_bytes = wire.get("documents", 0), wire.get("text_bytes", 0)
        if not _count(documents) or not _count(text_bytes):
            raise ManifestError(f"{where}: documents and text_bytes must be counts, got {documents!r}, {text_bytes!r}")
        return Manifest(name, sha, vocab, eot, dtype, groups["train"], groups["validation"], documents, text_bytes)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shard(entry: Any, where: str, group: str, itemsize: int) -> Shard:
    if not isinstance(entry, dict) or set(entry) != {"file", "tokens", "sha256"}:
        raise ManifestError(f"{where} must be {{\"file\", \"tokens\", \"sha256\"}}, got {str(entry)[:200]}")
    file, tokens, sha = entry["file"], entry["tokens"], entry["sha256"]
    if not isinstance(file, str) or not _FILE.match(file) or not file.startswith(group + "/"):
        raise ManifestError(f"{where}: file must be {group}/NNNNNN-NNNNN.bin, got {str(file)[:200]!r}")
    if not _count(tokens) or tokens < 1 or tokens * itemsize > MAX_SHARD_BYTES:
        raise ManifestError(f"{where}: tokens must be 1 to {MAX_SHARD_BYTES // itemsize}, got {tokens!r}")
    if not isinstance(sha, str) or not _SHA256.match(sha):
        raise ManifestError(f"{where}: sha256 must be 64 lowercase hex digits, got {str(sha)[:100]!r}")
    return Shard(file, tokens, sha)


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_folder(folder: Path) -> tuple[Manifest, str]:
    """The manifest of a prepared folder and its name (sha256)."""
    path = Path(folder) / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"{folder} is not a prepared corpus: it has no {MANIFEST} (make one with hetpeer data prepare)") from None
    except OSError as error:
        raise ManifestError(f"cannot read {path}: {error.strerror or error}") from None
    return Manifest.from_bytes(raw, str(path)), sha256_of(raw)


def served_files(manifest: Manifest) -> frozenset[str]:
    """Every file of a prepared folder that may be served: the manifest, the tokenizer and the shards."""
    return frozenset({MANIFEST, "tokenizer.json", *(s.file for s in (*manifest.train, *manifest.validation))})


def is_prepared(path: Path | None) -> bool:
    return path is not None and (Path(path) / MANIFEST).is_file()
