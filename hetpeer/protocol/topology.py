"""The topology file: which devices exist, where they are, and how well they are connected.

Schema (JSON; see docs/topology.md):

    {"name": str?, "description": str?,
     "devices": [{"id": str, "region": str, "tflops": number?, "memory_gb": number?, "nat": str?,
                  "codec_s": {codec: number}?}, ...],
     "regions": {name: {"latency_ms": number, "bandwidth_gbps": number}},     # inside a region
     "region_links": [{"a": region, "b": region, "latency_ms": .., "bandwidth_gbps": ..}],
     "default_link": {"latency_ms": .., "bandwidth_gbps": ..}?,              # unlisted region pairs
     "links": [{"a": device id, "b": device id, "latency_ms": .., "bandwidth_gbps": ..}]?}

A link listed once is symmetric. A link listed in both directions with different values is
averaged, as Yuan et al. (NeurIPS 2022) do for asymmetric measurements. Device-level `links`
override region values. Bandwidth is in Gbit/s (1e9 bit/s), latency in milliseconds. A device's `nat`
(`hetpeer testbed`) puts it behind a router of that kind: "none" (the default), "cone" (source ports kept
where it can) or "symmetric" (randomised: only a relay helps). A device's `codec_s` gives, for codecs it measured
(fp16, bf16, int8, int4, int6), its seconds to encode and decode one value, as a joining peer times them; the planner
counts the others at one CPU thread's rates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Mapping

import numpy as np

from hetpeer.protocol.stepcosts import CODEC_FIELDS, MAX_VALUE_S
from hetpeer.protocol.wire import (
    SchemaError,
    field,
    need_list,
    need_mapping,
    need_number,
    need_str,
    no_extra_fields,
)


@dataclass(frozen=True, slots=True)
class Device:
    id: str
    region: str
    tflops: float | None = None
    memory_gb: float | None = None
    nat: str = "none"
    codec_s: tuple[tuple[str, float], ...] = ()  # (codec, encode plus decode seconds per value) it measured


NAT_KINDS = ("none", "cone", "symmetric")


@dataclass(frozen=True, slots=True)
class Link:
    latency_ms: float
    bandwidth_gbps: float


@dataclass(frozen=True, slots=True)
class Topology:
    """A parsed, validated topology. Build it with `Topology.from_wire`."""

    devices: tuple[Device, ...]
    regions: Mapping[str, Link]
    region_links: Mapping[tuple[str, str], Link]  # directed; both directions present
    device_links: Mapping[tuple[str, str], Link]  # directed; both directions present
    default_link: Link | None = None
    name: str = ""

    def link(self, a: Device, b: Device) -> Link:
        """The link from device a to device b (a != b)."""
        return self.device_links.get((a.id, b.id)) or self._region_link(a.region, b.region)

    def link_matrices(self) -> tuple[np.ndarray, np.ndarray]:
        """(latency_ms, bandwidth_gbps) between every pair of devices, (n, n) in device order, as
        `link` gives them; the diagonal is left as a region's own link. O(regions^2 + n^2 + links)."""
        names = sorted({d.region for d in self.devices})
        table = [[self._region_link(a, b) for b in names] for a in names]
        latency = np.array([[link.latency_ms for link in row] for row in table])
        bandwidth = np.array([[link.bandwidth_gbps for link in row] for row in table])
        region = np.array([names.index(d.region) for d in self.devices])
        latency, bandwidth = latency[np.ix_(region, region)], bandwidth[np.ix_(region, region)]
        index = {d.id: i for i, d in enumerate(self.devices)}
        for (a, b), link in self.device_links.items():
            latency[index[a], index[b]], bandwidth[index[a], index[b]] = link.latency_ms, link.bandwidth_gbps
        return latency, bandwidth

    def _region_link(self, a: str, b: str) -> Link:
        if a == b:
            return self.regions[a]
        if (a, b) in self.region_links:
            return self.region_links[(a, b)]
        assert self.default_link is not None, "from_wire checks every pair of regions in use"
        return self.default_link

    @staticmethod
    def from_wire(raw: Any) -> "Topology":
        root = need_mapping(raw, "topology")
        no_extra_fields(
            root,
            {"name", "description", "devices", "regions", "region_links", "default_link", "links"},
            "topology",
        )
        name = need_str(root["name"], "topology.name") if "name" in root else ""
        regions = {
            need_str(region, "topology.regions"): _link(value, f"topology.regions.{region}")
            for region, value in need_mapping(field(root, "regions", "topology"), "topology.regions").items()
        }
        devices = _devices(field(root, "devices", "topology"), regions)
        region_links = _links(root.get("region_links", []), "topology.region_links", set(regions), "region")
        device_links = _links(root.get("links", []), "topology.links", {d.id for d in devices}, "device")
        default_link = _link(root["default_link"], "topology.default_link") if "default_link" in root else None
        if default_link is None:
            used = sorted({d.region for d in devices})
            for i, a in enumerate(used):
                for b in used[i + 1 :]:
                    if (a, b) not in region_links:
                        raise SchemaError(
                            "topology.region_links",
                            f"no link between regions {a!r} and {b!r}, and no default_link",
                        )
        return Topology(
            devices=devices,
            regions=regions,
            region_links=region_links,
            device_links=device_links,
            default_link=default_link,
            name=name,
        )

    def to_wire(self) -> dict[str, Any]:
        def link(value: Link) -> dict[str, float]:
            return {"latency_ms": value.latency_ms, "bandwidth_gbps": value.bandwidth_gbps}

        def pairs(table: Mapping[tuple[str, str], Link]) -> list[dict[str, Any]]:
            return [{"a": a, "b": b, **link(v)} for (a, b), v in sorted(table.items())]

        devices = []
        for device in self.devices:
            entry: dict[str, Any] = {"id": device.id, "region": device.region}
            if device.tflops is not None:
                entry["tflops"] = device.tflops
            if device.memory_gb is not None:
                entry["memory_gb"] = device.memory_gb
            if device.nat != "none":
                entry["nat"] = device.nat
            if device.codec_s:
                entry["codec_s"] = dict(device.codec_s)
            devices.append(entry)
        wire: dict[str, Any] = {
            "devices": devices,
            "regions": {name: link(v) for name, v in self.regions.items()},
            "region_links": pairs(self.region_links),
            "links": pairs(self.device_links),
        }
        if self.name:
            wire["name"] = self.name
        if self.default_link is not None:
            wire["default_link"] = link(self.default_link)
        return wire


