"""Training data: corpora held in memory or prepared into shards (`prepare.py`), fetched (`fetch.py`, `sharing.py`)
and read in the swarm's order (`order.py`, `shards.py`); `source.open_data` picks which for a peer."""

from hetpeer.peer.data.corpus import Batch, Corpus, CorpusError

__all__ = ["Batch", "Corpus", "CorpusError"]
