"""What islands hand each other between epochs, and which memory each goes on from (no processes here: those are
tests/integration/test_planner_islands.py)."""

from __future__ import annotations

import pytest

from hetpeer.coordinator.config import CoordinatorConfig
from hetpeer.coordinator.planner import Memory, PlannerConfig, Shape
from hetpeer.coordinator.planner.islands import Archipelago, _migrated, memories
from hetpeer.coordinator.planner.search import Remembered

ONE_BY_TWO, TWO_BY_ONE = Shape(1, 2), Shape(2, 1)


def grid(*rows: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    return tuple(rows)


def memory(*entries: Remembered) -> Memory:
    return Memory(entries, frozenset({ONE_BY_TWO}), frozenset({"a", "b", "c"}))


def test_the_migrant_leads_its_shape_and_the_worst_of_that_shape_leaves():
    ours = memory(Remembered(TWO_BY_ONE, (grid(("a",), ("b",)),), 3.0),
                  Remembered(ONE_BY_TWO, (grid(("a", "b")), grid(("b", "c"))), 2.0))
    moved = _migrated(ours, ONE_BY_TWO, grid(("c", "a")))
    assert [entry.shape for entry in moved.shapes] == [ONE_BY_TWO, TWO_BY_ONE]
    assert moved.shapes[0].population == (grid(("c", "a")), grid(("a", "b")))  # its size kept: (b, c) left
    assert moved.shapes[0].searched_s == 2.0 and moved.shapes[1] == ours.shapes[0]
    assert moved.considered == ours.considered and moved.devices == ours.devices


def test_a_migrant_the_island_already_holds_replaces_its_twin_only():
    ours = memory(Remembered(ONE_BY_TWO, (grid(("a", "b")), grid(("b", "c"))), 2.0))
    moved = _migrated(ours, ONE_BY_TWO, grid(("b", "a")))  # the same group in another order
    assert moved.shapes[0].population == (grid(("b", "a")), grid(("b", "c")))


def test_a_migrant_of_a_shape_the_island_never_evolved_comes_first_with_no_time():
    ours = memory(Remembered(TWO_BY_ONE, (grid(("a",), ("b",)),), 3.0))
    moved = _migrated(ours, ONE_BY_TWO, grid(("a", "c")))
    assert moved.shapes[0] == Remembered(ONE_BY_TWO, (grid(("a", "c")),), 0.0)
    assert moved.shapes[1:] == ours.shapes


def test_each_island_goes_on_from_an_archipelagos_memories_in_turn():
    first, second = memory(), memory(Remembered(ONE_BY_TWO, (grid(("a", "b")),), 1.0))
    archipelago = Archipelago((first, second))
    assert memories(archipelago, 3) == [first, second, first]
    assert memories(archipelago, 1) == [first]  # one worker: the best island's
    assert memories(second, 2) == [second, second]
    assert memories(None, 2) == [None, None]


@pytest.mark.parametrize("workers", [0, -2])
def test_a_worker_count_below_one_is_refused(workers, tmp_path):
    with pytest.raises(ValueError, match="workers must be at least 1"):
        PlannerConfig(workers=workers)
    with pytest.raises(ValueError, match="workers must be at least 1"):
        CoordinatorConfig(swarm="t", home=tmp_path, workers=workers)
