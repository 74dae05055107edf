"""The search on several cores: islands, one search each, that exchange their best grid between epochs.

With `PlannerConfig.workers` = N > 1, `solve` runs N searches of the same problem: one in its own process
(island 0, which also drives the others) and N - 1 in worker processes (`Islands`, kept between solves by a
coordinator so that its rounds do not start processes). Each island has its own random stream, drawn from
the solve's, so that the islands search apart; the budget is cut into epochs of at least `EPOCH_S`, and
after each the best grid of all (the lowest objective, the lowest island on a tie) joins every island's
population (`_migrated`) for the next epoch, which goes on from there (`search`'s memory). A large swarm
gains twice: N descents where one would run, and the spread of long searches (two 600 s solves of one swarm
lie up to 2% apart) taken as the best of N.

The result is deterministic for a seed and a worker count wherever no island hits a deadline, as one
search is: epochs are cut by the budget, not by the clock, and islands that all settled (their restarts in a
row found nothing better, `Found.stale`) without a better grid end the solve early. An island that has not answered `LATE_S`
after the first island returned (a worker still starting, on a budget shorter than its imports) is left out:
the first island searches on alone, and the next solve passes over the late answer, so that a coordinator's
short rounds have their workers from the second round on. Where `workers` is 1, none of this runs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable

import numpy as np

from hetpeer.coordinator.planner.costmodel import IMPROVEMENT, CostModel
from hetpeer.coordinator.planner.problem import PlanningError, Problem, Shape
from hetpeer.coordinator.planner.search import Found, Memory, Progress, Remembered, SearchConfig, search

# The least search an epoch gives each island before the best grid migrates: going on from a population costs a
# local search of each member again, which at 1024 devices epochs of 15 s paid so often that 2 islands came out 6%
# behind one search of 60 s (mixed, seed 0); a budget under this is one epoch: the best of N searches.
EPOCH_S = 60.0
# an island that has not answered this long after the first island returned (at its epoch's deadline or past it,
# by the move under way) is left out of the rest of the solve: a worker still starting (its imports take 0.3 s)
# must not hold a short budget up
LATE_S = 0.05


@dataclass(frozen=True, slots=True)
class Archipelago:
    """Where each island's search stopped, the best island's first: `solve` given it goes on from there with
    any worker count (island k from memory k modulo their number); with one worker, from the best."""

    memories: tuple[Memory, ...]


def memories(memory: Memory | Archipelago | None, count: int) -> list[Memory | None]:
    """`count` memories to go on from: an archipelago's in turn, one memory for every island, or none."""
    if isinstance(memory, Archipelago):
        return [memory.memories[k % len(memory.memories)] for k in range(count)]
    return [memory] * count


class IslandError(RuntimeError):
    """A worker process failed or left in the middle of a search (its traceback, where it sent one)."""


class Islands:
    """Worker processes for the islands beyond the first, started on first use and stopped by `close`. Each is a
    fresh interpreter that imports this module alone, talking over a socket pair: not a fork (the coordinator runs
    threads, which a fork would copy in whatever state they hold), nor multiprocessing's spawn (which runs the
    caller's main module again, and fails in a script without a main guard). Messages are pickled: they cross only
    between a process and the children it started, never a network."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers = workers
        self._pipes: list = []
        self._processes: list = []
        self._owed: list[int] = []  # per worker, answers to epochs it was left out of: still to come, not to be used

    def __enter__(self) -> "Islands":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        if self._processes:
            return
        package_root = str(Path(__file__).resolve().parents[3])  # where `hetpeer` imports from, installed or not
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        for _ in range(1, self.workers):
            ours, theirs = socket.socketpair()
            process = subprocess.Popen(
                [sys.executable, "-c", f"from {__name__} import serve; serve({theirs.fileno()})"],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
            )
            theirs.close()
            self._pipes.append(Connection(ours.detach()))
            self._processes.append(process)
            self._owed.append(0)

    def close(self, wait: bool = True) -> None:
        """Tell the workers to stop; with `wait`, until they have (a worker in the middle of a search is killed
        after 5 s). Without, they exit by themselves: a solve that started them returns at once (an interpreter's
        exit takes 0.17 s at 1024 devices)."""
        for pipe in self._pipes:
            try:
                pipe.send(None)
            except (BrokenPipeError, OSError):
                pass
        for process in self._processes if wait else ():
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for pipe in self._pipes:
            pipe.close()
        self._pipes, self._processes, self._owed = [], [], []

    def send(self, island: int, message: tuple) -> None:
        try:
            self._pipes[island - 1].send(message)
        except OSError:
            self.close()
            raise IslandError(f"planner island {island + 1} is gone") from None

    def pass_over(self, island: int) -> None:
        """The island's answer to the epoch it is searching now is not wanted: the next `receive` skips it."""
        self._owed[island - 1] += 1

    def receive(self, island: int, timeout: float) -> Found | None:
        """What the island found in its epoch, or None after `timeout` seconds without an answer: that answer,
        when it comes, is passed over by the next `receive`."""
        pipe = self._pipes[island - 1]
        try:
            while self._owed[island - 1]:  # answers it owed to epochs it was late for: whatever they say
                pipe.recv()
                self._owed[island - 1] -= 1
            if not pipe.poll(timeout):
                self.pass_over(island)
                return None
            kind, value = pipe.recv()
        except (EOFError, OSError):
            self.close()
            raise IslandError(f"planner island {island + 1} exited in the middle of a search") from None
        if kind == "found":
            return value
        self.close()
        if kind == "planning":  # the problem has no plan: the same error the first island raises
            raise PlanningError(value)
        raise IslandError(f"planner island {island + 1} failed:\n{value}")


