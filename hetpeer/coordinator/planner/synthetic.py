"""Random geo-distributed topologies, for tests and benchmarks of the planner.

Regions are points on a rough world map. Latency grows with distance (5 ms plus 0.8 ms per degree,
about what the authors' AWS measurements show between 11 ms Ohio-Virginia and 238 ms Seoul-London);
WAN bandwidth falls with distance from 2 Gbit/s towards 0.1 Gbit/s. Inside a region, links are
1-5 ms and 2-25 Gbit/s. Devices pick a region and a GPU class at random.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# (tflops in fp16, memory in GB): V100, A10G, A100-40GB, A100-80GB, RTX 4090
GPU_CLASSES = ((125.0, 16.0), (70.0, 24.0), (312.0, 40.0), (312.0, 80.0), (165.0, 24.0))


def random_topology(devices: int, regions: int, rng: np.random.Generator) -> dict[str, Any]:
    """A topology file (wire form) with `devices` devices spread over `regions` regions."""
    if devices < 1 or regions < 1:
        raise ValueError(f"need at least one device and one region, got {devices} and {regions}")
    places = rng.uniform([-60.0, -180.0], [60.0, 180.0], size=(regions, 2))
    names = [f"r{i}" for i in range(regions)]
    region_table = {
        name: {"latency_ms": float(rng.uniform(1, 5)), "bandwidth_gbps": float(rng.uniform(2, 25))} for name in names
    }
    links = []
    for i in range(regions):
        for j in range(i + 1, regions):
            degrees = float(np.hypot(*(places[i] - places[j])))
            links.append(
                {
                    "a": names[i],
                    "b": names[j],
                    "latency_ms": 5.0 + 0.8 * degrees,
                    "bandwidth_gbps": max(0.1, 2.0 - degrees / 200.0),
                }
            )
    device_list = []
    for k in range(devices):
        tflops, memory = GPU_CLASSES[int(rng.integers(len(GPU_CLASSES)))]
        region = names[int(rng.integers(regions))]
        device_list.append({"id": f"{region}-gpu{k}", "region": region, "tflops": tflops, "memory_gb": memory})
    return {
        "name": f"random-{devices}x{regions}",
        "devices": device_list,
        "regions": region_table,
        "region_links": links,
    }
