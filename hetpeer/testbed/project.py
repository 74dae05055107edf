"""The testbed's compose project, built from a topology file (pure: no Docker here).

One container per device and one for the coordinator, on a network of their own with fixed addresses.
Each device's container shapes what it sends, per destination, to the topology's bandwidth times
`scale` (htb classes selected by u32 filters on the destination address, each with a short byte FIFO,
which needs NET_ADMIN); the kernel here cannot add latency (no netem), so the topology's latency is
added by the peer's transport (`--emulate-latency`, one way, per destination address). Compute follows
the device's TFLOPS: the fastest device runs at `slowdown` times this machine's speed, a device half as
fast at twice that. Memory follows the device's `memory_gb`: its container is limited to that much. Peers then measure their links with their own probes and the coordinator plans
from what they measured, as in a swarm of real hosts.

A device with a `nat` kind sits behind a router container of its own: the device on a private network
(`lan-<device>`, which Docker keeps apart from the others) that only its router joins, the router on the shared network doing
MASQUERADE (`--random-fully` for "symmetric"), forwarding what the device sends and the answers, and
nothing else towards it. Such a peer joins with no address flag, as a volunteer at home would.

Layout of the project folder: `compose.yaml`, `run/<service>.sh` (each container's start: its shaping,
then `hetpeer`), `homes/<service>/` (keys, kept across restarts), `swarm/join.json` (written by the
coordinator, read by the peers).
"""

from __future__ import annotations

import ipaddress
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetpeer.protocol.topology import Device, Topology
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload

COORDINATOR = "coordinator"
API_PORT = 50051  # inside the coordinator's container
HTTP_PORT = 8080  # the dashboard, inside the coordinator's container
DHT_PORT, PEER_DHT_PORT, TENSOR_PORT = 31337, 31338, 7000
INTERFACE = "eth0"
QUEUE_S = 0.01  # each shaped class queues at most this long at its rate (and at least MIN_QUEUE_BYTES)
MIN_QUEUE_BYTES = 200_000  # three segments of 64 KiB: a queue shorter than one offloaded segment drops them all
SERVICE_RE = re.compile(r"[^a-z0-9]+")
SHM_BYTES = 2 * 2**30
ROUTER_SUFFIX = "-nat"  # a NATed device's router service: <device service>-nat


class TestbedError(ValueError):
    """A testbed that cannot be built as asked."""

    __test__ = False  # not a pytest test class


