"""The lines hetpeer's long-running processes print: each starts with the UTC time it was written, to
the millisecond, so the logs of a swarm's hosts can be read side by side. Imports nothing from hetpeer.

    2026-11-24T16:05:01.234Z plan epoch 2 from step 41: stage 1/2 (layers 0-1), lane 3/4, ...

Programs that read other processes' output (the local launchers, tests, benchmarks) take the time off
with `split` before matching what follows it.
"""

from __future__ import annotations

import calendar
import logging
import re
import time

STAMP_RE = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) ")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def now() -> str:
    """The current UTC time as a line's stamp, e.g. 2026-11-24T16:05:01.234Z."""
    return at(time.time())


def at(seconds_: float) -> str:
    """Seconds since the epoch in a stamp's form."""
    whole, ms = divmod(round(seconds_ * 1000), 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{ms:03d}Z"


def seconds(stamp_: str) -> float:
    """A stamp as seconds since the epoch (the inverse of `now`, to the millisecond)."""
    return calendar.timegm(time.strptime(stamp_[:19], "%Y-%m-%dT%H:%M:%S")) + int(stamp_[20:23]) / 1000


def stamp(line: str) -> str:
    return f"{now()} {line}"


def split(line: str) -> tuple[str | None, str]:
    """(stamp or None, the rest of the line)."""
    match = STAMP_RE.match(line)
    return (match.group(1), line[match.end():]) if match else (None, line)


def unstamp(line: str) -> str:
    return split(line)[1]


def relabel(line: str, label: str) -> str:
    """A line relayed by another process, its source in brackets after the stamp: `STAMP [label] rest`."""
    when, rest = split(line)
    return f"{when or now()} [{label}] {rest}"


class Formatter(logging.Formatter):
    """logging's records in the same form: the stamp, then level, logger and message."""

    converter = time.gmtime

    def __init__(self) -> None:
        super().__init__(LOG_FORMAT)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 (logging's name)
        return time.strftime("%Y-%m-%dT%H:%M:%S", self.converter(record.created)) + f".{int(record.msecs):03d}Z"
