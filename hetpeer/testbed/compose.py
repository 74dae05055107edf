"""Docker Compose, driven from Python: what `hetpeer testbed`, the compose tests and the testbed benchmark
do to a project (start, kill, restart, cut off, read logs, remove), one `docker` command each.

Compose v2 (`docker compose`) is used where it exists, else v1 (`docker-compose`). Every command's
failure raises `ComposeError` with the command and what it printed.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Sequence

TIMEOUT_S = 300.0


class ComposeError(RuntimeError):
    """A docker or compose command failed, or Docker is not there."""


def run(
    command: Sequence[str], timeout_s: float = TIMEOUT_S, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run a command, its output captured; ComposeError naming it when it is missing, hangs or (with
    `check`) fails. `env` adds to this process's environment."""
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **env} if env else None)
    except FileNotFoundError:
        raise ComposeError(f"{command[0]} is not installed (see docker/README.md)") from None
    except subprocess.TimeoutExpired:
        raise ComposeError(f"`{' '.join(command)}` did not finish within {timeout_s:g} s") from None
    if check and done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise ComposeError(f"`{' '.join(command)}` failed (exit {done.returncode}): {' / '.join(said[-3:])}")
    return done


@functools.cache
def compose_command() -> tuple[str, ...]:
    """`docker compose` (v2) when the docker CLI has it, else `docker-compose` (v1)."""
    if shutil.which("docker") and run(["docker", "compose", "version"], 30, check=False).returncode == 0:
        return ("docker", "compose")
    if shutil.which("docker-compose"):
        return ("docker-compose",)
    raise ComposeError("neither `docker compose` nor `docker-compose` is installed (see docker/README.md)")


def check_docker() -> None:
    """ComposeError, saying what to do, when no Docker engine answers."""
    done = run(["docker", "version", "--format", "{{.Server.Version}}"], 30, check=False)
    if done.returncode != 0:
        raise ComposeError(f"no Docker engine answers (is dockerd running?): {done.stderr.strip().splitlines()[-1:]}")


def image_exists(image: str) -> bool:
    return run(["docker", "image", "inspect", image], 60, check=False).returncode == 0


def used_subnets() -> list[ipaddress.IPv4Network]:
    """The IPv4 subnets of Docker's networks, which a new one must not overlap."""
    ids = run(["docker", "network", "ls", "-q"], 60).stdout.split()
    if not ids:
        return []
    found = []
    for network in json.loads(run(["docker", "network", "inspect", *ids], 60).stdout):
        for config in (network.get("IPAM") or {}).get("Config") or []:
            try:
                subnet = ipaddress.ip_network(config.get("Subnet", ""), strict=False)
            except ValueError:
                continue
            if subnet.version == 4:
                found.append(subnet)
    return found


def free_subnet(within: str = "10.213.0.0/16", prefix: int = 24) -> str:
    """A /`prefix` of `within` that no Docker network uses."""
    used = used_subnets()
    for subnet in ipaddress.ip_network(within).subnets(new_prefix=prefix):
        if not any(subnet.overlaps(other) for other in used):
            return str(subnet)
    raise ComposeError(f"every /{prefix} of {within} is taken by a Docker network")


class Compose:
    """One compose project: `project` names it (container, network and volume names start with it);
    `overrides` are compose files laid over `file`, in order (compose's own merge: a service's `command` in
    one replaces the one before)."""

    def __init__(self, file: Path, project: str, env: dict[str, str] | None = None, overrides: Sequence[Path] = ()) -> None:
        self.file, self.project, self.env = Path(file), project, env or {}
        self.overrides = tuple(Path(o) for o in overrides)

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        files = [arg for path in (self.file, *self.overrides) for arg in ("-f", str(path))]
        return run([*compose_command(), *files, "-p", self.project, *args], check=check, env=self.env)

    def up(self, *services: str) -> None:
        self._run("up", "-d", "--no-build", *services)

    def down(self) -> None:
        """Remove the containers, the network and the project's volumes (also after a failed start)."""
        self._run("down", "-v", "--remove-orphans", "-t", "5", check=False)

    def kill(self, service: str) -> None:
        self._run("kill", service)

    def start(self, service: str) -> None:
        self._run("start", service)

    def stop(self, service: str, timeout_s: int = 20) -> None:
        self._run("stop", "-t", str(timeout_s), service)

    def logs(self, service: str) -> str:
        """What the service's container printed, without compose's `name  | ` prefixes."""
        return _unprefix(self._run("logs", "--no-color", service).stdout)

    def container(self, service: str) -> str:
        """The id of the service's container."""
        found = self._run("ps", "-q", service).stdout.split()
        if not found:
            raise ComposeError(f"service {service} of project {self.project} has no container")
        return found[0]

    def network(self, name: str = "default") -> str:
        """Docker's name for one of the project's networks."""
        return f"{self.project}_{name}"

    def disconnect(self, service: str, network: str = "default") -> None:
        """Cut the service's container off its network, as a pulled cable would."""
        run(["docker", "network", "disconnect", "-f", self.network(network), self.container(service)])

    def connect(self, service: str, network: str = "default") -> None:
        """Plug it back in, under its service name (what the others resolve)."""
        run(["docker", "network", "connect", "--alias", service, self.network(network), self.container(service)])

    def running(self) -> list[str]:
        return self._run("ps", "--services", "--filter", "status=running").stdout.split()


def _unprefix(text: str) -> str:
    """Compose prefixes each log line with `container  | `."""
    return "\n".join(line.split(" | ", 1)[1] if " | " in line else line for line in text.splitlines())
