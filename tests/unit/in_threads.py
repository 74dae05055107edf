"""Running in-process peers side by side: each action in a thread of its own, joined with a hang guard."""

from __future__ import annotations

import threading
from typing import Callable

JOIN_S = 60.0  # a hang guard for the threads, not a timing


def outcomes(actions: list[Callable[[], object]], join_s: float = JOIN_S) -> list[object]:
    """What each action returned or raised, in order."""
    done: list[object] = [None] * len(actions)

    def work(k: int) -> None:
        try:
            done[k] = actions[k]()
        except BaseException as error:  # handed to the test thread
            done[k] = error

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(len(actions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(join_s)
    assert not any(thread.is_alive() for thread in threads), "a peer hung"
    return done


def results(actions: list[Callable[[], object]], join_s: float = JOIN_S) -> list[object]:
    """What each action returned, in order; the first error raised is raised here."""
    done = outcomes(actions, join_s)
    for outcome in done:
        if isinstance(outcome, BaseException):
            raise outcome
    return done
