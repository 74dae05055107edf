"""`benchmarks/coordinator.py` at a small size: synthetic records through the real parsing path, pruning named in
the plan, a real coordinator round that publishes; its figures are what the script prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).parents[2] / "benchmarks" / "coordinator.py"


def test_a_coordinator_reads_synthetic_peers_prunes_and_publishes():
    done = subprocess.run([sys.executable, str(BENCHMARK), "--peers", "120", "--compare", "40", "--budget", "0.5", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for size, peers in (("large", 120), ("small", 40)):
        figures = result[size]
        assert figures["peers"] == peers and figures["published"]
        assert figures["planned"] + sum(figures["standby"].values()) == peers  # every record in the plan or on standby
        assert 0 < figures["plan_bytes"] <= 1 << 20 and figures["predicted_step_s"] > 0
    # 5% Raspberry Pis and 3% 1 GB devices among 120: some of each, all left out, each named as what it is
    assert result["large"]["standby"].get("too small", 0) > 0 and result["large"]["standby"].get("too slow", 0) > 0
    assert "peak memory" in done.stdout


def test_bad_sizes_are_refused():
    done = subprocess.run([sys.executable, str(BENCHMARK), "--peers", "5"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--peers and --compare must be at least 10" in done.stderr
