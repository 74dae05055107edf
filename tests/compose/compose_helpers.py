"""What the compose tests share: names unique to the run, and waiting for a swarm to get somewhere."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Callable, TypeVar

import pytest

from hetpeer.coordinator.api_errors import ApiError

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("HETPEER_TEST_IMAGE", "hetpeer:latest")
T = TypeVar("T")


def unique(prefix: str) -> str:
    """A compose project name no other run uses."""
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def wait_for(read: Callable[[], T], what: str, timeout_s: float = 180.0, every_s: float = 1.0,
             explain: Callable[[], str] | None = None) -> T:
    """`read()` until it gives something true (an unreachable API counts as not yet), else fail naming `what`
    and adding what `explain()` tells (the end of a log, say)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = read()
        except ApiError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}" + (f"\n{explain()}" if explain else ""))
        time.sleep(every_s)
