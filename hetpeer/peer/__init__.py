"""The peer runtime: a model stage, its data, the transport between stages, and gossip within a group."""
