"""The organizer's recipe: strict on the wire (an unknown field is named), read from JSON and TOML files with
defaults for what a file leaves out, set field by field from the command line, and what changed between two."""

from __future__ import annotations

import pytest

from hetpeer.protocol.recipe import FIELDS, Recipe, load
from hetpeer.protocol.wire import SchemaError


def test_the_wire_form_round_trips_every_field_and_the_text_form_reads_back(tmp_path):
    recipe = Recipe(lr=1e-3, betas=(0.8, 0.99), clip_norm=0.5, warmup_steps=10, decay_steps=100, topology="ring",
                    accumulate=4, sync_codec="int8", robust=2.0, seed=3, eval_every=5)
    assert set(recipe.to_wire()) == set(FIELDS)
    assert Recipe.from_wire(recipe.to_wire()) == recipe
    (tmp_path / "r.json").write_text(recipe.to_text())
    assert load(tmp_path / "r.json") == recipe


def test_a_file_names_only_what_it_changes_and_toml_reads_like_json(tmp_path):
    (tmp_path / "r.toml").write_text('lr = 6e-4\nbetas = [0.9, 0.95]\ntopology = "complete"\nwarmup_steps = 100\n')
    assert load(tmp_path / "r.toml") == Recipe(lr=6e-4, topology="complete", warmup_steps=100)
    assert load(tmp_path / "r.toml", base=Recipe(seed=9)).seed == 9


@pytest.mark.parametrize("text, path", [
    ('{"lr": 1e-3, "lookahead": 2}', "lookahead"), ('{"lr": "fast"}', "lr"), ('{"warmup_steps": 1.5}', "warmup_steps"),
    ('{"betas": [0.9]}', "betas"), ('{"betas": [0.9, 1.0]}', "betas"), ('{"sync_codec": "zip"}', "sync_codec"),
    ('{"warmup_steps": 10, "decay_steps": 10}', "decay_steps"), ('{"accumulate": 0}', "accumulate"),
    ('{"outer_momentum": 1.0}', "outer_momentum"), ('{"min_lr_ratio": 2}', "min_lr_ratio"), ("[1, 2]", ""),
    ('{"second_moment": "mean"}', "second_moment"), ('{"accumulate": 4, "second_moment": "window"}', "second_moment"),
])
def test_a_bad_file_is_refused_naming_the_file_and_the_field(tmp_path, text, path):
    (tmp_path / "r.json").write_text(text)
    with pytest.raises(SchemaError) as error:
        load(tmp_path / "r.json")
    assert str(tmp_path / "r.json") in str(error.value) and path in str(error.value)


def test_unreadable_and_malformed_files_are_refused_by_name(tmp_path):
    with pytest.raises(SchemaError, match="cannot read the recipe file"):
        load(tmp_path / "missing.json")
    (tmp_path / "r.toml").write_text("lr = = 1")
    with pytest.raises(SchemaError, match="is not TOML"):
        load(tmp_path / "r.toml")
    (tmp_path / "r.json").write_text("{lr: 1}")
    with pytest.raises(SchemaError, match="is not JSON"):
        load(tmp_path / "r.json")


def test_settings_from_the_command_line_and_what_changed():
    recipe = Recipe().with_setting("lr=1e-3").with_setting("betas=0.9,0.99").with_setting("topology = ring")
    assert (recipe.lr, recipe.betas, recipe.topology) == (1e-3, (0.9, 0.99), "ring")
    assert Recipe().with_setting("mix-deadline-s=2").mix_deadline_s == 2.0  # dashes read as underscores
    assert Recipe().changes(recipe) == ["lr 0.0003 -> 0.001", "betas 0.9/0.95 -> 0.9/0.99", "topology one-peer-exp -> ring"]
    assert recipe.changes(recipe) == []
    for bad, field in (("lr", "lr"), ("seed=x", "seed"), ("lr=-1", "lr"), ("nothing=1", "nothing")):
        with pytest.raises(SchemaError, match=f"recipe.{field}"):
            Recipe().with_setting(bad)


def test_the_recipe_in_words_says_what_an_organizer_set():
    assert Recipe().words == "lr 0.0003, betas 0.9/0.95, wd 0.1, clip 1; gossip one-peer-exp, robust 2, checks 2%, seed 0"
    words = Recipe(lr=1e-3, warmup_steps=10, decay_steps=100, clip_norm=0, accumulate=8, robust=0, check=0).words
    assert words == "lr 0.001, warmup 10, cosine to 0.1x at 100, betas 0.9/0.95, wd 0.1, no clipping; gossip one-peer-exp A=8, not robust, no checks, seed 0"
    assert Recipe(second_moment="group").words.endswith("gossip one-peer-exp v=group, robust 2, checks 2%, seed 0")
