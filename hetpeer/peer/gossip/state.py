"""Downloading a stage's state (parameters, Adam moments, step) from the group before (re)joining it.

The state is the concatenation of the stage's flat parameters and its optimizer tensors, cut into
chunks. Chunk c is asked of donor c mod D, so D donors serve at once; a donor that does not answer a
chunk by the deadline has it asked of the next donor, until every donor has failed it. Donors answer
from their live state under a short lock, between their own steps: serving never waits for averaging,
and a donor never stalls its training for a joiner. Chunks from different donors (or different steps
of one donor) differ by no more than the group's consensus distance, which the next mixing rounds
close. Every chunk is checked like any frame: sender in the group, shape, dtype, finite values.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from hetpeer.peer.gossip.group import META, GroupSync
from hetpeer.peer.transport.inbox import PeerUnreachable, TransportError, TransportTimeout

log = logging.getLogger("hetpeer.gossip")
_request_ids = itertools.count(int(time.time()) % 2**31)


class StateDownloadError(TransportError):
    """No donor delivered some part of the state."""


@dataclass(frozen=True, slots=True)
class Download:
    step: int  # the step the donors were at, where the joiner enters
    chunks: int
    donors: tuple[str, ...]
    bytes: int
    seconds: float


def fetch_state(sync: GroupSync, donors: list[str] | tuple[str, ...], timeout_s: float) -> Download:
    """Fill `sync`'s parameters and optimizer state from `donors` (members of its group)."""
    donors = tuple(d for d in donors if d != sync.device_id)
    if not donors:
        raise StateDownloadError(f"{sync.device_id} has no group member to download its state from")
    started = time.perf_counter()
    request = next(_request_ids)
    tensors = sync.state_tensors()
    total = sync.flat.size * len(tensors)
    chunks = -(-total // sync.chunk_elems)
    transport, epoch = sync.transport, sync.plan.epoch
    asked = {c: 0 for c in range(chunks)}  # chunk -> index of the donor asked last

    def ask(chunk: int, attempt: int) -> None:
        asked[chunk] = attempt
        donor = donors[(chunk + attempt) % len(donors)]
        try:
            transport.send(donor, "state_request", torch.tensor([chunk]), step=request, epoch=epoch)
        except PeerUnreachable as error:
            log.info("%s: state request to %s failed: %s", sync.device_id, donor, error)

    for donor in donors:
        try:
            transport.send(donor, "state_request", torch.tensor([META]), step=request, epoch=epoch)
        except PeerUnreachable:
            pass
    for chunk in range(chunks):
        ask(chunk, 0)
    parts: dict[int, torch.Tensor] = {}
    for chunk in range(chunks):
        while chunk not in parts:
            attempt = asked[chunk]
            donor = donors[(chunk + attempt) % len(donors)]
            try:
                parts[chunk] = transport.recv("state", donor, request, chunk, timeout_s)
            except TransportTimeout:
                if attempt + 1 >= len(donors):
                    raise StateDownloadError(
                        f"{sync.device_id}: no donor ({', '.join(donors)}) sent state chunk {chunk} within {timeout_s:g} s"
                    ) from None
                log.info("%s: %s did not send state chunk %d; asking another donor", sync.device_id, donor, chunk)
                ask(chunk, attempt + 1)
    adam_step, size, step = _description(transport, donors, request, timeout_s)
    if size != sync.flat.size:
        raise StateDownloadError(f"the donors hold {size} parameters for this stage, this peer {sync.flat.size}")
    whole = torch.cat([parts[c] for c in range(chunks)]).to(sync.flat.data.device)
    with sync.lock:
        for k, tensor in enumerate(tensors):
            tensor.copy_(whole[k * sync.flat.size : (k + 1) * sync.flat.size])
        sync.state.step = adam_step
    return Download(step, chunks, donors, whole.numel() * 4, time.perf_counter() - started)


def _description(transport, donors: tuple[str, ...], request: int, timeout_s: float) -> tuple[int, int, int]:
    """(Adam step, parameter count, step) from the first donor that answered."""
    for donor in donors:
        try:
            return tuple(int(v) for v in transport.recv("state", donor, request, META, timeout_s))
        except TransportTimeout:
            timeout_s = 0.1  # the others had as long to answer
    raise StateDownloadError(f"no donor ({', '.join(donors)}) described its state")
