"""Gossip within a group of real `hetpeer join` processes on 127.0.0.1: four peers, one stage, four lanes.

The group trains (every lane's loss falls) and stays close together: decentralized Adam with one-peer-exp
mixing leaves the peers' parameters far nearer their mean than independent lanes would be. Then the
faults: a peer killed mid-run is left out of mixing and the rest finish; restarted with `--rejoin` it
downloads its stage's state from the group and trains along from the group's step; a `--rejoin` peer
with no live group member fails with one clear line.

Every peer runs in a session of its own, so the fixture can kill whatever is left of it at the end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from hetpeer.logline import unstamp
from hetpeer.peer.launch import link_key_path, write_address_book
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.recipe import Recipe

ROOT = Path(__file__).resolve().parents[2]
DEVICES = ("p0", "p1", "p2", "p3")
HANG_GUARD_S = 150  # generous: a run takes seconds; this only stops a hang
UNTRAINED_LOSS = 5.55  # ln(256) = 5.545: the tiny byte-level model before training
# A log record from another thread can land between a line and its newline, so patterns match a prefix.
STEP_LINE = re.compile(r"^step (\d+)/(\d+)\s+loss (\d+\.\d+)\s")
LEFT_OUT_LINE = re.compile(r"^left out of mixing: (\w+ \d+x(?:, \w+ \d+x)*)")


def make_plan(sync: str, recipe: Recipe = Recipe()) -> Plan:
    """The tiny model as one stage held by four peers, one per lane; lane batch 4, one micro-batch."""
    return Plan(
        "time", "tiny", 4, batch=16, micro_batch=4, micro_batches=1, dtype="fp32",
        stages=(StagePlan(0, 0, 4, DEVICES, sync),), recipe=recipe,
    )  # fmt: skip


@dataclass
class Group:
    plan: Path
    book: Path
    save: Path


def make_group(folder: Path, sync: str, recipe: Recipe = Recipe()) -> Group:
    folder.mkdir(parents=True, exist_ok=True)
    plan = folder / "plan.json"
    plan.write_text(json.dumps(make_plan(sync, recipe).to_wire()))
    return Group(plan, write_address_book(DEVICES, folder, links="tcp"), folder / "save")


class Peer:
    """One `hetpeer join` process; its output lines are collected as they come."""

    def __init__(self, device: str, args: list[str], log: Path) -> None:
        self.device, self.log = device, log
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hetpeer", "join", "--as", device, *args], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, name=f"{device}-output", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self.log, "w") as log:
            for line in self.process.stdout:
                line = unstamp(line)
                log.write(line)
                log.flush()
                with self._changed:
                    self.lines.append(line.rstrip("\n"))
                    self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout_s: float = HANG_GUARD_S) -> re.Match:
        """The first output line matching `pattern`, waiting for it; fails the test if it never comes."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        seen = 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    if found := regex.search(line):
                        return found
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.process.poll() is not None and not self._reader.is_alive()):
                    break
                self._changed.wait(min(left, 0.5))
        pytest.fail(f"{self.device} printed no line matching {pattern!r}:\n{self.output}")

    def finish(self, timeout_s: float = HANG_GUARD_S) -> int:
        """Wait for the process to end and its output to be read; its exit code."""
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.device} hung for {timeout_s} s:\n{self.output}")
        self._reader.join(timeout=10)
        return code

    def kill(self) -> None:
        """SIGKILL the peer's whole session (the peer and anything it started)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=10)

    def losses(self) -> list[tuple[int, float]]:
        """(step, loss) of every step line, in order."""
        return [(int(m.group(1)), float(m.group(3))) for line in self.lines if (m := STEP_LINE.match(line))]

    def left_out(self) -> dict[str, int]:
        """The final report: neighbour -> how many steps it was left out of mixing."""
        found = [m for line in self.lines if (m := LEFT_OUT_LINE.match(line))]
        if not found:
            return {}
        assert len(found) == 1, self.output
        return {device: int(count) for device, count in re.findall(r"(\w+) (\d+)x", found[0].group(1))}


class Peers:
    """The peer processes of one test; whatever is left of them is killed at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[Peer] = []

    def join(self, group: Group, device: str, *extra: str, log_name: str | None = None) -> Peer:
        args = ["--plan", str(group.plan), "--peers", str(group.book), "--link", "tcp", "--threads", "1",
                "--link-key", str(link_key_path(group.book.parent, device)), "--save", str(group.save), *extra]  # fmt: skip
        peer = Peer(device, args, self.logs / f"{log_name or device}.log")
        self.started.append(peer)
        return peer

    def cleanup(self) -> None:
        for peer in self.started:
            peer.kill()


