"""What a peer reports as misbehaving: many refused frames, or parameters clipped round after round."""

from __future__ import annotations

from hetpeer.peer.daemon.suspects import REFUSALS, WINDOW_S, Suspicion

P, Q = "p-000000000001", "q-000000000002"


def test_a_few_refusals_are_forgiven_many_are_reported_for_a_while():
    seen = Suspicion()
    assert seen.update({P: REFUSALS - 1}, {}, 0.0) == ()  # a plan switch can cost an honest peer a few
    assert seen.update({P: REFUSALS + 5}, {}, 1.0) == (P,)
    assert seen.update({P: REFUSALS + 5}, {}, 1.0 + WINDOW_S / 2) == (P,)  # still within the window
    assert seen.update({P: REFUSALS + 5}, {}, 2.0 + WINDOW_S) == ()  # nothing new since: forgiven


def test_refusals_spread_over_longer_than_the_window_are_not_reported():
    seen = Suspicion()
    for i in range(3 * REFUSALS):
        assert seen.update({P: i}, {}, i * WINDOW_S / 2) == ()


def test_a_neighbour_left_out_of_mixing_is_reported_until_it_stops():
    seen = Suspicion()
    assert seen.update({}, {}, 0.0) == ()
    assert seen.update({}, {Q: 3}, 1.0) == (Q,)
    assert seen.update({}, {}, 5.0) == (Q,)
    assert seen.update({}, {}, 2.0 + WINDOW_S) == ()


def test_the_most_offending_come_first_and_the_list_is_bounded():
    seen = Suspicion()
    counts = {f"p{i:02d}-{i:012x}": REFUSALS + i for i in range(30)}
    found = seen.update(counts, {}, 0.0)
    assert len(found) == 16 and found[0] == "p29-00000000001d"