def search_islands(
    problem: Problem,
    shapes: list[Shape],
    make_model: Callable[[Shape], CostModel],
    factory: Callable[[Shape], CostModel],
    config: SearchConfig,
    rng: np.random.Generator,
    budget_s: float,
    islands: Islands,
    progress: Progress | None = None,
    memory: Memory | Archipelago | None = None,
) -> tuple[Found, Archipelago]:
    """The best grid of `islands.workers` searches of `budget_s` seconds in all, and where each stopped.
    `make_model` is this process's (cached) model factory, `factory` a picklable one for the workers."""
    say = progress or (lambda line: None)
    clock = time.monotonic  # the system's: every process reads the same, so that workers are told deadlines
    started = clock()
    count = islands.workers
    islands.start()
    seeds = rng.integers(2**63, size=count)
    streams = [np.random.default_rng(int(seed)) for seed in seeds]
    remembered = memories(memory, count)
    epochs = max(1, int(budget_s // EPOCH_S))
    best: Found | None = None
    live = list(range(count))  # islands still in the solve: a late one is left out (`LATE_S`)
    for epoch in range(epochs):
        end = started + budget_s * (epoch + 1) / epochs
        for k in live[1:]:
            setup = (problem, shapes, factory, config, int(seeds[k])) if epoch == 0 else None
            islands.send(k, (setup, remembered[k], end))
        try:
            founds = {0: search(problem, shapes, make_model, config, streams[0], end, clock, say, remembered[0])}
        except BaseException:  # the workers' answers to this epoch must not reach the next solve
            for k in live[1:]:
                islands.pass_over(k)
            raise
        returned = clock()
        for k in live[1:]:
            answer = islands.receive(k, max(0.0, max(returned, end) + LATE_S - clock()))
            if answer is None:
                say(f"epoch {epoch + 1} of {epochs}: island {k + 1} of {count} did not answer in time: left out")
                continue
            founds[k] = answer
        late, live = [k for k in live if k not in founds], [k for k in live if k in founds]
        leader = min(live, key=lambda k: (founds[k].objective, k))
        improved = best is None or founds[leader].objective < best.objective * (1 - IMPROVEMENT)
        best = founds[leader] if improved else best
        say(f"epoch {epoch + 1} of {epochs}: best {best.objective:.4g} s from island {leader + 1} of {count} "
            f"({', '.join(f'{founds[k].objective:.4g}' if k in founds else 'late' for k in range(count))})")
        migrant = _ids(problem, founds[leader])
        for k in live:
            remembered[k] = _migrated(founds[k].memory, founds[leader].shape, migrant)
        if late:  # the first island goes on alone; the next solve passes over the late answers
            live = [0]
        if all(found.stale >= config.restarts for found in founds.values()) and not improved:
            break
    ordered = [remembered[leader]] + [m for k, m in enumerate(remembered) if k != leader and m is not None]
    return replace(best, memory=remembered[leader]), Archipelago(tuple(ordered))


def _ids(problem: Problem, found: Found) -> tuple[tuple[str, ...], ...]:
    ids = np.asarray(problem.device_ids, dtype=object)
    return tuple(tuple(row) for row in ids[found.grid].tolist())


def _migrated(memory: Memory, shape: Shape, grid: tuple[tuple[str, ...], ...]) -> Memory:
    """`memory` with `grid` (the best of all islands, of `shape`) first in that shape's population, which
    keeps its size (its worst leaves), and that shape first."""
    entry = next((e for e in memory.shapes if e.shape == shape), Remembered(shape, (), 0.0))
    others = [g for g in entry.population if _partition(g) != _partition(grid)]
    size = max(1, len(entry.population))
    moved = Remembered(shape, tuple([grid] + others)[:size], entry.searched_s)
    return replace(memory, shapes=(moved,) + tuple(e for e in memory.shapes if e.shape != shape))


def _partition(grid: tuple[tuple[str, ...], ...]) -> list[tuple[str, ...]]:
    return sorted(tuple(sorted(row)) for row in grid)


def serve(fd: int) -> None:
    """A worker's loop on its end of the socket pair: one epoch's search per message, on the problem of the solve's
    first message, until told to stop (None) or its parent is gone."""
    pipe = Connection(fd)
    state: dict = {}
    while True:
        try:
            message = pipe.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        setup, memory, deadline = message
        try:
            if setup is not None:
                problem, shapes, factory, config, seed = setup
                models: dict[Shape, CostModel] = {}

                def model_for(shape: Shape, models=models, factory=factory) -> CostModel:
                    if shape not in models:
                        models[shape] = factory(shape)
                    return models[shape]

                state = {"problem": problem, "shapes": shapes, "model": model_for, "config": config,
                         "rng": np.random.default_rng(seed)}
            found = search(state["problem"], state["shapes"], state["model"], state["config"], state["rng"], deadline,
                           time.monotonic, None, memory)
            answer = ("found", found)
        except PlanningError as error:
            answer = ("planning", str(error))
        except Exception:  # a bug: the parent raises it with this traceback
            answer = ("error", traceback.format_exc())
        try:
            pipe.send(answer)
        except OSError:  # the parent is gone (its own search failed first, or it was stopped): nobody to tell
            return
