"""Where a swarm peer's stage gets its parameters and optimizer state when a plan gives it one, and when
it lets go of the stage it held before.

In order: its own checkpoint of exactly that stage (a swarm resuming after every peer stopped; it is
announced from the start, so the coordinator can plan the swarm's resumption), the stage it held when its
layers stay the same, else a download from the peers that announce those layers (`gossip/state.py`),
keeping what it held of them. The stage held before stays, served to the peers that download from it,
until no member of the running plan can still want it.

The rules are pure functions (`donors_for`, `still_fetched`); `Handover` is the part of `SwarmPeer`
(peer.py) that acts on them.
"""

from __future__ import annotations

import logging
from typing import Mapping

from hetpeer.peer.checkpoint import CheckpointError, StageCheckpoint
from hetpeer.peer.gossip.state import StateDownloadError
from hetpeer.peer.pipeline.worker import STALE_STEPS, StageWorker
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.records import PeerRecord

log = logging.getLogger("hetpeer.peer")


def donors_for(records: Mapping[str, PeerRecord], layers: tuple[int, int], me: str) -> list[str]:
    """Peers that announce layers overlapping `layers`, exact holders first, then by most recent step;
    never a peer that announced it is leaving, nor one still downloading those layers itself."""
    start, end = layers
    found = [
        r for r in records.values()
        if r.device_id != me and r.state not in ("leaving", "fetching") and r.layers is not None
        and r.layers[0] < end and start < r.layers[1]
    ]
    found.sort(key=lambda r: (r.layers != layers, -r.step))
    return [r.device_id for r in found]


def still_fetched(plan: Plan, records: Mapping[str, PeerRecord], me: str, layers: tuple[int, int]) -> bool:
    """Whether a stage `me` held before `plan` (`layers`) may still be downloaded from it: some other member
    of `plan` whose layers overlap it does not yet announce training under `plan` (or a later one)."""
    start, end = layers
    for stage in plan.stages:
        if stage.layer_start < end and start < stage.layer_end:
            for device in stage.devices:
                record = records.get(device)
                if device != me and (record is None or record.epoch < plan.epoch or record.state != "training"):
                    return True
    return False


class Handover:
    """The part of `SwarmPeer` that fills a new stage's worker (`_fill`, from `Following._switch`) and lets
    go of the stage held before (`_release_previous`, from the main loop). It uses up the peer's own
    `checkpoint` and reads its `records` under `lock`."""

    def _own_checkpoint(self) -> StageCheckpoint | None:
        """This peer's checkpoint in --save, of this model: announced, so that a swarm starting again after
        every peer stopped resumes from it."""
        if self.config.save is None or not (path := self.config.save / f"{self.device_id}.safetensors").exists():
            return None
        try:
            checkpoint = StageCheckpoint.read(path)
        except CheckpointError as error:
            self.report(f"ignored its checkpoint: {error}")
            return None
        if checkpoint.spec.digest != self.spec.digest:
            self.report(f"ignored its checkpoint {path}: it is of model {checkpoint.spec.name}, this peer trains {self.spec.name}")
            return None
        self.report(f"holds a checkpoint of layers {checkpoint.layers[0]}-{checkpoint.layers[1] - 1} at step {checkpoint.step} "
                    f"({path}): offered to resume the swarm from")
        return checkpoint

    def _release_previous(self) -> None:
        """Let go of the stage held before the running plan once no member of that plan can still want to
        download it: a peer would otherwise hold two stages' state (a memory-bound peer has room for one).
        A peer on standby keeps it: that is its warm copy."""
        previous, running = self.previous, self.running
        if previous is None or running is None or self.worker is None:
            return
        with self.lock:
            needed = still_fetched(running, self.records, self.device_id, previous.layers)
        if not needed:
            self.previous = None
            if self.server is not None:
                self.server.release(previous.sync)
            log.info("%s: released the stage held before plan epoch %d (layers %d-%d)", self.device_id, running.epoch,
                     previous.layers[0], previous.layers[1] - 1)

    def _fill(self, worker: StageWorker, old: StageWorker | None, layers: tuple[int, int], epoch: int) -> str:
        """Put the stage's parameters and optimizer state in `worker`: its own checkpoint of exactly this stage
        (a swarm resuming after every peer stopped), the old worker's when it held the same layers lately, else
        what the old one held of them (unless that copy is `STALE_STEPS` behind the plan: a peer back from
        standby) and the rest downloaded from the peers that announce them; how, in words."""
        how = f"the model folder's weights ({worker.loaded_bytes / 2**20:.1f} MiB read)" if worker.loaded_bytes else "fresh weights"
        stale = old is not None and worker.plan.start_step - old.step >= STALE_STEPS  # a standby copy, say
        overlaps = old is not None and old.layers[0] < layers[1] and layers[0] < old.layers[1] and not stale
        if old is None and self.checkpoint is not None and self.checkpoint.layers == layers and not self._donors(layers):
            # a swarm resuming: no live peer holds these layers. In a running swarm its group's state is newer.
            checkpoint, self.checkpoint = self.checkpoint, None
            worker.restore(checkpoint.path)
            worker.step = worker.sync.step = worker.plan.start_step  # the plan resumes at the newest checkpoint's step
            how = f"resumed from its checkpoint (step {checkpoint.step}, plan epoch {checkpoint.epoch})"
            if changed := worker.recipe_changes(checkpoint):
                how += f"; the recipe changed since: {changed}"
        elif old is not None and old.param_range == worker.param_range and (not stale or not self._donors(layers)):
            worker.sync.take(old.sync)
            how = "kept its weights"
        else:  # a stage it did not hold, or held so long ago (on standby, say) that its copy is stale
            donors = self._donors(layers)
            if donors or overlaps:
                self._set(state="fetching", epoch=epoch, layers=layers)
                try:
                    try:
                        download = worker.fetch_state(donors, enter_at=worker.plan.start_step, keep_own=not stale)
                    except StateDownloadError:
                        if not stale:
                            raise
                        download = worker.fetch_state(donors, enter_at=worker.plan.start_step)  # stale beats fresh
                    how = (f"downloaded {download.bytes / 2**20:.1f} MiB of state in {download.chunks} chunk(s) from "
                           f"{', '.join(download.donors) or 'no one'} in {download.seconds:.2f} s")
                    if download.kept:
                        how += f", kept {download.kept / 2**20:.1f} MiB of its previous stage's"
                except StateDownloadError as error:
                    how = f"{how} ({error})"
        return how

    def _donors(self, layers: tuple[int, int]) -> list[str]:
        with self.lock:
            return donors_for(self.records, layers, self.device_id)
