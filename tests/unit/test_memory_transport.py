"""The in-process transport: what one peer sends, the other receives; a cut peer is unreachable."""

from __future__ import annotations

import pytest
import torch

from hetpeer.peer.transport import MemoryHub, MemoryTransport, PeerUnreachable, TransportTimeout


def test_a_tensor_crosses_the_hub_and_an_unplugged_peer_is_unreachable():
    hub = MemoryHub()
    a, b = MemoryTransport("a", hub), MemoryTransport("b", hub)
    with a, b:
        sent = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        a.send("b", "activation", sent, step=4, micro=1)
        assert torch.equal(b.recv("activation", "a", 4, 1, timeout_s=1), sent)
        hub.unplug("b")
        with pytest.raises(PeerUnreachable, match="b is not reachable"):
            a.send("b", "activation", sent, step=5)
        with pytest.raises(TransportTimeout, match="no activation for step 5"):
            b.recv("activation", "a", 5, 0, timeout_s=0.05)
    with pytest.raises(PeerUnreachable, match="a is not reachable"):
        b.send("a", "gradient", sent, step=0)  # a has shut down
