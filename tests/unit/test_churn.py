"""benchmarks/churn.py: its quick mode end to end, and the pieces of its model on their own."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hetpeer.coordinator.planner.relays import PUBLIC, SYMMETRIC

ROOT = Path(__file__).resolve().parents[2]


def load_churn():
    spec = importlib.util.spec_from_file_location("churn_benchmark", ROOT / "benchmarks" / "churn.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


churn = load_churn()


@pytest.fixture(scope="module")
def quick() -> dict:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "churn.py"), "--quick", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_quick_mode_sees_peers_come_and_go(quick: dict) -> None:
    assert quick["arrived"] > 0 and quick["left"] > 0
    assert [r["policy"] for r in quick["results"]][0] == churn.BEFORE.name  # the old defaults first: the reference
    assert quick["best"] in {r["policy"] for r in quick["results"]}


def test_every_noticed_break_is_re_solved_or_repaired(quick: dict) -> None:
    before, mended = quick["results"][0], quick["results"][1]
    assert before["on_break"] == "solve" and mended["on_break"] == "repair"
    for result in (before, mended):
        assert result["breaks"] > 0
        assert result["reasons"]["break"] == result["breaks"]
        assert result["tokens_per_s"] > 0 and result["planner_cpu_s"] > 0
        assert result["switches"] > 0 and result["moved_devices"] > 0  # migrations counted
    assert before["repairs"] == 0 and before["solves"] == sum(before["reasons"].values())
    assert mended["repairs"] > 0 and mended["repairs"] + mended["repair_failures"] == mended["breaks"]
    # newcomers: the old policy solves for them; the waiting policy leaves them to the periodic re-solve
    assert before["reasons"].get("join", 0) > 0 and "join" not in mended["reasons"]


def test_a_departure_is_noticed_when_its_record_expires() -> None:
    swarm = churn.make_swarm(8, 0.05, 0.5, 6.0, seed=1)
    swarm = replace(swarm, arrive_s=np.full(8, -churn.SETTLE_S), leave_s=np.full(8, math.inf))
    solver = churn.Solver(0.1, seed=0)
    first = solver(churn.problem_over(swarm, np.arange(8), None), None)[0].plan  # the plan every run starts from
    leaver = int(first.devices[0][1:])
    leave_s = swarm.leave_s.copy()
    leave_s[leaver] = 100.0
    result = churn.simulate(replace(swarm, leave_s=leave_s), churn.BEFORE, solver, 0.05)
    noticed = [t for t, kind in result.events if kind == "break"]
    assert noticed and 100.0 + churn.EXPIRE_S <= noticed[0] <= 100.0 + churn.EXPIRE_S + 2 * churn.HEARTBEAT_S
    assert result.stalled_lane_s > 0  # its lane stood still until then
    assert result.switches >= 1


def test_sessions_have_the_asked_mean_and_the_survivors_the_longer_residuals() -> None:
    rng = np.random.default_rng(0)
    drawn = churn.sessions(200_000, 0.5, 3600.0, rng)
    assert abs(drawn.mean() / 3600.0 - 1) < 0.03
    # found at a random time, a Weibull(0.5) session has E[X^2] / (2 E[X]) = 3 means left on average
    residual = churn.residual_sessions(50_000, 0.5, 3600.0, rng)
    assert 2.5 < residual.mean() / 3600.0 < 3.5


def test_arrivals_keep_the_swarm_about_its_size() -> None:
    swarm = churn.make_swarm(200, 2.0, 0.5, 4.0, seed=2)
    arrived = int((swarm.arrive_s >= 0).sum())
    assert 70 < arrived < 130  # Poisson with mean 200 peers / 4 h x 2 h = 100
    assert list(swarm.ids) == sorted(swarm.ids)
    assert (swarm.leave_s > swarm.arrive_s).all()


def test_policies_parse_and_refuse_nonsense() -> None:
    assert churn.parse_policy("300:0.05:repair:wait") == churn.Policy(300.0, 0.05, "repair", "wait")
    for bad in ("300:0.05:repair", "0:0.1:solve:solve", "60:1.5:solve:solve", "60:0.1:fix:wait"):
        with pytest.raises(Exception):
            churn.parse_policy(bad)


def test_the_chosen_policy_is_the_coordinators_default() -> None:
    from hetpeer.coordinator.config import CoordinatorConfig

    defaults = CoordinatorConfig.__dataclass_fields__
    assert churn.CHOSEN.replan_interval_s == defaults["replan_interval_s"].default
    assert churn.CHOSEN.gain == defaults["gain"].default
    assert churn.CHOSEN in churn.DEFAULT_POLICIES and churn.BEFORE in churn.DEFAULT_POLICIES


def test_peers_at_home_talk_through_the_relays_of_the_public_peers_seen() -> None:
    """Half the peers behind symmetric NATs: their pairs go through a public peer's relay; with that relay gone
    (not seen), its peers register at another; a default swarm stays all public."""
    swarm = churn.make_swarm(40, 0.05, 0.5, 6.0, seed=2, public=0.5, cone=0.0)
    assert set(np.unique(swarm.kinds)) == {PUBLIC, SYMMETRIC}
    seen = np.arange(len(swarm.ids))[:40]
    problem = churn.problem_over(swarm, seen, None)
    relays = problem.relays
    nat = np.flatnonzero(swarm.kinds[seen] == SYMMETRIC)
    assert relays is not None and (relays.via[np.ix_(nat, nat)][~np.eye(len(nat), dtype=bool)] >= 0).all()
    assert all(swarm.kinds[seen][problem.device_ids.index(r)] == PUBLIC for r in relays.names)
    gone = problem.device_ids.index(relays.names[0])
    fewer = churn.problem_over(swarm, np.delete(seen, gone), None)
    assert relays.names[0] not in fewer.relays.names and fewer.relays.via.max() >= 0
    assert (churn.make_swarm(8, 0.05, 0.5, 6.0, seed=1).kinds == PUBLIC).all()
    assert churn.problem_over(churn.make_swarm(8, 0.05, 0.5, 6.0, seed=1), np.arange(8), None).relays is None
