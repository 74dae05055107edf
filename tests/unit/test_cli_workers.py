"""`--workers` as `plan` and `coordinator` take it: by default the cores the process may use, at most
`MAX_DEFAULT_WORKERS` (each worker is a process with its own copy of the swarm's matrices); a count below one is
refused by name."""

from __future__ import annotations

import os

import pytest

from hetpeer.cli import build_parser, common

COMMANDS = [["plan", "--scenario", "regional"], ["coordinator", "--swarm", "s"]]


@pytest.mark.parametrize("cores, expected", [(1, 1), (2, 2), (8, 8), (64, 8)])
def test_the_default_is_the_cores_the_process_may_use_up_to_a_cap(monkeypatch, cores, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert common.default_workers() == expected


@pytest.mark.parametrize("command", COMMANDS)
def test_plan_and_coordinator_take_a_count_and_refuse_zero(command, capsys):
    parser = build_parser()
    assert parser.parse_args(command).workers == common.default_workers()
    assert parser.parse_args([*command, "--workers", "3"]).workers == 3
    with pytest.raises(SystemExit) as refused:
        parser.parse_args([*command, "--workers", "0"])
    assert refused.value.code == 2 and "--workers" in capsys.readouterr().err