@pytest.fixture
def peers(tmp_path):
    started = Peers(tmp_path)
    yield started
    started.cleanup()


def head_tail_means(losses: list[float], k: int = 3) -> tuple[float, float]:
    return float(np.mean(losses[:k])), float(np.mean(losses[-k:]))


def consensus_distance(save: Path) -> float:
    """Mean Euclidean distance of each peer's stage parameters to the group's mean."""
    from hetpeer.peer.checkpoint import StageCheckpoint

    def flat(device: str) -> np.ndarray:  # a stage's parameters, in one order for every peer (names sorted)
        tensors = StageCheckpoint.read(save / f"{device}.safetensors").tensors()
        return np.concatenate([tensors[n].numpy().ravel() for n in sorted(tensors) if not n.startswith("optimizer.")])

    params = np.stack([flat(device) for device in DEVICES])
    return float(np.mean(np.linalg.norm(params - params.mean(axis=0), axis=1)))


# -- a healthy group ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_gossip_group_learns_and_stays_in_consensus(tmp_path, peers):
    steps = 25
    distances = {}
    for sync in ("gossip", "none"):  # same seed, same data per lane; "none": four independent lanes
        group = make_group(tmp_path / sync, sync)
        run = [peers.join(group, device, "--steps", str(steps), "--timeout", "30", log_name=f"{sync}-{device}")
               for device in DEVICES]  # fmt: skip
        for peer in run:
            assert peer.finish() == 0, peer.output
            assert "Traceback" not in peer.output
        if sync == "gossip":
            for peer in run:
                losses = peer.losses()
                assert [step for step, _ in losses] == list(range(1, steps + 1)), peer.output
                first, last = head_tail_means([loss for _, loss in losses])
                assert first > last + 0.3, (peer.device, first, last, peer.output)
                assert "group of 4 (gossip, one-peer-exp)" in peer.output
        distances[sync] = consensus_distance(group.save)
    print(f"consensus distance: gossip {distances['gossip']:.4g}, independent lanes {distances['none']:.4g}, "
          f"ratio {distances['none'] / distances['gossip']:.1f}")  # fmt: skip
    assert distances["gossip"] > 0  # lanes see different data: exact equality would mean no local steps
    assert distances["none"] > 5 * distances["gossip"], distances


# -- faults ------------------------------------------------------------------------------------------------

# A short mixing deadline so that a dead neighbour costs the survivors one 2 s wait (after that they
# only glance for it), a larger learning rate so that trained and fresh weights are far apart in loss.
FAULT_OPTIONS = ("--timeout", "10",)
FAULT_RECIPE = Recipe(lr=1e-3, mix_deadline_s=2.0)
SURVIVOR_STEPS = 400  # a step takes tens of ms: ample to outlast the victim's restart (98 steps once, in CI) and its own steps
REJOIN_STEPS = 15
KILL_AFTER_STEP = 5
REJOIN_AFTER_STEP = 40  # the group's loss is well below the untrained model's by then
VICTIM = "p3"
# one-peer-exp on 4 peers: round r mixes peer i with i - 2^(r mod 2), so p0 takes p3's parameters in even
# rounds, p1 in odd rounds, and p2 never does (p2 sends to p3, but mixes p1 and p0).
MIXES_VICTIM = {"p0": 0, "p1": 1}  # peer -> parity of the rounds (step - 1) in which it mixes p3 in


def fresh_loss(lane: int, step: int) -> float:
    """The untrained model's loss on a lane's batch of `step` (0-based): what fresh weights would report."""
    import torch

    from hetpeer.peer.data.corpus import Corpus
    from hetpeer.peer.model import build_stage
    from hetpeer.protocol.modelspec import preset

    spec, plan = preset("tiny"), make_plan("gossip")
    model = build_stage(spec, 0, spec.layers)
    position = plan.data_position_at(step) + plan.lane_offset(lane)  # the lane's windows of that step
    batch = Corpus.default().batch(position, plan.lane_sequences(lane), spec.seq_len, seed=0)
    with torch.no_grad():
        return model.loss(model(torch.from_numpy(batch.tokens)), torch.from_numpy(batch.labels)).item()


def step_lines(peer: Peer) -> dict[int, str]:
    return {int(m.group(1)): line for line in peer.lines if (m := STEP_LINE.match(line))}