@dataclass(frozen=True, slots=True)
class TestbedConfig:
    __test__ = False  # not a pytest test class

    topology: Topology
    out: Path
    scale: float = 1.0  # every link's bandwidth times this
    slowdown: float = 1.0  # the fastest device's compute slowdown; slower devices in proportion to their TFLOPS
    emulate_latency: bool = True
    image: str = "hetpeer:latest"
    project: str = "hetpeer-testbed"
    subnet: str = "10.213.0.0/24"
    lan_subnets: str = "10.214.0.0/16"  # one /24 of it per NATed device, in device order
    api_port: int = 50051  # published on 127.0.0.1
    http_port: int = 8080  # the dashboard, published on 127.0.0.1
    swarm: str = "testbed"
    model: str = "tiny"
    batch: int = 16
    micro_batch: int = 2
    dtype: str = "fp32"
    heartbeat_s: float = 2.0
    steps: int | None = None
    coordinator_args: tuple[str, ...] = ()  # more `hetpeer coordinator` options
    peer_args: tuple[str, ...] = ()  # more `hetpeer join` options, for every peer

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise TestbedError(f"scale must be a positive number, got {self.scale}")
        if not (math.isfinite(self.slowdown) and self.slowdown >= 1):
            raise TestbedError(f"slowdown must be a number >= 1, got {self.slowdown}")
        try:
            network = ipaddress.ip_network(self.subnet)
        except ValueError as error:
            raise TestbedError(f"subnet: {error}") from None
        if network.version != 4:
            raise TestbedError(f"subnet must be IPv4 (tc filters match IPv4 destinations), got {self.subnet}")
        if network.num_addresses - 3 < len(self.topology.devices) + 1:
            raise TestbedError(f"subnet {self.subnet} has no room for {len(self.topology.devices) + 1} containers")
        nated = sum(d.nat != "none" for d in self.topology.devices)
        try:
            lans = ipaddress.ip_network(self.lan_subnets)
        except ValueError as error:
            raise TestbedError(f"lan_subnets: {error}") from None
        if nated and (lans.version != 4 or lans.prefixlen > 24 or 2 ** (24 - lans.prefixlen) < nated or lans.overlaps(network)):
            raise TestbedError(f"lan_subnets {self.lan_subnets} must be IPv4 with room for {nated} /24 network(s), "
                               f"apart from {self.subnet}")
        if any(d.tflops is None for d in self.topology.devices):
            missing = [d.id for d in self.topology.devices if d.tflops is None][:3]
            raise TestbedError(f"every device needs tflops (the compute it emulates); missing for {', '.join(missing)}")
        names = [service_name(d.id) for d in self.topology.devices]
        if len(set(names)) != len(names) or COORDINATOR in names:
            raise TestbedError(f"device ids must stay distinct as service names (a-z, 0-9, -) and not be "
                               f"{COORDINATOR!r}: {', '.join(sorted(names))}")
        for what, port in (("api", self.api_port), ("http", self.http_port)):
            if not 0 < port < 65536:
                raise TestbedError(f"{what} port must be 1-65535, got {port}")
        if self.api_port == self.http_port:
            raise TestbedError(f"the API and the dashboard need two ports, got {self.api_port} for both")
        try:
            Workload(preset(self.model), batch=self.batch, micro_batch=self.micro_batch, dtype=self.dtype)
        except ValueError as error:
            raise TestbedError(str(error)) from None

    @property
    def addresses(self) -> dict[str, str]:
        """Service name -> IPv4 address on the shared network: the coordinator first (after the gateway), then each
        device in order, or for a device behind NAT its router."""
        hosts = ipaddress.ip_network(self.subnet).hosts()
        next(hosts)  # the gateway: Docker's bridge
        names = [COORDINATOR] + [service_name(d.id) + (ROUTER_SUFFIX if d.nat != "none" else "") for d in self.topology.devices]
        return {name: str(next(hosts)) for name in names}

    def public_address(self, device: Device) -> str:
        """Where others see `device`: its own address, or behind NAT its router's."""
        return self.addresses[service_name(device.id) + (ROUTER_SUFFIX if device.nat != "none" else "")]

    @property
    def lans(self) -> dict[str, tuple[str, str, str]]:
        """NATed device's service name -> (its private /24, its router's address there, its own address there)."""
        subnets = ipaddress.ip_network(self.lan_subnets).subnets(new_prefix=24)
        found = {}
        for device in (d for d in self.topology.devices if d.nat != "none"):
            subnet = next(subnets)
            found[service_name(device.id)] = (str(subnet), str(subnet[2]), str(subnet[3]))  # .1: Docker's bridge
        return found


def service_name(device_id: str) -> str:
    """A device id as a compose service (and host) name: lower-case a-z, 0-9 and -."""
    return SERVICE_RE.sub("-", device_id.lower()).strip("-") or "device"


def peer_name(device_id: str) -> str:
    """A device id as a peer's `--name` (a-z, 0-9, _; at most 24)."""
    return SERVICE_RE.sub("_", device_id.lower()).strip("_")[:24] or "device"


def slowdowns(config: TestbedConfig) -> dict[str, float]:
    fastest = max(d.tflops for d in config.topology.devices)
    return {d.id: config.slowdown * fastest / d.tflops for d in config.topology.devices}


def memory_limits(config: TestbedConfig) -> dict[str, int]:
    """Service name -> its container's memory limit in bytes: the device's `memory_gb` (1e9 bytes), for
    the devices that state one. A peer reads the limit as its free memory, as on a GPU of that size."""
    return {service_name(d.id): int(d.memory_gb * 1e9) for d in config.topology.devices if d.memory_gb is not None}


