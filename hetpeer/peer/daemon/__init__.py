"""A swarm peer, behind `hetpeer join --swarm`: probe, announce, follow the coordinator's plans.

Three threads, each with one job:

- control (every heartbeat): read the swarm's announcements into the address book, read plans and keep
  the newest one signed by the trusted coordinator key, announce this peer's record (what it measured,
  what it holds, where it is: `announcing.py`). All DHT traffic goes through this one thread.
- probe (every few heartbeats): measure latency and bandwidth to a handful of peers (`probing.py`).
- main: train, switching to each plan when it takes effect (`following.py`), with the stage's state kept,
  restored from a checkpoint or downloaded from its group (`handover.py`).

A peer that loses its lane (a neighbour stopped answering) announces "waiting" under the plan's epoch,
which tells the coordinator that the plan is broken; it resumes with the next plan.

`peer.py` holds the peer's configuration, its life cycle and its loops; the parts above are mixins of
`SwarmPeer`, each over the state that `SwarmPeer.__init__` sets up. `measure.py` measures its links,
`reaching.py` learns whether others can dial it and keeps its paths, `suspects.py` tallies the peers that
send it what it refuses. What the fixed-plan peer (`peer/node.py`) shares with it stays in `peer/`.
"""

from hetpeer.peer.daemon.peer import SwarmPeer, SwarmPeerConfig

__all__ = ["SwarmPeer", "SwarmPeerConfig"]
