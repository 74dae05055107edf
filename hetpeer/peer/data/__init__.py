"""Byte-level token streams from a local text corpus, reproducible per (seed, lane, step)."""

from hetpeer.peer.data.corpus import Batch, Corpus, CorpusError

__all__ = ["Batch", "Corpus", "CorpusError"]
