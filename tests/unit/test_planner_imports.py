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


# The CLI's cheap commands: `hetpeer --version` loads nothing heavier than numpy, `hetpeer plan` the planner.
CLI_SCRIPT = """
import json, sys
from hetpeer.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as done:  # --version exits from the parser
    code = done.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def run_cli(*argv: str) -> tuple[int, set[str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", CLI_SCRIPT, *argv], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    result = json.loads(done.stdout.splitlines()[-1])
    return result["code"], set(result["modules"])


def test_version_loads_no_tensor_or_network_stack():
    code, modules = run_cli("--version")
    loaded = {name.split(".")[0] for name in modules}
    assert code == 0
    assert not loaded & {"torch", "hivemind", "grpc", "scipy"}, sorted(loaded & {"torch", "hivemind", "grpc", "scipy"})


def test_plan_loads_no_tensor_or_network_stack():
    # four stages: a plan that fits memory whatever the budget affords on a busy machine
    code, modules = run_cli("plan", "--scenario", "regional", "--stages", "4", "--time-budget", "0.2", "--quiet",
                            "--random-samples", "2")
    loaded = {name.split(".")[0] for name in modules}
    assert code == 0 and "hetpeer.coordinator.planner.search" in modules  # it did plan
    assert not loaded & {"torch", "hivemind", "grpc"}, sorted(loaded & {"torch", "hivemind", "grpc"})
