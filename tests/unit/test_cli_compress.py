"""`--compress` as the commands take it: auto (the planner's choice, per hop), one codec for both directions or
FORWARD/BACKWARD, on `plan`, `coordinator`, `swarm` and `launch` (a fixed plan: no auto); anything else is
refused by name."""

from __future__ import annotations

import pytest

from hetpeer.cli import build_parser
from hetpeer.cli.common import compress_choice, compress_text


@pytest.mark.parametrize("command", [["plan", "--scenario", "regional"], ["coordinator", "--swarm", "s"], ["swarm"],
                                     ["launch"]])  # fmt: skip
def test_one_codec_is_both_directions_and_a_pair_is_forward_then_backward(command):
    parser = build_parser()
    assert parser.parse_args([*command, "--compress", "int8"]).compress == ("int8", "int8")
    assert parser.parse_args([*command, "--compress", "int4/int8"]).compress == ("int4", "int8")
    default = parser.parse_args(command).compress
    if command == ["launch"]:  # no planner: a plan's own codecs are kept, and auto is no choice
        assert default is None
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--compress", "auto"])
    else:
        assert default == ("auto", "auto") == parser.parse_args([*command, "--compress", "auto"]).compress


@pytest.mark.parametrize("value", ["auto", "int8", "int4/int8", "raw"])
def test_a_choice_written_back_reads_as_the_same_choice(value):
    """What `swarm` hands its coordinator on the command line."""
    assert compress_text(compress_choice(value)) == value


@pytest.mark.parametrize("value", ["int3", "int4/int8/raw", "int4/", "INT8", "auto/int8"])
def test_a_codec_not_known_is_refused_naming_the_choices(value, capsys):
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(["plan", "--scenario", "regional", "--compress", value])
    assert exit.value.code == 2
    error = capsys.readouterr().err
    assert "--compress" in error and repr(value) in error and "raw, fp16, bf16, int8, int4" in error


def test_plan_refuses_codecs_with_the_cost_model_that_cannot_count_them(capsys):
    from hetpeer.cli import main

    assert main(["plan", "--scenario", "regional", "--cost-model", "dtfm", "--compress", "int8"]) == 2
    assert "--compress applies to --cost-model time only" in capsys.readouterr().err