def shaping(config: TestbedConfig, device: Device) -> list[str]:
    """The `tc` commands that shape what `device` sends: one htb class per other device, at the topology's
    bandwidth times the scale, its queue bounded in bytes. Traffic to anyone else (the coordinator, the
    host) matches no filter and leaves unshaped."""
    commands = [f"tc qdisc replace dev {INTERFACE} root handle 1: htb default 1 r2q 1000"]
    for j, other in enumerate(config.topology.devices):
        if other.id == device.id:
            continue
        rate_bits = config.topology.link(device, other).bandwidth_gbps * 1e9 * config.scale
        queue_bytes = max(MIN_QUEUE_BYTES, int(rate_bits / 8 * QUEUE_S))
        classid = f"1:{j + 10:x}"
        commands += [
            f"tc class add dev {INTERFACE} parent 1: classid {classid} htb rate {int(rate_bits)}bit ceil {int(rate_bits)}bit quantum 60000",
            f"tc qdisc add dev {INTERFACE} parent {classid} bfifo limit {queue_bytes}",
            f"tc filter add dev {INTERFACE} protocol ip parent 1: prio 1 u32 match ip dst "
            f"{config.public_address(other)}/32 flowid {classid}",
        ]
    return commands


def latencies(config: TestbedConfig, device: Device) -> dict[str, float]:
    """Destination address -> one-way milliseconds, for `--emulate-latency`."""
    return {
        config.public_address(other): config.topology.link(device, other).latency_ms
        for other in config.topology.devices if other.id != device.id
    }


def coordinator_command(config: TestbedConfig) -> list[str]:
    ip = config.addresses[COORDINATOR]
    command = [
        "hetpeer", "coordinator", "--swarm", config.swarm, "--home", "/data", "--join-file", "/swarm/join.json",
        "--host-maddr", f"/ip4/0.0.0.0/tcp/{DHT_PORT}", "--announce-maddr", f"/ip4/{ip}/tcp/{DHT_PORT}",
        "--api", f"0.0.0.0:{API_PORT}", "--http", f"0.0.0.0:{HTTP_PORT}", "--min-peers", str(len(config.topology.devices)),
        "--heartbeat", repr(config.heartbeat_s), "--model", config.model, "--batch", str(config.batch),
        "--micro-batch", str(config.micro_batch), "--dtype", config.dtype,
        "--workers", "1",  # the containers share this machine's cores: the peers have them
    ]
    if config.steps is not None:
        command += ["--steps", str(config.steps)]
    return command + list(config.coordinator_args)


def peer_command(config: TestbedConfig, device: Device) -> list[str]:
    command = ["hetpeer", "join", "--join-file", "/swarm/join.json", "--name", peer_name(device.id), "--home", "/data"]
    if device.nat == "none":
        ip = config.public_address(device)
        command += ["--listen", f"0.0.0.0:{TENSOR_PORT}", "--announce-host", ip, "--dht-listen", f"/ip4/0.0.0.0/tcp/{PEER_DHT_PORT}",
                    "--dht-announce", f"/ip4/{ip}/tcp/{PEER_DHT_PORT}"]
    command += ["--threads", "1", "--heartbeat", repr(config.heartbeat_s), "--slowdown", f"{slowdowns(config)[device.id]:.6g}"]
    if config.emulate_latency:
        command += ["--emulate-latency", ",".join(f"{host}={ms:g}" for host, ms in latencies(config, device).items())]
    if config.steps is not None:
        command += ["--steps", str(config.steps)]
    return command + list(config.peer_args)


def script(commands: list[str], then: list[str]) -> str:
    lines = ["#!/bin/sh", "# written by `hetpeer testbed`: this container's links, then its hetpeer process", "set -e"]
    return "\n".join(lines + commands + ["exec " + shlex.join(then)]) + "\n"


def routing(config: TestbedConfig, device: Device) -> list[str]:
    """A NATed device's route out: through its router, not Docker's bridge."""
    if device.nat == "none":
        return []
    _, router, _ = config.lans[service_name(device.id)]
    return [f"ip route replace default via {router}"]


def router_commands(config: TestbedConfig, device: Device) -> list[str]:
    """A home router for `device`: masquerade what its network sends out, let the answers back, nothing else in;
    what arrives unasked is dropped without an answer (as home routers do: hole punching relies on it)."""
    lan, _, _ = config.lans[service_name(device.id)]
    ports = " --random-fully" if device.nat == "symmetric" else ""
    return [
        f"iptables -t nat -A POSTROUTING -s {lan} ! -d {lan} -j MASQUERADE{ports}",
        "iptables -P FORWARD DROP",
        f"iptables -A FORWARD -s {lan} -j ACCEPT",
        "iptables -A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
        f"iptables -A INPUT ! -s {lan} -m conntrack --ctstate NEW,INVALID -j DROP",
    ]


