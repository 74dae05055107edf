"""Averaging within a group: decentralized Adam over gossip, ring all-reduce, and state download on (re)join."""
