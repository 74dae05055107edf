"""`--outer-every` as `plan`, `coordinator` and `swarm` take it (auto, the default, a number of steps or never), what
`swarm` hands its coordinator, and the outer optimizer's settings in the recipe; anything else is refused by name."""

from __future__ import annotations

import pytest

from hetpeer.cli import build_parser, main
from hetpeer.cli.common import outer_every_choice, outer_every_text, recipe_from

COMMANDS = [["plan", "--scenario", "regional"], ["coordinator", "--swarm", "s"], ["swarm"]]


@pytest.mark.parametrize("command", COMMANDS)
def test_outer_steps_are_the_planners_choice_unless_forbidden_or_fixed(command):
    parser = build_parser()
    assert parser.parse_args(command).outer_every == 0  # auto
    assert parser.parse_args([*command, "--outer-every", "never"]).outer_every is None
    assert parser.parse_args([*command, "--outer-every", "50"]).outer_every == 50


@pytest.mark.parametrize("value", ["auto", "never", "1", "50", "10000"])
def test_a_choice_written_back_reads_as_the_same_choice(value):
    assert outer_every_text(outer_every_choice(value)) == value


@pytest.mark.parametrize("value", ["0", "-5", "10001", "50.5", "Auto", "none", ""])
def test_a_number_of_steps_out_of_range_is_refused_naming_the_range(value, capsys):
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(["coordinator", "--swarm", "s", "--outer-every", value])
    assert exit.value.code == 2
    assert "--outer-every" in (error := capsys.readouterr().err) and "1 to 10000" in error and repr(value) in error


def test_the_coordinator_takes_sync_outer_and_a_warm_start_into_its_recipe():
    args = build_parser().parse_args(["coordinator", "--swarm", "s", "--sync", "outer", "--outer-warmup", "0"])
    assert (args.sync, recipe_from(args).outer_after) == ("outer", 0)
    assert recipe_from(build_parser().parse_args(["coordinator", "--swarm", "s"])).outer_after == 100


def test_plan_refuses_outer_steps_with_the_cost_model_that_cannot_count_them(capsys):
    assert main(["plan", "--scenario", "regional", "--cost-model", "dtfm", "--outer-every", "10"]) == 2
    assert "--outer-every N and --sync outer apply to --cost-model time only" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["launch"], ["coordinator", "--swarm", "s", "--print-recipe"], ["plan", "--scenario", "regional"]])
@pytest.mark.parametrize("setting", ["outer_momentum=1.0", "outer_momentum=nan", "outer_lr=-1", "outer_lr=0"])
def test_outer_settings_out_of_range_are_refused_naming_the_recipe_field(command, setting, capsys):
    assert main([*command, "--set", setting]) == 2
    assert f"recipe.{setting.partition('=')[0]}" in capsys.readouterr().err