def scripts(config: TestbedConfig) -> dict[str, str]:
    """Service name -> the script its container runs."""
    found = {COORDINATOR: script([], coordinator_command(config))}
    for device in config.topology.devices:
        name = service_name(device.id)
        found[name] = script(routing(config, device) + shaping(config, device), peer_command(config, device))
        if device.nat != "none":
            found[name + ROUTER_SUFFIX] = script(router_commands(config, device), ["sleep", "infinity"])
    return found


def compose_project(config: TestbedConfig) -> dict[str, Any]:
    """The compose file, as data. Paths are relative to the project folder (where it is written)."""
    addresses, lans = config.addresses, config.lans
    routers = {name.removesuffix(ROUTER_SUFFIX) for name in addresses if name.endswith(ROUTER_SUFFIX)}
    services: dict[str, Any] = {}
    for name in scripts(config):
        service: dict[str, Any] = {
            "image": config.image,
            "entrypoint": ["/bin/sh", f"/testbed/run/{name}.sh"],
            "volumes": ["./run:/testbed/run:ro", f"./homes/{name}:/data", f"./swarm:/swarm{'' if name == COORDINATOR else ':ro'}"],
            "networks": {"wan": {"ipv4_address": addresses[name]}} if name in addresses else {},
            "init": True,
        }
        if name == COORDINATOR:
            service["ports"] = [f"127.0.0.1:{config.api_port}:{API_PORT}", f"127.0.0.1:{config.http_port}:{HTTP_PORT}"]
        elif name.endswith(ROUTER_SUFFIX):
            device = name.removesuffix(ROUTER_SUFFIX)
            service["networks"][f"lan-{device}"] = {"ipv4_address": lans[device][1]}
            service["cap_add"] = ["NET_ADMIN"]
            service["sysctls"] = {"net.ipv4.ip_forward": 1}
            service["volumes"] = ["./run:/testbed/run:ro"]
        else:
            if name in routers:
                service["networks"] = {f"lan-{name}": {"ipv4_address": lans[name][2]}}
                service["depends_on"] = [COORDINATOR, name + ROUTER_SUFFIX]
            else:
                service["depends_on"] = [COORDINATOR]
            service["cap_add"] = ["NET_ADMIN"]
            # a host's /dev/shm, not Docker's 64 MB: torch.multiprocessing (hivemind's averager among
            # others) passes tensors through it; what is written there counts against the memory limit
            service["shm_size"] = SHM_BYTES
            if (limit := memory_limits(config).get(name)) is not None:
                service["mem_limit"] = service["memswap_limit"] = limit  # no swap: the limit is the device's memory
        services[name] = service
    networks: dict[str, Any] = {"wan": {"ipam": {"config": [{"subnet": config.subnet}]}}}
    for name, (lan, _, _) in lans.items():
        # not `internal`: Docker would drop what the device sends its router for the world (bridged frames pass the
        # host's iptables); the device's route goes to its router, and Docker keeps other networks off this one
        networks[f"lan-{name}"] = {"ipam": {"config": [{"subnet": lan}]}}
    return {"services": services, "networks": networks}


def write(config: TestbedConfig) -> Path:
    """Write the project folder; the compose file's path."""
    import yaml

    out = config.out
    (out / "run").mkdir(parents=True, exist_ok=True)
    (out / "swarm").mkdir(exist_ok=True)
    (out / "swarm" / "join.json").unlink(missing_ok=True)  # a former run's: peers wait for this run's coordinator
    for name, text in scripts(config).items():
        (out / "homes" / name).mkdir(parents=True, exist_ok=True)
        (out / "run" / f"{name}.sh").write_text(text)
    path = out / "compose.yaml"
    header = f"# the testbed of {config.topology.name or 'a topology'}: written by `hetpeer testbed`\n"
    path.write_text(header + yaml.safe_dump(compose_project(config), sort_keys=False, width=120))
    return path
