"""Which data a first-stage peer reads: the plan's prepared corpus, a local prepared folder, or local text.

`open_data` gives an object with `batch(position, n, seq_len, seed)`, `validation_batch(n, seq_len, seed)`,
`windows(seq_len)`, `vocab` and `description`:
- a plan that names a dataset: its shards, from the peer's `--data` folder when that holds it, else fetched
  from the plan's URL into the peer's cache (`fetch.py`, `shards.py`);
- a prepared folder given as `--data` (a manifest.json in it): its shards, read in place;
- local text given as `--data`: held in memory up to `corpus.DEFAULT_MAX_BYTES`; past that it is prepared
  once into the cache (`prepare.py`, one process a core, a lock keeping peers on one machine from doing it
  twice) and read from there, so a corpus larger than memory streams instead of being cut;
- nothing: the standard library's sources (the demo's, the first `DEFAULT_MAX_BYTES` of them).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hetpeer.peer.data.corpus import Corpus, CorpusError, CorpusTooLarge, load_tokenizer
from hetpeer.peer.data.fetch import open_store
from hetpeer.protocol.dataset import ManifestError, is_prepared, sha256_of
from hetpeer.peer.data.prepare import Settings, prepare
from hetpeer.peer.data.shards import ShardedCorpus
from hetpeer.protocol.plan import Dataset

log = logging.getLogger("hetpeer.peer")
DEFAULT_CACHE_GB = 20.0


@dataclass(frozen=True, slots=True)
class DataCache:
    """Where a peer keeps shards it downloaded and corpora it prepared, and how many bytes of shards at most."""

    folder: Path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hetpeer" / "data"
    max_bytes: int = int(DEFAULT_CACHE_GB * 2**30)

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"a data cache must hold at least a byte, got {self.max_bytes}")


def open_data(data: str | None, tokenizer: str | None, vocab: int, seq_len: int, dataset: Dataset | None = None,
              cache: DataCache = DataCache(), say: Callable[[str], None] = log.info) -> Corpus | ShardedCorpus:
    """The data a first-stage peer trains on, checked against the model's vocabulary and sequence length."""
    try:
        return _open(data, tokenizer, vocab, seq_len, dataset, cache, say)
    except ManifestError as error:  # a prepared folder's or a downloaded manifest that does not parse
        raise CorpusError(str(error)) from None


def _open(data: str | None, tokenizer: str | None, vocab: int, seq_len: int, dataset: Dataset | None, cache: DataCache,
          say: Callable[[str], None]) -> Corpus | ShardedCorpus:
    local = Path(data) if data else None
    if dataset is not None or is_prepared(local):
        store = open_store(dataset.manifest if dataset else None, dataset.url if dataset else "", local,
                           cache.folder / "shards", cache.max_bytes)
        where = str(local) if store.local is not None else (dataset.url if dataset else "")
        return _checked(ShardedCorpus(store, where), tokenizer, vocab, seq_len)
    loaded = None
    if tokenizer is not None:
        loaded = load_tokenizer(tokenizer)
        if loaded.get_vocab_size() > vocab:
            raise CorpusError(f"tokenizer {tokenizer} has {loaded.get_vocab_size()} tokens, more than the model's "
                              f"vocabulary of {vocab}")
    elif vocab < 256:
        raise CorpusError(f"the model's vocabulary of {vocab} cannot hold bytes: give a tokenizer (--tokenizer)")
    if local is None:
        return Corpus.default(min_tokens=seq_len + 1, tokenizer=loaded)
    try:
        return Corpus.from_folder(local, min_tokens=seq_len + 1, tokenizer=loaded)
    except CorpusTooLarge:
        folder = _prepared_locally(local, tokenizer, cache, say)
        return _checked(ShardedCorpus(open_store(None, "", folder, cache.folder, cache.max_bytes), str(local)),
                        tokenizer, vocab, seq_len)


def _checked(corpus: ShardedCorpus, tokenizer: str | None, vocab: int, seq_len: int) -> ShardedCorpus:
    manifest = corpus.manifest
    if manifest.vocab > vocab:
        raise CorpusError(f"the dataset's ids reach {manifest.vocab}, more than the model's vocabulary of {vocab}")
    if tokenizer is not None and manifest.tokenizer != "bytes":
        file = Path(tokenizer) / "tokenizer.json" if Path(tokenizer).is_dir() else Path(tokenizer)
        if file.is_file() and sha256_of(file.read_bytes()) != manifest.tokenizer_sha256:
            raise CorpusError(f"the dataset was prepared with another tokenizer than {file}: its ids would mean other text")
    if corpus.windows(seq_len) < 1:
        raise CorpusError(f"no training shard of {corpus.source} holds {seq_len + 1} tokens, one sequence and its label")
    return corpus


def _prepared_locally(local: Path, tokenizer: str | None, cache: DataCache, say: Callable[[str], None]) -> Path:
    """`local` prepared into the cache once (again when its files change), under a lock other peers wait on."""
    files = sorted(p for p in (local.rglob("*") if local.is_dir() else [local]) if p.is_file())
    stamp = [str(local.resolve()), str(tokenizer or "bytes")] + [f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
    folder = cache.folder / "local" / hashlib.sha256("\n".join(stamp).encode()).hexdigest()[:24]
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a peer preparing it holds this; the others wait, then read what it made
        if not is_prepared(folder):
            say(f"data: {local} holds more text than a peer keeps in memory: preparing it once into {folder} "
                "(hetpeer data prepare does this ahead of time)")
            prepare([local], folder, Settings(Path(tokenizer) if tokenizer else None), say=say)
    return folder
