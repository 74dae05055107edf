"""The errors of training data, below every data module."""


class CorpusError(ValueError):
    """A corpus path or a batch request that cannot give training data."""


class CorpusTooLarge(CorpusError):
    """Local text past what a corpus holds in memory: it is prepared into shards instead (`source.open_data`)."""
