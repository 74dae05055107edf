"""The five network scenarios of Yuan et al. (NeurIPS 2022), shipped as topology files.

64 V100s each, with the latencies and bandwidths the authors measured between AWS regions
(their scheduler's configuration); see docs/topology.md for the format.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

NAMES = ("datacenter-on-demand", "datacenter-spot", "multi-datacenter", "regional", "world-wide")


def load(name: str) -> dict[str, Any]:
    """The scenario's topology file, as parsed JSON (validate it with Topology.from_wire)."""
    if name not in NAMES:
        raise ValueError(f"unknown scenario {name!r} (known: {', '.join(NAMES)})")
    return json.loads(resources.files(__name__).joinpath(f"{name}.json").read_text())
