"""`hetpeer swarm`, the README's main job, as a user runs it (`python -m hetpeer swarm ...`): a small
swarm trains to its step count and stops by itself, or stops on Ctrl+C; either way every process it
started is gone and the run report is written."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from processes import live_processes
from hetpeer.logline import unstamp
from hetpeer.swarm.browser import find_chromium
from hetpeer.swarm.report import RunReport

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 300
DEMO_STEPS = 100  # enough for the loss to fall and every peer to measure its links; a step is 0.2-0.4 s here


def start(out: Path, *options: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hetpeer", "swarm", "--peers", "3", "--heartbeat", "1", "--out", str(out), *options],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def processes_using(folder: Path) -> list[str]:
    """Command lines of running processes that name `folder` (the swarm's coordinator and peers do)."""
    return [cmdline for pid, _, cmdline in live_processes() if str(folder) in cmdline and pid != os.getpid()]


def finish(process: subprocess.Popen, timeout_s: float = HANG_GUARD_S) -> tuple[str, str]:
    try:
        return process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        raise AssertionError(f"hetpeer swarm hung for {timeout_s:g} s:\n{out}\n{err}")


def test_the_swarm_trains_to_its_step_count_and_stops_everything(tmp_path):
    out = tmp_path / "run"
    stdout, stderr = finish(start(out, "--steps", str(DEMO_STEPS), "--leave", "none"))
    assert "Traceback" not in stdout + stderr, stdout + stderr
    assert f"report: {out / 'report.md'}" in stdout
    report = RunReport.from_json((out / "report.json").read_text())
    assert report.plans and report.peers and len(report.peers) == 3
    assert all(p.tflops is not None and p.tflops > 0 for p in report.peers)  # what each peer measured
    # links emulated as over a network: a ping and its echo are each held back 5 ms, so no link reads under 5 ms
    assert "links: each peer's frames to the others are held back 5 ms" in stdout
    assert [p.latency_ms for p in report.peers] == [5.0] * 3
    measured = [float(ms) for i in range(3) for line in (out / f"peer{i}.log").read_text().splitlines()
                if "links measured: " in line for ms in re.findall(r" ([\d.]+) ms ", line)]
    assert measured and min(measured) >= 5.0, measured
    losses = [s.loss for s in report.samples if math.isfinite(s.loss)]
    assert losses and losses[-1] < losses[0]
    assert max(s.step for s in report.samples) + 1 >= DEMO_STEPS
    assert (out / "loss.png").read_bytes().startswith(b"\x89PNG")
    assert "Plotly" in (out / "report.html").read_text() and "dashboard: http://127.0.0.1:" in stdout
    if find_chromium() is not None or os.environ.get("HETPEER_REQUIRE_BROWSER"):  # a picture of the page at the end
        assert f"dashboard screenshot: {out / 'dashboard.png'}" in stdout
        assert (out / "dashboard.png").read_bytes().startswith(b"\x89PNG") and "(dashboard.png)" in (out / "report.md").read_text()
    else:
        assert "no Chromium on this machine: no dashboard screenshot" in stdout
    coordinator = (out / "coordinator.log").read_text()
    assert f"the swarm reached step {DEMO_STEPS}: no more plans" in coordinator
    # peers that leave at the last step do not look like a broken plan: no plan is published for them
    assert "the running plan is broken" not in coordinator
    members = {d for stage in report.plans[-1].stages for d in stage.devices}
    for i, peer in enumerate(report.peers):  # in the order started: peer0, peer1, ...
        if peer.device_id in members:
            assert f"reached step {DEMO_STEPS}: leaving" in (out / f"peer{i}.log").read_text()
    # credit: what each peer trained by its step lines, confirmed by its neighbours, within a step
    assert [c.device_id for c in report.credit] == [p.device_id for p in report.peers]
    for i, credit in enumerate(report.credit):
        assert abs(credit.credited_steps - credit.trained_steps) <= 1, credit
        if credit.trained_steps:
            assert credit.credited_tokens == credit.credited_sequences * 64 and credit.credited_flops > 0
            assert "credit: credited " in (out / f"peer{i}.log").read_text()
    assert sum(c.trained_steps for c in report.credit) >= DEMO_STEPS and "## Credit" in (out / "report.md").read_text()
    assert processes_using(out) == []


def test_the_demo_splits_the_model_over_groups_and_a_peer_that_leaves_comes_back_with_its_groups_state(tmp_path):
    # the README's demo, smaller: emulated devices too small for the whole model, one of a group leaving and returning;
    # at the demo's heartbeat, whose 8 samples of the load other work puts on the cores span more than the peers' start.
    # Two stages: with four peers, three stages of one lane and a spare come within noise of two stages of two lanes,
    # and the returning peer must have a group to download from.
    out = tmp_path / "run"
    # The leave at 60 and the return at 100 come under load; the returning peer trained again by step 142 and 289 in
    # two runs of 2026-12-01, so 400 steps leave it room (600 took 326 s of CI's 40 minutes at 0.4 s a step)
    stdout, stderr = finish(start(out, "--peers", "4", "--steps", "400", "--leave", "60,100", "--heartbeat", "2",
                                  "--stages", "2"), timeout_s=2 * HANG_GUARD_S)
    assert "Traceback" not in stdout + stderr, stdout + stderr
    assert "emulation: each peer computes as on a device of its own" in stdout
    report = RunReport.from_json((out / "report.json").read_text())
    assert any(len(p.stages) >= 2 and len(p.stages[0].devices) >= 2 for p in report.plans), report.plans
    events = [e.text for e in sorted(report.events, key=lambda e: e.time_s)]
    left = next(e for e in events if " leaves at step " in e)
    peer = left.split()[0]
    after = events[events.index(left):]
    assert any(e.startswith(f"{peer} comes back at step ") for e in after), events
    # back, it trains in a plan again, its stage downloaded from the members of its group that kept training
    trains = next((e for e in after if e.startswith(f"{peer} trains again: ")), None)
    assert trains is not None and re.search(r"downloaded [\d.]+ MiB of state in \d+ chunk\(s\) from peer", trains), events
    device = next(p.device_id for p in report.peers if p.device_id.startswith(peer + "-"))
    epoch = int(re.search(r"of plan epoch (\d+)", trains).group(1))
    held = [device in {d for s in p.stages for d in s.devices} for p in sorted(report.plans, key=lambda p: p.epoch)
            if p.epoch <= epoch]
    # in a plan, then re-planned without it, then in one again
    assert re.search("10+1$", "".join("1" if h else "0" for h in held)), held
    assert max(s.step for s in report.samples) + 1 >= 400 and processes_using(out) == []


def test_ctrl_c_stops_every_process_and_still_writes_the_report(tmp_path):
    out = tmp_path / "run"
    process = start(out, "--steps", "100000")
    deadline = time.monotonic() + HANG_GUARD_S
    seen = []
    for line in process.stdout:  # the live progress: wait until the swarm trains
        seen.append(unstamp(line))
        if seen[-1].startswith("[swarm] step ") or time.monotonic() > deadline:
            break
    assert seen and seen[-1].startswith("[swarm] step "), "".join(seen)
    process.send_signal(signal.SIGINT)  # what Ctrl+C at a terminal sends the launcher
    stdout, stderr = finish(process)
    assert process.returncode == 0, stderr
    assert "interrupted: stopping every process" in stdout
    assert "Traceback" not in stdout + stderr, stdout + stderr
    report = RunReport.from_json((out / "report.json").read_text())
    assert report.samples and report.plans
    assert processes_using(out) == []


def test_a_swarm_started_again_resumes_from_its_checkpoints(tmp_path):
    """Every peer saves its stage when it leaves (--save); started again in the same folder, the peers offer
    their checkpoints, the coordinator's first plan resumes at their step, and the loss goes on from there."""
    out, saved = tmp_path / "run", tmp_path / "checkpoints"
    stdout, stderr = finish(start(out, "--steps", "30", "--save", str(saved), "--eval-every", "0"))
    assert "Traceback" not in stdout + stderr, stdout + stderr
    first = RunReport.from_json((out / "report.json").read_text())
    end_loss = [s.loss for s in sorted(first.samples, key=lambda s: s.step) if math.isfinite(s.loss)][-5:]
    assert sorted(p.name for p in saved.iterdir())  # the members' checkpoints
    stdout, stderr = finish(start(out, "--steps", "40", "--save", str(saved), "--eval-every", "0"))
    assert "Traceback" not in stdout + stderr, stdout + stderr
    coordinator = (out / "coordinator.log").read_text()
    assert "resumed from the peers' checkpoints at step 30" in coordinator
    resumed = [unstamp(line) for i in range(3) for line in (out / f"peer{i}.log").read_text().splitlines()
               if "resumed from its checkpoint (step 30" in line]
    assert resumed, stdout
    second = RunReport.from_json((out / "report.json").read_text())
    later = sorted((s for s in second.samples if s.step >= 30 and math.isfinite(s.loss)), key=lambda s: s.step)
    assert later and later[-1].step + 1 >= 40
    # the untrained model's loss is about 5.5; the resumed swarm starts near where the first run ended
    assert later[0].loss < sum(end_loss) / len(end_loss) + 1.0 < 5.0
    assert processes_using(out) == []
