"""The planner is pure: importing it in a clean interpreter pulls in no torch, hivemind, grpc or asyncio."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("torch", "hivemind", "grpc", "asyncio")

# Every module of the planner package, not only what its __init__ pulls in.
SCRIPT = """
import importlib, json, pkgutil, sys
import hetpeer.coordinator.planner as planner
for info in pkgutil.iter_modules(planner.__path__):
    importlib.import_module(f"{planner.__name__}.{info.name}")
print(json.dumps(sorted(sys.modules)))
"""


def test_planner_imports_no_network_or_tensor_stack():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    modules = json.loads(done.stdout)
    assert {"hetpeer.coordinator.planner.search", "hetpeer.coordinator.planner.baselines"} <= set(modules)
    loaded = {name.split(".")[0] for name in modules}
    assert not loaded & set(FORBIDDEN), sorted(loaded & set(FORBIDDEN))
