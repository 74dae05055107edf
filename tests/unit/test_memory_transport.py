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


def _frame(value: float, epoch: int, step: int = 120):
    from hetpeer.peer.transport.codec import checksum, encode
    from hetpeer.protocol.frame import FrameHeader

    dtype, payload = encode(torch.full((2,), value), "raw")
    return FrameHeader(kind="activation", dtype=dtype, shape=(2,), sender="a", step=step, epoch=epoch,
                       checksum=checksum(payload)), payload


def test_a_frame_of_a_newer_plan_takes_the_place_of_the_older_plans_frame_for_the_same_step():
    # a repair plan that restarts from a step its lane already reached under the old plan sends that step again
    from hetpeer.peer.transport.inbox import Inbox

    inbox = Inbox("b", max_frame_bytes=1 << 20)
    assert inbox.offer(*_frame(1.0, epoch=1))
    assert inbox.offer(*_frame(2.0, epoch=2))
    assert not inbox.misbehaving and inbox.discard_before(0, epoch=2) == 0
    assert inbox.recv("activation", "a", 120, 0, timeout_s=1.0).tolist() == [2.0, 2.0]
    # the old plan's frame coming after the new one's is late, not misbehaviour, and does not replace it
    assert inbox.offer(*_frame(2.0, epoch=2)) and not inbox.offer(*_frame(1.0, epoch=1))
    assert inbox.late == 1 and not inbox.misbehaving
    assert inbox.recv("activation", "a", 120, 0, timeout_s=1.0).tolist() == [2.0, 2.0]
    # the same frame twice under one plan is a sender's fault
    assert inbox.offer(*_frame(3.0, epoch=2, step=121)) and not inbox.offer(*_frame(4.0, epoch=2, step=121))
    assert inbox.misbehaving["a"] == 1 and "duplicate activation for step 121 micro 0" in inbox.rejections[-1][1]
    assert inbox.recv("activation", "a", 121, 0, timeout_s=1.0).tolist() == [3.0, 3.0]


def test_a_newer_plans_frames_outlive_the_running_plans_steps_past_them():
    """A repair plan that starts at step 109 reaches a peer still at step 113 under the old plan: a member that
    switched first sends step 110 of the new plan, which the old plan's end-of-step cleanup must not drop (an
    outer-step group's exchange waited on it until the lanes stalled)."""
    from hetpeer.peer.transport.inbox import Inbox

    inbox = Inbox("b", max_frame_bytes=1 << 20)
    assert inbox.offer(*_frame(1.0, epoch=1, step=112)) and inbox.offer(*_frame(2.0, epoch=2, step=110))
    assert inbox.discard_before(113, running=1) == 1  # the old plan's step 112, not the new plan's step 110
    assert inbox.recv("activation", "a", 110, 0, timeout_s=1.0).tolist() == [2.0, 2.0]
    assert inbox.offer(*_frame(3.0, epoch=2, step=111)) and inbox.discard_before(113) == 1  # without it: any epoch
