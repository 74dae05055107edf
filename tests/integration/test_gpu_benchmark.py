"""`benchmarks/gpu.py` at its small sizes (`--small`), as CI runs it: without CUDA it says so in one line, runs its
CPU parts (a peer's step against the plain loop, memory against the planner's count, the launches on the CPU, the
codecs) and exits 0 with one JSON object as its last line."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_check_runs_its_cpu_parts_and_reports_them(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--small", "--json", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    cuda = torch.cuda.is_available()
    if not cuda:
        assert lines[0].startswith("no CUDA GPU (torch "), lines[0]
    found = json.loads(lines[-1])
    assert found["cuda"] == cuda and "FAILED" not in done.stdout
    for label, model in found["models"].items():
        assert "error" not in model, (label, model)
        assert math.isfinite(model["step"]["ratio"]) and model["step"]["ratio"] > 0
        memory = model["memory"]
        for kind in ("kept", "recomputed"):  # the planner's count against what the stage's tensors took
            assert 0.97 <= memory[kind]["ratio"] <= 1.15, (label, kind, memory[kind])
        assert memory["recomputed"]["measured_bytes"] < memory["kept"]["measured_bytes"]
        assert set(model["goals"]) == {"step", "probe", "whole_step", "memory", "fits_announced", "recompute"}
    launch = found["launch"]
    for run in ("cpu bf16", "cpu fp32"):
        assert len(launch[run]["losses"]) == found["sizes"]["launch_steps"]
        assert launch[run]["losses"][-1] < launch[run]["losses"][0]  # it trains
        assert set(launch[run]["devices"]) == {"cpu"} and launch[run]["encoded_on"]["cpu"] > 0
    assert launch["bf16_vs_fp32_cpu"] <= launch["allowed_gap"]
    shares = {"raw": 1.0, "fp16": 0.5, "bf16": 0.5, "int8": (1 + 4 / 64) / 4}  # int8: a byte a value, a float32 scale per 64
    for codec, share in shares.items():
        row = found["codecs"][f"cpu {codec}"]
        assert row["wire_share"] == pytest.approx(share, rel=1e-3)
        assert row["encode_gbps"] > 0 and row["decode_gbps"] > 0
        assert (row["max_error"] == 0) == (codec == "raw") and row["max_error"] < 0.05
