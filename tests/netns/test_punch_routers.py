"""Punching through both kinds of home router (`peer/transport/punch.py`): routers that drop what arrives unasked,
and routers whose own kernel answers it with a reset, which tears down the other side's fresh mapping when both
sides dial at once. Both sides start in the same millisecond, the race a reset router loses every time when
every SYN has a full TTL; with the opening SYN each punch connects within its window, its socket holds no queued
error (which would wake its reader for ever), and the connection carries bytes both ways. `benchmarks/punching.py` measures the success rate over hundreds of attempts."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from lab import Lab

pytestmark = pytest.mark.usefixtures("netns_ready")

# argv: local address, far address, first port, punches, start time. Punches one after another, each from a port
# of its own, with a window long enough for a loaded machine; prints per punch "ok" and what came back, or the error.
PUNCH = """
import asyncio, json, select, sys, time
from hetpeer.peer.transport.punch import punch
local, far, port, count, start = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
async def main():
    said = []
    for i in range(count):
        await asyncio.sleep(max(0.0, start + 6.0 * i - time.time()))
        try:
            sock = await punch((local, port + i), (far, port + i), 20.0)
        except Exception as error:
            said.append(f"failed: {error}")
            continue
        poll = select.epoll()  # a queued error (the opening SYN's "time exceeded") would poll ready for ever
        poll.register(sock.fileno(), select.EPOLLIN)
        if any(mask & select.EPOLLERR for _, mask in poll.poll(0.2)):
            said.append("error queued")
            continue
        poll.close()
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(local.encode() + b"\\n")
        await writer.drain()
        said.append("ok " + (await asyncio.wait_for(reader.readline(), 20.0)).decode().strip())
        writer.close()
    print(json.dumps(said))
asyncio.run(main())
"""
PUNCHES = 2


@pytest.mark.parametrize("router", ["drop", "reset"])
def test_two_hosts_behind_cone_routers_punch_a_connection_when_both_dial_at_once(lab: Lab, router: str) -> None:
    a, b = lab.behind_nat("a", "cone", router), lab.behind_nat("b", "cone", router)  # type: ignore[arg-type]
    start = time.time() + 3.0
    sides = [host.popen([sys.executable, "-c", PUNCH, host.address, far.public_address, "43000", str(PUNCHES), str(start)],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for host, far in ((a, b), (b, a))]
    said = [json.loads(side.communicate(timeout=300)[0].strip().splitlines()[-1]) for side in sides]
    assert said[0] == [f"ok {b.address}"] * PUNCHES, said  # each got the other's line, over the punched connection
    assert said[1] == [f"ok {a.address}"] * PUNCHES, said
