"""The `hetpeer` command. Thin: builds the parser from the command modules, runs the chosen command, and turns
user errors into one line on stderr and exit code 2.

`common` is below every command module; a command module (`plan`, `peer`, `swarm`, `data`, `testbed`) imports
`common` and the rest of hetpeer, never another command module. What runs a command is imported when it runs:
`hetpeer --version` and `hetpeer plan` never load torch or hivemind (the planner is pure), and building the
parser loads nothing heavier than numpy."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from hetpeer import __version__
from hetpeer.cli import data, peer, plan, swarm, testbed
from hetpeer.cli.common import UserError
from hetpeer.protocol.wire import SchemaError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, like every other user error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hetpeer", description="Train foundation models on volunteer GPUs over slow, uneven links.")
    parser.add_argument("--version", action="version", version=f"hetpeer {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for family in (plan, peer, swarm, data, testbed):  # in the order `hetpeer --help` lists them
        family.add_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (UserError, SchemaError) as error:
        print(f"hetpeer {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"hetpeer {args.command}: interrupted", file=sys.stderr)
        return 130
