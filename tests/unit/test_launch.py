"""The local launcher relays every peer's output from its own thread: lines must reach stdout whole. The ports it
writes into an address book must still be free when the peers bind them."""

from __future__ import annotations

import io
import socket
import threading
import time

from hetpeer.peer import launch
from hetpeer.peer.launch import _one_at_a_time, free_port


def test_lines_echoed_from_many_threads_at_once_stay_whole():
    out = io.StringIO()

    def write_like_print(line: str) -> None:  # print writes the text and its end apart
        out.write(line)
        time.sleep(0)  # let another thread in between the two, as a busy machine does
        out.write("\n")

    echo = _one_at_a_time(write_like_print)
    start = threading.Barrier(4)

    def peer(device: str) -> None:
        start.wait()
        for step in range(500):
            echo(f"[{device}] step {step} loss 1.0")

    threads = [threading.Thread(target=peer, args=(f"d{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 * 500
    assert all(line.count("[") == 1 and line.endswith("loss 1.0") for line in lines)
    for i in range(4):
        assert [line for line in lines if line.startswith(f"[d{i}]")] == [f"[d{i}] step {s} loss 1.0" for s in range(500)]


def test_free_ports_lie_below_the_range_outgoing_connections_take_theirs_from_and_are_never_handed_out_twice():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(launch._LOWEST_PORT <= port < launch._ephemeral_low() for port in ports)
    for port in ports[:5]:  # still free: a listener binds each
        socket.create_server(("127.0.0.1", port)).close()


def test_a_port_something_listens_on_or_already_handed_out_is_passed_over(monkeypatch):
    handed = free_port()
    with socket.create_server(("127.0.0.1", 0)) as busy:
        taken = busy.getsockname()[1]
        with socket.create_server(("127.0.0.1", 0)) as spare:
            free = spare.getsockname()[1]
        draws = iter([taken, handed, free])

        class Draw:
            def randrange(self, low, high):
                return next(draws)

        monkeypatch.setattr(launch, "_ephemeral_low", lambda: 65536)
        monkeypatch.setattr(launch.random, "SystemRandom", Draw)
        assert free_port() == free


def test_with_no_room_below_the_ephemeral_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(launch, "_ephemeral_low", lambda: launch._LOWEST_PORT + 10)
    port = free_port()
    assert port >= launch._LOWEST_PORT + 10
    socket.create_server(("127.0.0.1", port)).close()
