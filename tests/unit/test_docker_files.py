"""The container files and the swarm's documented commands are what the CLI accepts (no Docker engine
needed: the files are read, their `hetpeer` commands parsed with the real parser)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from hetpeer.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
PLAUSIBLE = {
    "HETPEER_COORDINATOR_KEY": "227589eb829af4308457c73f413bbec25bed31972677319fd300da405b61149e",
    "HETPEER_INITIAL_PEERS": "/dns4/coordinator/tcp/31337/p2p/12D3KooWJ3bHAf2PgnY6i3btRPVaUxCGXLyQ6AzXL2PvQeVSJ4r1",
    "HETPEER_SWARM": "docker",
    "HETPEER_IMAGE": "hetpeer:latest",
    "HETPEER_API_PORT": "50051",
    "HETPEER_SLOWDOWN": "1",
    "HETPEER_PEER3_SLOWDOWN": "2",
}
VARIABLE = re.compile(r"\$\{(\w+)(?::?[-?][^}]*)?\}|\$(\w+)")


def substitute(text: str) -> str:
    """Compose/shell variables replaced by plausible values (every variable used must be known here)."""
    return VARIABLE.sub(lambda m: PLAUSIBLE[m.group(1) or m.group(2)], text)


def parses(argv: list[str]) -> None:
    try:
        build_parser().parse_args(argv)
    except SystemExit as error:  # argparse reports a bad command by exiting
        pytest.fail(f"`hetpeer {shlex.join(argv)}` does not parse (exit {error.code})")


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def dockerfile() -> list[str]:
    """Instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (DOCKER / "Dockerfile").read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_compose_runs_a_coordinator_and_peers_on_one_image():
    services = compose()["services"]
    assert "coordinator" in services
    peers = [name for name in services if name != "coordinator"]
    assert len(peers) >= 2
    for name, service in services.items():
        assert service["image"] == services["coordinator"]["image"]
    assert services["coordinator"]["build"]["dockerfile"] == "docker/Dockerfile"
    assert (DOCKER / services["coordinator"]["build"]["context"] / "docker" / "Dockerfile").is_file()


@pytest.mark.parametrize("name", [n for n in compose()["services"]])
def test_every_compose_command_parses(name):
    command = compose()["services"][name]["command"]
    argv = [substitute(arg) for arg in command] if isinstance(command, list) else shlex.split(substitute(command))
    parses(argv)


def test_the_compose_swarm_is_wired_together():
    """One step: the coordinator writes the join file into a volume the peers read; nothing set by hand."""
    services = compose()["services"]
    args = build_parser().parse_args([substitute(a) for a in services["coordinator"]["command"]])
    assert args.command == "coordinator" and args.host_maddr.startswith("/ip4/0.0.0.0/") and args.api.startswith("0.0.0.0:")
    dht_port = args.host_maddr.rsplit("/", 1)[1]
    assert args.announce_maddr == [f"/dns4/coordinator/tcp/{dht_port}"]  # what the join file hands the peers
    volumes = {v.split(":")[1]: v.split(":")[0] for v in services["coordinator"]["volumes"]}
    assert volumes[str(args.home)] == "coordinator"  # a stable key and DHT identity
    shared = volumes[str(args.join_file.parent)]
    assert args.min_peers == len(services) - 1
    homes = set()
    for name, service in services.items():
        if name == "coordinator":
            continue
        peer = build_parser().parse_args([substitute(a) for a in service["command"]])
        assert peer.command == "join" and peer.join_file == args.join_file and peer.coordinator_key is None
        assert peer.swarm is None and peer.initial_peers == []  # from the join file
        assert f"{shared}:{args.join_file.parent}:ro" in service["volumes"]
        assert peer.name == name and peer.announce_host == name  # what the other containers resolve
        assert peer.dht_announce == [f"/dns4/{name}/tcp/{peer.dht_listen.rsplit('/', 1)[1]}"]
        assert peer.listen.startswith("0.0.0.0:") and peer.dht_listen.startswith("/ip4/0.0.0.0/")
        assert f"{name}:{peer.home}" in service["volumes"]
        homes.add(name)
        assert "coordinator" in service["depends_on"]
    assert len(homes) == len(services) - 1  # one key per peer
    assert set(compose()["volumes"]) == {v.split(":")[0] for s in services.values() for v in s["volumes"]}


