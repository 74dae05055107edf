"""The learning-rate schedule as the command line gives it: `hetpeer launch` passes it on to each `hetpeer join`,
which builds the optimizer's settings from it."""

from __future__ import annotations

from hetpeer.cli import build_parser
from hetpeer.cli.common import run_options_argv
from hetpeer.cli.peer import _worker_config


def test_launch_passes_the_schedule_on_and_join_builds_it():
    parser = build_parser()
    launched = parser.parse_args(["launch", "plan.json", "--lr", "2e-3", "--warmup-steps", "5", "--decay-steps", "50"])
    joined = parser.parse_args(["join", *run_options_argv(launched)])
    adam = _worker_config(joined).adam
    assert (adam.lr, adam.warmup_steps, adam.decay_steps) == (2e-3, 5, 50)
    assert adam.lr_at(5) == 2e-3 and adam.lr_at(50) == adam.lr_at(80) == 2e-4
    plain = _worker_config(parser.parse_args(["join", *run_options_argv(parser.parse_args(["launch", "plan.json"]))])).adam
    assert (plain.warmup_steps, plain.decay_steps) == (0, None) and plain.lr_at(1000) == plain.lr
