"""The training recipe as the command line gives it: a file, `--set` after it and the shorthands, into the plan
`hetpeer launch` runs, whose schedule the peers' optimizer follows; the training options peers took before are
refused in one line naming the recipe's field."""

from __future__ import annotations

import pytest

from hetpeer.cli import build_parser, main
from hetpeer.cli.common import ORGANIZER_FLAGS, recipe_from
from hetpeer.peer.gossip.adam import AdamConfig
from hetpeer.protocol.recipe import Recipe


def test_a_recipe_file_then_each_setting_in_order_make_the_schedule_the_optimizer_follows(tmp_path):
    (tmp_path / "recipe.toml").write_text("lr = 2e-3\nwarmup_steps = 5\ndecay_steps = 50\nbetas = [0.9, 0.99]\n")
    args = build_parser().parse_args(["coordinator", "--swarm", "s", "--recipe", str(tmp_path / "recipe.toml"),
                                      "--set", "lr=1e-3", "--set", "lr=2e-3", "--eval-every", "10"])
    recipe = recipe_from(args)
    assert (recipe.lr, recipe.betas, recipe.eval_every, recipe.clip_norm) == (2e-3, (0.9, 0.99), 10, 1.0)
    adam = AdamConfig.of(recipe)
    assert (adam.warmup_steps, adam.decay_steps, adam.clip_norm) == (5, 50, 1.0)
    assert adam.lr_at(5) == 2e-3 and adam.lr_at(50) == adam.lr_at(80) == pytest.approx(2e-4)
    assert AdamConfig.of(Recipe()).decay_steps is None and AdamConfig.of(Recipe()).lr_at(1000) == Recipe().lr


@pytest.mark.parametrize("flag", sorted(ORGANIZER_FLAGS))
@pytest.mark.parametrize("command", [["join", "--swarm", "s"], ["join", "--plan", "p.json", "--as", "d", "--peers", "a.json"],
                                     ["launch"]])
def test_a_peer_refuses_a_training_option_naming_the_recipe_field_that_sets_it(command, flag, capsys):
    assert main([*command, flag, "1"]) == 2
    error = capsys.readouterr().err
    assert f"{flag} is the organizer's" in error and f"--set {ORGANIZER_FLAGS[flag]}=VALUE" in error
    assert len(error.strip().splitlines()) == 1


@pytest.mark.parametrize("text, field", [("lr", "recipe.lr"), ("nope=1", "recipe.nope"), ("warmup_steps=2.5", "recipe.warmup_steps"),
                                         ("betas=0.9", "recipe.betas"), ("topology=star", "recipe.topology"),
                                         ("decay_steps=5", "recipe.decay_steps")])
def test_a_bad_setting_is_refused_naming_its_field(text, field, capsys):
    args = ["coordinator", "--print-recipe", "--set", "warmup_steps=10", "--set", text]
    assert main(args) == 2
    assert field in capsys.readouterr().err
