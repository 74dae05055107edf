"""hetpeer: train foundation models on volunteer GPUs over slow, uneven links."""

__version__ = "0.1.0"
