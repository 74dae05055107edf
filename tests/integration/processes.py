"""What runs on this machine, read from /proc: for tests that check nothing they started is left."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator


def live_processes() -> Iterator[tuple[int, int, str]]:
    """(pid, process group, command line) of every running process; zombies are not running."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended while we looked
            continue
        state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
        if state != "Z":
            yield int(entry.name), int(pgrp), cmdline