def test_the_dockerfile_installs_cpu_torch_before_the_project():
    lines = dockerfile()
    assert lines[0] == "ARG BASE=python:3.11-slim"  # what a plain `docker build` starts from
    final = max(i for i, line in enumerate(lines) if line.startswith("FROM "))
    assert lines[final] == "FROM ${BASE}"
    lines = lines[final:]  # the stage that becomes the image
    runs = [i for i, line in enumerate(lines) if line.startswith("RUN ")]
    torch = [i for i in runs if "torch==2.13.0" in lines[i]]
    project = [i for i in runs if re.search(r"pip install (\S+ )*\.( |$)", lines[i])]
    assert torch and project and torch[0] < project[0]
    # from the wheels and no index at all, or else from the CPU index: never PyPI's CUDA build
    assert "pip install --no-index --find-links /tmp/wheels torch==2.13.0" in lines[torch[0]]
    assert "pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0" in lines[torch[0]]
    wheels = [i for i, line in enumerate(lines) if line.startswith("COPY ") and line.endswith(" /tmp/wheels/")]
    assert wheels and wheels[0] < torch[0]
    # editing the project, pyproject.toml included, does not reinstall torch
    copies = [i for i, line in enumerate(lines) if line.startswith("COPY ") and ("hetpeer" in line or "pyproject.toml" in line)]
    assert copies and torch[0] < min(copies) and max(copies) < project[0]
    assert "--no-deps" in lines[project[0]]  # and does not reach for an index


def test_the_dockerfile_entrypoint_is_hetpeer_and_its_commands_parse():
    lines = dockerfile()
    entry = [json.loads(line.removeprefix("ENTRYPOINT ")) for line in lines if line.startswith("ENTRYPOINT ")]
    assert entry == [["hetpeer"]]
    env = dict(word.split("=", 1) for line in lines if line.startswith("ENV ") for word in shlex.split(line)[1:])
    assert env["PYTHONUNBUFFERED"] == "1"
    venv = env["VIRTUAL_ENV"]
    assert env["PATH"].split(":")[0] == f"{venv}/bin"  # where pip puts the `hetpeer` the entrypoint names
    assert any(f"python3 -m venv {venv}" in line for line in lines if line.startswith("RUN "))
    for line in lines:
        if line.startswith("CMD "):
            parses_or_help(json.loads(line.removeprefix("CMD ")))
    for line in lines:
        for command in re.findall(r"(?:^|&&\s*)hetpeer ([^&]+)", line.removeprefix("RUN ")):
            parses_or_help(shlex.split(command))


def parses_or_help(argv: list[str]) -> None:
    """`--help` and `--version` exit 0 by design; anything else must parse."""
    if argv and argv[0] in ("--help", "--version"):
        with pytest.raises(SystemExit) as done:
            build_parser().parse_args(argv)
        assert done.value.code == 0
    else:
        parses(argv)


# Placeholders the docs write in capitals, where the option only takes certain values.
PLACEHOLDER_VALUES = {("--scenario", "NAME"): "regional"}


def fill_placeholders(argv: list[str]) -> list[str]:
    return [PLACEHOLDER_VALUES.get((before, arg), arg) for before, arg in zip([""] + argv, argv)]


def documented_commands(path: Path) -> list[list[str]]:
    """`hetpeer ...` commands in a markdown file's code blocks (indented or fenced), continuation lines
    joined, shell variables substituted, stopped at a redirection or a comment."""
    commands, fenced, lines = [], False, path.read_text().splitlines()
    text = []
    for line in lines:
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            text.append(line.strip())
        else:
            text.append("")
    joined = re.sub(r"\\\n", " ", "\n".join(text))
    for line in joined.splitlines():
        # `hetpeer ARGS`, and the image's entrypoint given ARGS: `docker run ... hetpeer:latest ARGS`,
        # `docker compose run ... SERVICE ARGS`
        found = re.search(r"(?:^|&&\s*)hetpeer (.*)", line) or re.match(r"docker run .*?hetpeer:latest (.*)", line)
        found = found or re.match(r"docker compose run (?:-\S+ )*\S+ (.*)", line)
        if found is None:
            continue
        argv = shlex.split(substitute(found.group(1)), comments=True)
        argv = argv[: next((i for i, a in enumerate(argv) if a in (">", "|", "&&")), len(argv))]
        commands.append(fill_placeholders(argv))
    return commands


DOCUMENTED = [ROOT / "docs" / "swarm.md", ROOT / "docs" / "data.md", ROOT / "README.md", DOCKER / "README.md"]


@pytest.mark.parametrize("path", DOCUMENTED, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_documented_commands_parse(path):
    commands = documented_commands(path)
    assert commands, f"no hetpeer command found in {path}"
    for argv in commands:
        parses(argv)


def test_the_readme_keeps_its_two_commands():
    text = (ROOT / "README.md").read_text()
    assert "    pip install torch==2.13.0 -e . && hetpeer swarm\n" in text
    assert '    pip install torch==2.13.0 -e ".[test]" && python -m pytest -q tests\n' in text  # .ci/run runs it
