"""Synthetic swarms, for tests and benchmarks of the planner: generators of topologies that differ in kind.

Every generator is `(devices, rng) -> topology file (wire form)` and is listed in `GENERATORS`:

- `geo`: regions are points on a rough world map (one region per 16 devices). Latency grows with distance
  (5 ms plus 0.8 ms per degree, about what Yuan et al.'s AWS measurements show between 11 ms Ohio-Virginia
  and 238 ms Seoul-London); WAN bandwidth falls with distance from 2 Gbit/s towards 0.1 Gbit/s. Inside a
  region, links are 1-5 ms and 2-25 Gbit/s. Devices pick a region and one of five data-centre GPUs at random.
- `mixed`: regions of 32 devices each with links drawn at random (10-250 ms, 0.1-5 Gbit/s), not by
  distance; eight GPU generations from 8 to 312 TFLOPS and 8 to 80 GB.
- `regions`: many small regions (one per 4 devices) on the world map: most groups must cross regions.
- `sites`: three quarters of the devices in four data centres (one GPU kind each, 100 Gbit/s and 0.1 ms
  inside, 1-10 Gbit/s between them), the rest scattered over small regions of the world map.
- `home`: consumer GPUs behind home connections: cities on the world map where even two homes of one city
  meet through their uplinks (10-30 ms, 20-300 Mbit/s) and home links cap every WAN link at 0.3 Gbit/s;
  a fifth of the devices are old cards and laptops: 4 TFLOPS with 2 GB, and 1 TFLOPS with 1 GB, less than
  one GPT-3 XL layer's training state and activations (too small for any stage).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

# (tflops in fp16, memory in GB): V100, A10G, A100-40GB, A100-80GB, RTX 4090
GPU_CLASSES = ((125.0, 16.0), (70.0, 24.0), (312.0, 40.0), (312.0, 80.0), (165.0, 24.0))
# eight generations, slowest first: GTX 1080, RTX 3060, T4, RTX 3090, V100, RTX 4090, A100-40GB, A100-80GB
MIXED_CLASSES = ((8.0, 8.0), (25.0, 12.0), (65.0, 16.0), (71.0, 24.0), (125.0, 16.0), (165.0, 24.0), (312.0, 40.0),
                 (312.0, 80.0))
# (tflops, memory in GB, share): RTX 3060, 3070, 3080, 3090, 4090; old cards and laptops of 2 GB and 1 GB
HOME_CLASSES = ((25.0, 12.0, 0.25), (40.0, 8.0, 0.15), (60.0, 10.0, 0.15), (71.0, 24.0, 0.15), (165.0, 24.0, 0.1),
                (4.0, 2.0, 0.12), (1.0, 1.0, 0.08))
SITE_CLASSES = ((312.0, 80.0), (312.0, 40.0), (125.0, 16.0), (70.0, 24.0))  # one kind per data centre

Topology = dict[str, Any]


def _world(regions: int, rng: np.random.Generator) -> np.ndarray:
    """Region centres on a rough world map: (regions, 2) latitude and longitude in degrees."""
    return rng.uniform([-60.0, -180.0], [60.0, 180.0], size=(regions, 2))


def _geo_link(a: np.ndarray, b: np.ndarray, cap_gbps: float = 2.0) -> dict[str, float]:
    degrees = float(np.hypot(*(a - b)))
    return {"latency_ms": 5.0 + 0.8 * degrees, "bandwidth_gbps": min(cap_gbps, max(0.1, 2.0 - degrees / 200.0))}


def _topology(name: str, names: list[str], inside: dict[str, dict[str, float]], link: Callable[[int, int], dict[str, float]],
              devices: list[tuple[str, float, float]]) -> Topology:
    """A topology file: `inside` links per region, `link(i, j)` between regions i < j, and devices as
    (region, tflops, memory_gb)."""
    links = [{"a": names[i], "b": names[j], **link(i, j)} for i in range(len(names)) for j in range(i + 1, len(names))]
    return {
        "name": name,
        "devices": [{"id": f"{region}-gpu{k}", "region": region, "tflops": tflops, "memory_gb": memory}
                    for k, (region, tflops, memory) in enumerate(devices)],
        "regions": inside,
        "region_links": links,
    }


def _data_centre_regions(names: list[str], rng: np.random.Generator) -> dict[str, dict[str, float]]:
    return {name: {"latency_ms": float(rng.uniform(1, 5)), "bandwidth_gbps": float(rng.uniform(2, 25))} for name in names}


def random_topology(devices: int, regions: int, rng: np.random.Generator) -> Topology:
    """A topology file (wire form) with `devices` devices spread over `regions` regions of the world map."""
    if devices < 1 or regions < 1:
        raise ValueError(f"need at least one device and one region, got {devices} and {regions}")
    places = _world(regions, rng)
    names = [f"r{i}" for i in range(regions)]
    inside = _data_centre_regions(names, rng)
    chosen = []
    for _ in range(devices):
        tflops, memory = GPU_CLASSES[int(rng.integers(len(GPU_CLASSES)))]
        chosen.append((names[int(rng.integers(regions))], tflops, memory))
    return _topology(f"random-{devices}x{regions}", names, inside, lambda i, j: _geo_link(places[i], places[j]), chosen)


def geo(devices: int, rng: np.random.Generator) -> Topology:
    return random_topology(devices, max(4, devices // 16), rng)


def mixed(devices: int, rng: np.random.Generator) -> Topology:
    regions = max(1, -(-devices // 32))
    names = [f"m{i}" for i in range(regions)]
    inside = _data_centre_regions(names, rng)
    between = {(i, j): {"latency_ms": float(rng.uniform(10, 250)), "bandwidth_gbps": float(rng.uniform(0.1, 5.0))}
               for i in range(regions) for j in range(i + 1, regions)}
    chosen = [(names[k // 32], *MIXED_CLASSES[int(rng.integers(len(MIXED_CLASSES)))]) for k in range(devices)]
    return _topology(f"mixed-{devices}", names, inside, lambda i, j: between[(i, j)], chosen)


def small_regions(devices: int, rng: np.random.Generator) -> Topology:
    return random_topology(devices, max(4, devices // 4), rng)


def sites(devices: int, rng: np.random.Generator) -> Topology:
    scattered = devices // 4
    small = max(1, scattered // 8)
    places = _world(4 + small, rng)
    names = [f"dc{i}" for i in range(4)] + [f"s{i}" for i in range(small)]
    inside = {name: {"latency_ms": 0.1, "bandwidth_gbps": 100.0} for name in names[:4]}
    inside.update(_data_centre_regions(names[4:], rng))
    between = {(i, j): ({"latency_ms": _geo_link(places[i], places[j])["latency_ms"],
                         "bandwidth_gbps": float(rng.uniform(1, 10))} if j < 4 else _geo_link(places[i], places[j]))
               for i in range(len(names)) for j in range(i + 1, len(names))}
    chosen = [(names[k % 4], *SITE_CLASSES[k % 4]) for k in range(devices - scattered)]
    for _ in range(scattered):
        chosen.append((names[4 + int(rng.integers(small))], *GPU_CLASSES[int(rng.integers(len(GPU_CLASSES)))]))
    return _topology(f"sites-{devices}", names, inside, lambda i, j: between[(i, j)], chosen)


def home(devices: int, rng: np.random.Generator) -> Topology:
    cities = max(4, devices // 16)
    places = _world(cities, rng)
    names = [f"c{i}" for i in range(cities)]
    inside = {name: {"latency_ms": float(rng.uniform(10, 30)), "bandwidth_gbps": float(rng.uniform(0.02, 0.3))}
              for name in names}
    shares = np.array([share for _, _, share in HOME_CLASSES])
    kinds = rng.choice(len(HOME_CLASSES), size=devices, p=shares / shares.sum())
    chosen = [(names[int(rng.integers(cities))], HOME_CLASSES[k][0], HOME_CLASSES[k][1]) for k in kinds]

    def link(i: int, j: int) -> dict[str, float]:
        wan = _geo_link(places[i], places[j], cap_gbps=0.3)
        return {"latency_ms": wan["latency_ms"] + 20.0, "bandwidth_gbps": wan["bandwidth_gbps"]}  # two last miles

    return _topology(f"home-{devices}", names, inside, link, chosen)


GENERATORS: dict[str, Callable[[int, np.random.Generator], Topology]] = {
    "geo": geo, "mixed": mixed, "regions": small_regions, "sites": sites, "home": home,
}


def generate(kind: str, devices: int, seed: int) -> Topology:
    """The topology of generator `kind` with `devices` devices for `seed`."""
    if kind not in GENERATORS:
        raise ValueError(f"unknown swarm generator {kind!r} (known: {', '.join(GENERATORS)})")
    if devices < 1:
        raise ValueError(f"need at least one device, got {devices}")
    return GENERATORS[kind](devices, np.random.default_rng(seed))
