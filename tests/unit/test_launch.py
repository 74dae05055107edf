"""The local launcher relays every peer's output from its own thread: lines must reach stdout whole."""

from __future__ import annotations

import io
import threading
import time

from hetpeer.peer.launch import _one_at_a_time


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