@pytest.mark.slow
def test_killed_peer_is_left_out_and_rejoins_from_the_group(tmp_path, peers):
    group = make_group(tmp_path / "group", "gossip", FAULT_RECIPE)
    survivors = {device: peers.join(group, device, "--steps", str(SURVIVOR_STEPS), *FAULT_OPTIONS)
                 for device in DEVICES if device != VICTIM}  # fmt: skip
    victim = peers.join(group, VICTIM, "--steps", str(SURVIVOR_STEPS), *FAULT_OPTIONS)
    victim.wait_for(rf"^step {KILL_AFTER_STEP}/")
    victim.kill()
    assert victim.process.returncode == -signal.SIGKILL
    died_after = max(step for step, _ in victim.losses())
    assert died_after < SURVIVOR_STEPS, victim.output  # it was killed mid-run, not after its last step

    # the group trains on far enough that trained and fresh weights tell apart (below), however fast the restart
    survivors["p0"].wait_for(rf"^step {REJOIN_AFTER_STEP}/")
    back = peers.join(group, VICTIM, "--rejoin", "--steps", str(REJOIN_STEPS), *FAULT_OPTIONS, log_name="p3-rejoined")
    assert back.finish() == 0, back.output
    for peer in survivors.values():
        assert peer.finish() == 0, peer.output
    everyone = [*survivors.values(), back]
    for peer in everyone:
        assert "Traceback" not in peer.output, peer.output

    # the survivors ran every step, left the dead peer out (those that mix it in), and still learned
    for device, peer in survivors.items():
        losses = peer.losses()
        assert [step for step, _ in losses] == list(range(1, SURVIVOR_STEPS + 1)), peer.output
        first, last = head_tail_means([loss for _, loss in losses])
        assert first > last + 0.5, (device, first, last)
        if device in MIXES_VICTIM:
            assert VICTIM in peer.left_out(), peer.output
        else:
            assert VICTIM not in peer.left_out(), peer.output

    # the restarted peer took the group's state and step
    rejoined = back.wait_for(r"^rejoined at step (\d+): .* from (\w+(?:, \w+)*) in [\d.]+ s", timeout_s=0)
    entered, donors = int(rejoined.group(1)), rejoined.group(2).split(", ")
    assert sorted(donors) == [d for d in DEVICES if d != VICTIM], rejoined.group(0)
    assert entered > died_after, (entered, died_after)  # the group went on while it was dead
    assert entered + REJOIN_STEPS - 1 < SURVIVOR_STEPS, (
        f"the group finished before the rejoined peer did (entered at {entered}): raise SURVIVOR_STEPS"
    )
    ran = back.losses()
    assert len(ran) == REJOIN_STEPS and ran[0][0] == entered, back.output
    # its first step runs the downloaded weights on its own lane's batch: a trained model's loss, near the
    # group's at that step, where fresh weights would give the untrained loss
    first = ran[0][1]
    group_now = [loss for peer in survivors.values() for step, loss in peer.losses() if abs(step - entered) <= 2]
    untrained = fresh_loss(lane=DEVICES.index(VICTIM), step=entered - 1)
    assert untrained == pytest.approx(UNTRAINED_LOSS, abs=0.1)
    assert np.mean(group_now) < untrained - 1.0, (group_now, untrained)  # the check below can tell them apart
    # batches differ by more than 0.5 in loss at this point: what tells trained from fresh is which it is nearer
    assert first < untrained - 1.0 and abs(first - np.mean(group_now)) < abs(first - untrained), (first, group_now, back.output)

    # ... and trained along: the survivors that mix it in took its parameters again
    for device, parity in MIXES_VICTIM.items():
        lines = step_lines(survivors[device])
        rounds = [lines[s] for s in range(entered, entered + REJOIN_STEPS - 1) if (s - 1) % 2 == parity]
        mixed = [line for line in rounds if f"without {VICTIM}" not in line]
        assert mixed, (device, rounds)
    left_out_by_back = [line for line in step_lines(back).values() if "without" in line]
    assert len(left_out_by_back) <= REJOIN_STEPS // 2, back.output


@pytest.mark.slow
def test_rejoin_without_a_live_group_member_fails_clearly(tmp_path, peers):
    group = make_group(tmp_path / "group", "gossip", FAULT_RECIPE)  # nobody else runs: every donor is unreachable
    alone = peers.join(group, VICTIM, "--rejoin", "--steps", "3", "--timeout", "2")
    code = alone.finish()
    assert code not in (0, None), alone.output
    assert "Traceback" not in alone.output, alone.output
    assert not alone.losses(), alone.output  # it never trained on weights of its own making
    error = alone.wait_for(rf"^hetpeer join: stopped: {VICTIM}: (.*)$", timeout_s=0).group(1)
    for word in ("no donor", "p0", "p1", "p2", "state"):
        assert word in error, (word, error)
    assert not (group.save / f"{VICTIM}.safetensors").exists()
