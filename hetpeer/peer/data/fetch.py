"""Where a peer's shards come from: a local prepared folder, or downloads kept in a cache of bounded size.

`ShardStore.path(shard)` is a file holding exactly the manifest's bytes for `shard`: the local folder's own
file (checked once against its sha256) or a verified copy in the cache, taken from other peers (`peers`,
`sharing.py`) or else downloaded from the organizer's URL. A download goes to a temporary file, hashed as it arrives, and is renamed into place only when its
size and sha256 match the manifest; a mismatch is an error naming the URL, and nothing unverified is ever
read. The cache (`cache/<manifest sha256>/...`) holds at most `cache_bytes`: before a download, the least
recently used shards that are neither open nor about to be read are deleted. `prefetch` downloads in the
background (`start()` starts its two threads, `close()` stops them), so a lane rarely waits on the network.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Iterable

from hetpeer.peer.data.corpus import CorpusError
from hetpeer.peer.data.order import BLOCK_SHARDS
from hetpeer.protocol.dataset import MANIFEST, Manifest, ManifestError, Shard, read_folder, sha256_of

log = logging.getLogger("hetpeer.peer")
CHUNK_BYTES = 1 << 20
TIMEOUT_S = 30.0
TRIES = 3
DOWNLOADERS = 2


class DataFetchError(CorpusError):
    """A shard or manifest that could not be had, or that did not match what it should be."""


def fetch_manifest(url: str, name: str, cache: Path) -> tuple[Manifest, Path]:
    """The manifest named `name` (sha256) from `url`'s folder, checked and kept in the cache (read from there
    when it is already); returns it and its cache folder."""
    folder = cache / name
    path = folder / MANIFEST
    if path.is_file() and sha256_of(path.read_bytes()) == name:
        return Manifest.from_bytes(path.read_bytes(), str(path)), folder
    raw = _get(_join(url, MANIFEST), limit_bytes=64 * 2**20)
    if sha256_of(raw) != name:
        raise DataFetchError(f"{_join(url, MANIFEST)} is not the plan's dataset: its sha256 is {sha256_of(raw)[:16]}..., "
                             f"the plan names {name[:16]}...")
    manifest = Manifest.from_bytes(raw, _join(url, MANIFEST))
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, raw)
    return manifest, folder


class ShardStore:
    """The shards of one manifest, from a `local` prepared folder holding it or downloaded from `url` into
    `cache_folder` (at most `cache_bytes` of shards)."""

    def __init__(self, manifest: Manifest, name: str, local: Path | None = None, url: str = "",
                 cache_folder: Path | None = None, cache_bytes: int = 0) -> None:
        if local is None and (not url or cache_folder is None):
            raise ValueError("a shard store needs a local folder, or a URL and a cache folder")
        self.manifest, self.name, self.local, self.url = manifest, name, local, url
        self.cache_folder, self.cache_bytes = cache_folder, cache_bytes
        self.downloaded_bytes = 0  # from the URL
        self.peers: Callable[[Shard], bytes | None] | None = None  # a verified shard from other peers, or None
        self.from_peers_bytes = 0
        self._lock = threading.Lock()
        self._checked: set[str] = set()  # local files whose sha256 was checked
        self._pending: dict[str, concurrent.futures.Future] = {}
        self._used: dict[str, float] = {}  # cached file -> when last used
        self._pinned: set[str] = set()
        self._reserved = 0  # bytes of downloads under way
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        if local is None:
            largest = max(manifest.shard_bytes(s) for s in (*manifest.train, *manifest.validation))
            if cache_bytes < 3 * BLOCK_SHARDS * largest:  # a batch may read across two blocks while the next comes
                raise DataFetchError(f"a data cache of {cache_bytes / 2**20:.1f} MiB cannot hold the {3 * BLOCK_SHARDS} "
                                     f"shards of {largest / 2**20:.1f} MiB a peer reads and reads next: give more (--data-cache-gb)")

    def start(self) -> "ShardStore":
        if self.local is None and self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(DOWNLOADERS, thread_name_prefix="shards")
            for path in sorted((self.cache_folder).rglob("*.bin")):  # what an earlier run kept counts against the cap
                self._used[str(path.relative_to(self.cache_folder))] = path.stat().st_mtime
        return self

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def pin(self, files: Iterable[str]) -> None:
        """Keep these shards (the ones open and the ones read next) out of eviction; unpins the others."""
        with self._lock:
            self._pinned = set(files)

    def held(self, shard: Shard) -> Path | None:
        """The file of `shard` when this store holds it verified (what it may serve to other peers), else None."""
        if self.local is not None:
            return self.local / shard.file if shard.file in self._checked else None
        with self._lock:
            return self.cache_folder / shard.file if shard.file in self._used else None

    def path(self, shard: Shard) -> Path:
        """The verified file of `shard`, downloaded first when it is not held."""
        if self.local is not None:
            path = self.local / shard.file
            if shard.file not in self._checked:
                _check_file(path, shard, self.manifest)
                self._checked.add(shard.file)
            return path
        self.start()
        future = self._fetch(shard)
        future.result()
        with self._lock:
            self._used[shard.file] = time.monotonic()
        return self.cache_folder / shard.file

    def prefetch(self, shards: Iterable[Shard]) -> None:
        """Start downloading these shards (those not held nor already coming) in the background."""
        if self.local is None:
            self.start()
            for shard in shards:
                self._fetch(shard)

    def _fetch(self, shard: Shard) -> concurrent.futures.Future:
        with self._lock:
            if shard.file in self._used:
                done: concurrent.futures.Future = concurrent.futures.Future()
                done.set_result(None)
                return done
            if shard.file not in self._pending:
                future = self._executor.submit(self._download, shard)
                future.add_done_callback(lambda f, file=shard.file: self._downloaded(file, f))
                self._pending[shard.file] = future
            return self._pending[shard.file]

    def _downloaded(self, file: str, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending.pop(file, None)
            if not future.cancelled() and future.exception() is None:
                self._used[file] = time.monotonic()
        if not future.cancelled() and future.exception() is not None:
            log.warning("data: %s", future.exception())

    def _download(self, shard: Shard) -> None:
        size = self.manifest.shard_bytes(shard)
        self._make_room(size)
        try:
            self._download_into(shard, size)
        finally:
            with self._lock:
                self._reserved -= size

    def _download_into(self, shard: Shard, size: int) -> None:
        target = self.cache_folder / shard.file
        target.parent.mkdir(parents=True, exist_ok=True)
        data = self.peers(shard) if self.peers is not None else None  # checked against the manifest by the source
        if data is not None:
            _write_atomically(target, data)
            with self._lock:
                self.from_peers_bytes += size
            return
        url = _join(self.url, shard.file)
        last: Exception | None = None
        for attempt in range(TRIES):
            try:
                _download_to(url, target, size, shard.sha256)
                with self._lock:
                    self.downloaded_bytes += size
                return
            except DataFetchError as error:
                last = error
                time.sleep(min(2.0**attempt, 10.0))
        raise DataFetchError(f"gave up on {shard.file} after {TRIES} tries: {last}")

    def _make_room(self, incoming: int) -> None:
        """Delete the least recently used unpinned shards until `incoming` more bytes (and those of the downloads
        under way) fit the cap; reserves them."""
        with self._lock:
            held = {f: (self.cache_folder / f).stat().st_size for f in self._used if (self.cache_folder / f).exists()}
            self._reserved += incoming
            total = sum(held.values()) + self._reserved
            for file in sorted(held, key=lambda f: self._used[f]):
                if total <= self.cache_bytes:
                    break
                if file in self._pinned:
                    continue
                (self.cache_folder / file).unlink(missing_ok=True)
                self._used.pop(file)
                total -= held[file]
            if total > self.cache_bytes:
                log.warning("data: the cache holds %.0f MiB of shards in use or read next, over its %.0f MiB",
                            total / 2**20, self.cache_bytes / 2**20)


def open_store(name: str | None, url: str, local: Path | None, cache: Path, cache_bytes: int) -> ShardStore:
    """The store of the dataset named `name` (a plan's manifest sha256; None: whatever `local` holds): from
    `local` when it is that prepared folder, else downloaded from `url` into `cache`."""
    if local is not None and (local / MANIFEST).is_file():
        manifest, found = read_folder(local)
        if name is None or found == name:
            return ShardStore(manifest, found, local=local)
        if not url:
            raise DataFetchError(f"the plan's dataset is {name[:16]}..., but {local} holds {found[:16]}... and the plan "
                                 "gives no URL to fetch it from")
    if name is None:
        raise ManifestError(f"{local} is not a prepared corpus: it has no {MANIFEST}")
    if not url:
        raise DataFetchError(f"the plan's dataset {name[:16]}... is not in a local --data folder and the plan gives no URL "
                             "(the coordinator's --data-url, or its --data with --http)")
    manifest, folder = fetch_manifest(url, name, cache)
    return ShardStore(manifest, name, url=url, cache_folder=folder, cache_bytes=cache_bytes)


def _check_file(path: Path, shard: Shard, manifest: Manifest) -> None:
    try:
        size = path.stat().st_size
    except OSError as error:
        raise DataFetchError(f"shard {path} cannot be read: {error.strerror or error}") from None
    if size != manifest.shard_bytes(shard):
        raise DataFetchError(f"shard {path} holds {size} bytes, its manifest says {manifest.shard_bytes(shard)}")
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
    if digest.hexdigest() != shard.sha256:
        raise DataFetchError(f"shard {path} does not match its manifest's sha256: it was changed or damaged")


def _download_to(url: str, target: Path, size: int, sha256: str) -> None:
    temporary = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.part")
    digest, got = hashlib.sha256(), 0
    try:
        with _open(url) as response, temporary.open("wb") as out:
            while chunk := response.read(CHUNK_BYTES):
                got += len(chunk)
                if got > size:
                    raise DataFetchError(f"{url} sent more than the manifest's {size} bytes")
                digest.update(chunk)
                out.write(chunk)
        if got != size:
            raise DataFetchError(f"{url} sent {got} bytes, the manifest says {size}")
        if digest.hexdigest() != sha256:
            raise DataFetchError(f"{url} does not match the manifest's sha256: not used")
        os.replace(temporary, target)
    except OSError as error:
        raise DataFetchError(f"{url}: {getattr(error, 'reason', None) or error.strerror or error}") from None
    finally:
        temporary.unlink(missing_ok=True)


def _open(url: str):
    try:
        return urllib.request.urlopen(url, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as error:
        raise DataFetchError(f"{url}: HTTP {error.code} {error.reason}") from None
    except (urllib.error.URLError, OSError) as error:
        raise DataFetchError(f"{url}: {getattr(error, 'reason', None) or error}") from None


def _get(url: str, limit_bytes: int) -> bytes:
    try:
        with _open(url) as response:
            data = response.read(limit_bytes + 1)
    except OSError as error:
        raise DataFetchError(f"{url}: {error}") from None
    if len(data) > limit_bytes:
        raise DataFetchError(f"{url} is larger than {limit_bytes} bytes")
    return data


def _join(url: str, file: str) -> str:
    return url.rstrip("/") + "/" + file


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)