def _link(raw: Any, path: str, extra: Collection[str] = ()) -> Link:
    record = need_mapping(raw, path)
    no_extra_fields(record, {"latency_ms", "bandwidth_gbps", *extra}, path)
    return Link(
        latency_ms=need_number(field(record, "latency_ms", path), f"{path}.latency_ms"),
        bandwidth_gbps=need_number(field(record, "bandwidth_gbps", path), f"{path}.bandwidth_gbps", positive=True),
    )


def _devices(raw: Any, regions: Mapping[str, Link]) -> tuple[Device, ...]:
    entries = need_list(raw, "topology.devices")
    if not entries:
        raise SchemaError("topology.devices", "must list at least one device")
    devices: list[Device] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        path = f"topology.devices[{i}]"
        record = need_mapping(entry, path)
        no_extra_fields(record, {"id", "region", "tflops", "memory_gb", "nat", "codec_s"}, path)
        device_id = need_str(field(record, "id", path), f"{path}.id")
        if device_id in seen:
            raise SchemaError(f"{path}.id", f"duplicate device id {device_id!r}")
        seen.add(device_id)
        region = need_str(field(record, "region", path), f"{path}.region")
        if region not in regions:
            raise SchemaError(f"{path}.region", f"unknown region {region!r} (not in topology.regions)")
        tflops = need_number(record["tflops"], f"{path}.tflops", positive=True) if "tflops" in record else None
        memory = need_number(record["memory_gb"], f"{path}.memory_gb", positive=True) if "memory_gb" in record else None
        nat = need_str(record["nat"], f"{path}.nat") if "nat" in record else "none"
        if nat not in NAT_KINDS:
            raise SchemaError(f"{path}.nat", f"must be one of {', '.join(NAT_KINDS)}, got {nat!r}")
        codec_s = _codec_rates(record["codec_s"], f"{path}.codec_s") if "codec_s" in record else ()
        devices.append(Device(id=device_id, region=region, tflops=tflops, memory_gb=memory, nat=nat, codec_s=codec_s))
    return tuple(devices)


def _codec_rates(raw: Any, path: str) -> tuple[tuple[str, float], ...]:
    rates = []
    for codec, value in need_mapping(raw, path).items():
        if codec not in CODEC_FIELDS:
            raise SchemaError(f"{path}.{codec}", f"unknown codec (known: {', '.join(CODEC_FIELDS)})")
        rate = need_number(value, f"{path}.{codec}", positive=True)
        if rate > MAX_VALUE_S:
            raise SchemaError(f"{path}.{codec}", f"must be at most {MAX_VALUE_S:g} seconds per value, got {rate!r}")
        rates.append((codec, rate))
    return tuple(rates)


def _links(raw: Any, path: str, known: set[str], kind: str) -> dict[tuple[str, str], Link]:
    """Directed link table from a list of {a, b, ...}; one direction given means both."""
    given: dict[tuple[str, str], Link] = {}
    for i, entry in enumerate(need_list(raw, path)):
        where = f"{path}[{i}]"
        record = need_mapping(entry, where)
        ends = []
        for end in ("a", "b"):
            name = need_str(field(record, end, where), f"{where}.{end}")
            if name not in known:
                raise SchemaError(f"{where}.{end}", f"unknown {kind} {name!r}")
            ends.append(name)
        if ends[0] == ends[1]:
            raise SchemaError(where, f"links {kind} {ends[0]!r} to itself")
        key = (ends[0], ends[1])
        if key in given:
            raise SchemaError(where, f"duplicate link {ends[0]!r} -> {ends[1]!r}")
        given[key] = _link(record, where, extra={"a", "b"})
    table: dict[tuple[str, str], Link] = {}
    for (a, b), forward in given.items():
        backward = given.get((b, a), forward)
        table[(a, b)] = Link(
            latency_ms=_mean(forward.latency_ms, backward.latency_ms),
            bandwidth_gbps=_mean(forward.bandwidth_gbps, backward.bandwidth_gbps),
        )
        table[(b, a)] = table[(a, b)]
    return table


def _mean(x: float, y: float) -> float:
    """The mean of two finite numbers, finite even where their sum is not (values near 1.8e308): halving
    is exact, so this is (x + y) / 2 rounded once."""
    return x / 2 + y / 2
