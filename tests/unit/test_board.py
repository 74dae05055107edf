"""What the dashboard serves, as data: the state document (plan links with what was measured, a row for every
peer including planned ones that went quiet, admission and bans) and the Prometheus series."""

from __future__ import annotations

import json
from dataclasses import replace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dashboard_boards import NOW, board, credit_board, make_plan
from hetpeer.coordinator.board import Board, SwarmCollector, plan_links, state
from hetpeer.coordinator.view import SwarmView, route_lines

def test_plan_links_carry_what_either_end_measured():
    links = {(k["from"], k["to"], k["kind"]): k for k in plan_links(make_plan(), board().view.peers)}
    assert set(links) == {("a", "b", "lane"), ("c", "d", "lane"), ("e", "f", "lane"), ("a", "c", "group"),
                          ("c", "e", "group"), ("e", "a", "group"), ("b", "d", "group"), ("d", "f", "group"),
                          ("f", "b", "group")}
    assert links["a", "b", "lane"]["bandwidth_bytes_per_s"] == 5e7 and links["a", "b", "lane"]["latency_s"] == 0.004
    assert links["c", "d", "lane"]["bandwidth_bytes_per_s"] == 3e7  # d's measurement of c
    assert not links["e", "f", "lane"]["measured"] and links["e", "f", "lane"]["estimated"]
    assert not links["b", "d", "group"]["measured"] and not links["b", "d", "group"]["estimated"]


def test_plan_links_and_the_status_say_how_each_pair_talks_and_how_a_failed_one_failed():
    peers = dict(board().view.peers)
    peers["e"] = replace(peers["e"], punched=("c",), unreachable=("f",), unreachable_how=("punch",))
    peers["b"] = replace(peers["b"], relayed=("d",))
    links = {(k["from"], k["to"]): k for k in plan_links(make_plan(), peers)}
    assert (links["a", "b"]["route"], links["a", "b"]["failed"]) == ("direct", None)  # measured, as its record says
    assert links["c", "e"]["route"] == "punched" and links["b", "d"]["route"] == "relayed"
    assert (links["e", "f"]["route"], links["e", "f"]["failed"]) == ("failed", "no hole punched")
    lines = route_lines(make_plan(), peers)
    assert lines[-1] == "e - f failed: no hole punched" and "1 punched" in lines[0] and "1 failed" in lines[0], lines


def test_the_state_document_has_every_peer_and_why_some_are_left_out():
    doc = json.loads(json.dumps(state(board()), allow_nan=False))
    rows = {r["device_id"]: r for r in doc["peers"]}
    assert set(rows) == {"a", "b", "c", "d", "e", "f", "s", "x"}
    assert rows["f"]["state"] == "missing" and (rows["f"]["stage"], rows["f"]["lane"]) == (1, 2)
    assert rows["s"]["standby"] and rows["s"]["device_name"] == "<img src=x onerror=alert(1)>"  # data, drawn as text
    assert rows["s"]["standby_reason"].startswith("too slow: ") and rows["a"]["standby_reason"] is None
    assert rows["x"]["admission"] == "not on the allow-list" and rows["x"]["suspects"] == ["a"]
    assert rows["d"]["admission"].startswith("banned 100 s more: reported by 2 of 2")
    assert rows["a"]["admission"] == "admitted" and rows["a"]["links"] == 2 and rows["a"]["age_s"] == 1.0
    assert doc["progress"]["banned"] == 1 and doc["progress"]["refused"] == 1  # a ban that ran out is not counted
    assert doc["progress"]["loss"] == 3.0 and doc["progress"]["tokens_per_s"] == 150.0  # the last stage's mean, sum
    assert doc["plan"]["predicted_step_s"] == 0.25 and doc["plan"]["standby"] == ["s"]
    assert doc["plan"]["standby_reasons"] == [[make_plan().standby_reasons[0][0], 1]]
    assert doc["history"]["events"][0]["kind"] == "join" and doc["history"]["plans"][0]["epoch"] == 1


def test_the_state_document_has_the_credit_leaderboard_and_an_empty_one_before_the_ledgers_first_round():
    doc = json.loads(json.dumps(state(board(credit=credit_board())), allow_nan=False))
    assert doc["credit"] == json.loads(json.dumps(credit_board().to_wire()))
    assert [v["name"] for v in doc["credit"]["volunteers"]] == ["ann", "bob", "eve"]
    assert state(board())["credit"] == {"time": NOW, "volunteers": [], "teams": []}


def test_sums_past_the_largest_float_leave_gaps_not_a_broken_document():
    huge = board()
    peers = {**huge.view.peers, "b": replace(huge.view.peers["b"], tokens_per_s=1e308),
             "d": replace(huge.view.peers["d"], tokens_per_s=1e308)}
    huge = replace(huge, view=replace(huge.view, peers=peers))
    doc = json.loads(json.dumps(state(huge), allow_nan=False))
    assert doc["progress"]["tokens_per_s"] is None
    assert ("hetpeer_swarm_tokens_per_second", ()) not in scrape(huge)


def test_without_a_plan_the_document_says_so():
    empty = board(view=SwarmView("demo", "", None, None, {}, 0, NOW))
    doc = state(empty)
    assert doc["plan"] is None and doc["peers"] == [] and doc["progress"]["epoch"] == -1


def scrape(b: Board | None) -> dict:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwarmCollector(lambda: b))
    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_metrics_have_swarm_and_per_peer_series():
    samples = scrape(board())
    assert samples[("hetpeer_swarm_step", ())] == 40
    assert samples[("hetpeer_swarm_tokens_per_second", ())] == 150.0
    assert samples[("hetpeer_swarm_peers", (("state", "training"),))] == 5
    assert samples[("hetpeer_plan_predicted_step_seconds", ())] == 0.25
    assert samples[("hetpeer_plan_lanes", ())] == 3 and samples[("hetpeer_swarm_banned_peers", ())] == 1
    assert samples[("hetpeer_peer_loss", (("peer", "b"),))] == 2.5
    assert samples[("hetpeer_peer_stage", (("peer", "s"),))] == -1
    assert samples[("hetpeer_peer_plan_link_min_bandwidth_bytes_per_second", (("peer", "a"),))] == 5e7  # a-b, not a-c
    assert samples[("hetpeer_peer_plan_link_max_latency_seconds", (("peer", "c"),))] == 0.003  # c-d, as d measured it
    assert ("hetpeer_peer_plan_link_min_bandwidth_bytes_per_second", (("peer", "f"),)) not in samples  # none measured
    info = [labels for (name, labels) in samples if name == "hetpeer_peer_info"]
    assert (("device", "<img src=x onerror=alert(1)>"), ("peer", "s"), ("reachable", "unknown"), ("software", "hetpeer 0.1.0"),
            ("state", "standby")) in info
    assert not any(name == "hetpeer_peer_loss" and labels == (("peer", "a"),) for name, labels in samples)  # none announced
    assert scrape(None) == {}  # before the first round: nothing, not an error
