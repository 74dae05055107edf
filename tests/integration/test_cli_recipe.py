"""The recipe `hetpeer launch` gives a plan: written into the plan file every peer reads, and followed."""

from __future__ import annotations

import json

from hetpeer.cli import main
from hetpeer.protocol.plan import Plan


def test_launch_writes_its_recipe_into_the_plan_every_peer_reads(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["launch", "--out", str(tmp_path), "--steps", "1", "--set", "lr=2e-3", "--set", "seed=7"]) == 0
    recipe = Plan.from_wire(json.loads(plan.read_text())).recipe
    assert (recipe.lr, recipe.seed) == (2e-3, 7)
    assert "recipe: lr 0.0003 -> 0.002; seed 0 -> 7" in capsys.readouterr().out
