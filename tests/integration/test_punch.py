"""What a punch does when the other side does not dial back (`peer/transport/punch.py`): it gives up after its
window with an error that names the far end, its own port and the last failure, and leaves its port free for
the next try. A punch that succeeds needs two NATs: `tests/netns/test_hole_punching.py`."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from hetpeer.peer.reach import free_port
from hetpeer.peer.transport.links import share_port
from hetpeer.peer.transport.punch import Puncher, punch
from hetpeer.peer.transport.stream import LinkIdentity
from hetpeer.protocol.addresses import PeerAddress


def test_a_punch_nobody_answers_ends_after_its_window_naming_the_far_end_and_the_port_stays_usable():
    local, far = free_port(), free_port()  # nothing listens on, or dials from, far
    started = time.monotonic()
    with pytest.raises(asyncio.TimeoutError) as caught:
        asyncio.run(punch(("127.0.0.1", local), ("127.0.0.1", far), window_s=1.0))
    assert time.monotonic() - started >= 1.0
    text = str(caught.value)
    assert f"no hole punched to 127.0.0.1:{far} from port {local} within 1 s" in text and "refused" in text, text
    with socket.socket() as again:  # every failed dial closed its socket: the port binds again
        share_port(again)
        again.bind(("127.0.0.1", local))


def test_a_puncher_punches_only_to_peers_behind_nat_that_punch_and_not_behind_its_own_address():
    puncher = Puncher(LinkIdentity("a-0123456789ab", object()), "0.0.0.0", 40000, public_host="198.51.100.1")
    home = PeerAddress(direct=("203.0.113.9", 7000), dialable=False, punch=40001)
    assert puncher.reaches(home)
    assert not puncher.reaches(PeerAddress(direct=("203.0.113.9", 7000), dialable=False))  # its NAT changes ports
    assert not puncher.reaches(PeerAddress(direct=("203.0.113.9", 7000), punch=40001))  # dialable: dialled instead
    assert not puncher.reaches(PeerAddress(direct=("198.51.100.1", 7000), dialable=False, punch=40001))  # one router


def test_a_punch_from_ports_a_live_connection_holds_waits_between_tries_rather_than_spinning():
    """Every attempt fails at once (the pair of ports is taken): the punch still ends after its window naming the
    cause, and pauses between attempts (it used to retry at once, a core's worth of CPU for the whole window)."""
    import resource

    server = socket.create_server(("127.0.0.1", 0))
    holder = socket.socket()
    share_port(holder)
    holder.bind(("127.0.0.1", 0))
    holder.connect(server.getsockname())
    try:
        used = resource.getrusage(resource.RUSAGE_SELF)
        with pytest.raises(asyncio.TimeoutError, match="Cannot assign requested address"):
            asyncio.run(punch(holder.getsockname(), server.getsockname(), window_s=2.0))
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu_s = after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime
        assert cpu_s < 0.5, f"{cpu_s:.2f} s of CPU in a 2 s punch: it spun"
    finally:
        holder.close()
        server.close()
