"""State download by whole-model parameter ranges, in one process over MemoryTransport: chunk c from holder
c mod D, one range assembled from donors holding different ranges, gaps, dead and lying donors, what a
donor refuses to serve, which holdings a peer keeps serving, and how much one sender may ask of it."""

from __future__ import annotations

import logging
import re
import time
from dataclasses import replace

import pytest
import torch

from hetpeer.peer.gossip.flat import FlatParams
from hetpeer.peer.gossip.group import GroupSync, SyncConfig
from hetpeer.peer.gossip.state import (
    DESCRIBE, HOLDINGS, MAX_CHUNK_ELEMS, StateDownloadError, StateLimits, StateServer, fetch_state,
)
from hetpeer.peer.transport import MemoryHub, MemoryTransport
from hetpeer.peer.transport.inbox import Late
from hetpeer.protocol.frame import FrameHeader
from test_gossip_group import NO_DECAY, one_group_plan
from test_ratelimit import Clock

MODEL = 12  # parameters of the whole model; peers hold slices of it
CHUNK = 3  # values a chunk
TENSORS = 4  # parameters, m, v, AccumAdam's window (the peers run AccumAdam: plain Adam keeps no window)
ACCUM = replace(NO_DECAY, accumulate=2)
WHOLE = torch.randn(TENSORS, MODEL, generator=torch.Generator().manual_seed(6)).abs()  # v must not be negative
PIECES = [(0, 3), (3, 6), (6, 9), (9, 10)]  # [0, 10) in chunks of 3


class Swarm:
    """p0 (the joiner, zeros over `joiner`) and donors p1.. holding `holdings`: WHOLE's slice (plus 100 i
    for p_i with `distinct`, so a test can tell who served a value), Adam step 40 + i, step 50 + i.
    `requests[d]`: the state requests as they reach d, (micro, [k, start, length]); `frames`: every frame
    delivered, (receiver, header, accepted)."""

    def __init__(self, holdings: list[tuple[int, int]], joiner: tuple[int, int] = (0, 10), distinct: bool = True,
                 limits: StateLimits = StateLimits(), clock=time.monotonic):
        self.ranges = [joiner, *holdings]
        self.devices = tuple(f"p{i}" for i in range(len(self.ranges)))
        self.hub = MemoryHub()
        self.transports: dict[str, MemoryTransport] = {}
        self.syncs: dict[str, GroupSync] = {}
        self.servers: dict[str, StateServer] = {}
        self.requests: dict[str, list[tuple[int, list[int]]]] = {d: [] for d in self.devices}
        self.frames: list[tuple[str, FrameHeader, bool]] = []
        self.offset = {d: 100.0 * i if distinct else 0.0 for i, d in enumerate(self.devices)}
        for i, (device, (start, end)) in enumerate(zip(self.devices, self.ranges)):
            transport = MemoryTransport(device, self.hub)
            transport.start()
            sync = self.sync(device, transport, start, end, zeros=i == 0)
            sync.state.step, sync.step = (0, 0) if i == 0 else (40 + i, 50 + i)
            server = StateServer(transport, device, known=lambda d: d in self.devices, limits=limits, clock=clock)
            server.hold(sync, start, end)
            transport.set_policy(lambda h, s=sync, v=server: v.accept(h) if h.kind in ("state_request", "state") else s.accept(h))
            transport.deliver = self._recording(device, transport.deliver)
            self._count(device, transport)
            self.transports[device], self.syncs[device], self.servers[device] = transport, sync, server

    def sync(self, device: str, transport: MemoryTransport, start: int, end: int, zeros: bool = False) -> GroupSync:
        """A GroupSync over parameters [start, end) of the model, holding WHOLE's values there."""
        sync = GroupSync(one_group_plan(self.devices), device, transport, FlatParams(torch.nn.Linear(end - start - 1, 1)),
                         ACCUM, SyncConfig(chunk_bytes=4 * CHUNK))
        for k, tensor in enumerate(sync.state_tensors()):
            tensor.copy_(torch.zeros(end - start) if zeros else WHOLE[k, start:end] + self.offset[device])
        return sync

    def _recording(self, device, deliver):
        def recording(header, payload, authenticated=None):
            accepted = deliver(header, payload, authenticated)
            self.frames.append((device, header, accepted))
            return accepted

        return recording

    def _count(self, device: str, transport: MemoryTransport) -> None:
        handler = transport.inbox.handlers["state_request"]

        def serve(header, request):
            self.requests[device].append((header.micro, request.tolist()))
            handler(header, request)

        transport.inbox.handlers["state_request"] = serve

    def chunks_asked(self, device: str) -> list[tuple[int, list[int]]]:
        return [(micro, request) for micro, request in self.requests[device] if request[0] != DESCRIBE]

    def state(self, device: str = "p0") -> torch.Tensor:
        return torch.stack([t.detach().clone() for t in self.syncs[device].state_tensors()])

    def fetch(self, donors, timeout_s: float = 5.0, device: str = "p0"):
        return fetch_state(self.servers[device], self.syncs[device], *self.ranges[self.devices.index(device)], donors, timeout_s)

    def expected(self, sources: dict[int, str], chunks: list[tuple[int, int, int]], start: int = 0) -> torch.Tensor:
        """The joiner's state when chunk c (tensor k, [lo, hi)) came from sources[c]."""
        end = max(hi for _, _, hi in chunks)
        state = torch.zeros(TENSORS, end - start)
        for c, (k, lo, hi) in enumerate(chunks):
            state[k, lo - start : hi - start] = WHOLE[k, lo:hi] + self.offset[sources[c]]
        return state


def chunks_of(pieces: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    return [(k, lo, hi) for k in range(TENSORS) for lo, hi in pieces]


# -- downloads that work --------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 3])
def test_download_from_d_donors_of_the_same_range_takes_chunk_c_from_donor_c_mod_d(d):
    swarm = Swarm([(0, 10)] * d)
    donors = list(swarm.devices[1:])
    download = swarm.fetch(donors)
    chunks = chunks_of(PIECES)
    assert (download.chunks, download.donors, download.bytes) == (len(chunks), tuple(donors), TENSORS * 10 * 4)
    for i, donor in enumerate(donors):
        assert [r for _, r in swarm.requests[donor] if r[0] == DESCRIBE] == [[DESCRIBE, 0, 10]]
        assert swarm.chunks_asked(donor) == [(c, [k, lo, hi - lo]) for c, (k, lo, hi) in enumerate(chunks) if c % d == i]
    assert swarm.requests["p0"] == []
    expected = swarm.expected({c: donors[c % d] for c in range(len(chunks))}, chunks)
    assert torch.equal(swarm.state(), expected)
    if d == 1:
        assert torch.equal(swarm.state(), swarm.state("p1"))  # exactly the donor's state
    assert torch.equal(swarm.syncs["p0"].flat.data, expected[0])  # the module's views were filled too
    assert swarm.syncs["p0"].state.step == 40 + d and download.step == 50 + d  # the furthest donor's
    assert not any(t.inbox.misbehaving for t in swarm.transports.values())


def test_one_range_is_assembled_from_donors_holding_different_overlapping_ranges():
    """p1 holds [0, 6), p2 [4, 10), p3 [10, 12) (nothing the joiner wants); the joiner wants [2, 9): [2, 4)
    only p1 has, [4, 6) both (chunk c from holder c mod 2), [6, 9) only p2."""
    swarm = Swarm([(0, 6), (4, 10), (10, 12)], joiner=(2, 9), distinct=False)
    download = swarm.fetch(["p1", "p2", "p3"])
    chunks = chunks_of([(2, 4), (4, 6), (6, 9)])
    holders = {(2, 4): ("p1",), (4, 6): ("p1", "p2"), (6, 9): ("p2",)}
    source = {c: holders[lo, hi][c % len(holders[lo, hi])] for c, (_, lo, hi) in enumerate(chunks)}
    for donor in ("p1", "p2"):
        assert swarm.chunks_asked(donor) == [(c, [k, lo, hi - lo]) for c, (k, lo, hi) in enumerate(chunks)
                                             if source[c] == donor]
    assert {source[c] for c in (1, 4, 7, 10)} == {"p1", "p2"}  # the shared piece came from both
    assert swarm.chunks_asked("p3") == []
    assert torch.equal(swarm.state(), WHOLE[:, 2:9])  # exact
    assert download.donors == ("p1", "p2") and download.chunks == len(chunks)
    assert swarm.syncs["p0"].state.step == 42 and download.step == 52


def moved(swarm: Swarm, start: int, end: int) -> GroupSync:
    """p0 changes stage to [start, end): its old stage (WHOLE + 500, Adam step 7) is still held beside the new."""
    old = swarm.syncs["p0"]
    with old.lock:
        for k, tensor in enumerate(old.state_tensors()):
            tensor.copy_(WHOLE[k, slice(*swarm.ranges[0])] + 500)
    old.state.step = 7
    new = swarm.sync("p0", swarm.transports["p0"], start, end, zeros=True)
    swarm.servers["p0"].hold(new, start, end)
    return new


def test_a_peer_that_changes_stage_takes_what_it_held_from_itself_and_downloads_only_the_rest():
    swarm = Swarm([(0, 10)], joiner=(2, 9))
    new = moved(swarm, 0, 10)
    download = fetch_state(swarm.servers["p0"], new, 0, 10, ["p1"], 5.0)
    state = torch.stack([t.detach().clone() for t in new.state_tensors()])
    assert torch.equal(state[:, 2:9], WHOLE[:, 2:9] + 500)  # its own, not p1's
    assert torch.equal(state[:, :2], WHOLE[:, :2] + 100) and torch.equal(state[:, 9:], WHOLE[:, 9:10] + 100)
    assert sorted(r for _, r in swarm.chunks_asked("p1")) == sorted([k, lo, n] for k in range(TENSORS) for lo, n in ((0, 2), (9, 1)))
    assert (download.kept, download.bytes, download.donors) == (7 * TENSORS * 4, 3 * TENSORS * 4, ("p1",))
    assert new.state.step == 41 and download.step == 51  # the furthest source's
    assert swarm.requests["p0"] == []


def test_a_peer_whose_old_stage_covers_the_new_one_asks_no_one():
    swarm = Swarm([(0, 10)], joiner=(2, 9))
    new = moved(swarm, 3, 6)
    download = fetch_state(swarm.servers["p0"], new, 3, 6, [], 5.0)  # no donor at all: its own copy is enough
    assert torch.equal(torch.stack([t.detach() for t in new.state_tensors()]), WHOLE[:, 3:6] + 500)
    assert (download.kept, download.bytes, download.donors, new.state.step) == (3 * TENSORS * 4, 0, (), 7)
    assert swarm.requests["p1"] == []


# -- downloads that fail, leaving the state alone ----------------------------------------------------------


def test_what_neither_the_old_stage_nor_a_donor_holds_fails_naming_the_gap():
    swarm = Swarm([(0, 2)], joiner=(2, 9))
    new = moved(swarm, 0, 10)
    with pytest.raises(StateDownloadError, match=re.escape("no donor holds parameters [9, 10) (donors hold p0 [2, 9), p1 [0, 2))")):
        fetch_state(swarm.servers["p0"], new, 0, 10, ["p1"], 5.0)
    assert torch.equal(new.flat.data, torch.zeros(10)) and swarm.chunks_asked("p1") == []
    lone = Swarm([], joiner=(2, 9))
    with pytest.raises(StateDownloadError, match=re.escape("no donor holds parameters [9, 10) (donors hold p0 [2, 9))")):
        fetch_state(lone.servers["p0"], moved(lone, 2, 10), 2, 10, [], 5.0)  # nobody to ask: its own part alone


def test_a_range_no_donor_covers_fails_naming_the_gap_and_leaves_the_state_alone():
    swarm = Swarm([(0, 4), (6, 10)], joiner=(2, 9))
    before = swarm.state()
    with pytest.raises(StateDownloadError, match=re.escape("no donor holds parameters [4, 6) (donors hold p1 [0, 4), p2 [6, 10))")):
        swarm.fetch(["p1", "p2"])
    assert torch.equal(swarm.state(), before) and swarm.syncs["p0"].state.step == 0
    assert swarm.chunks_asked("p1") == swarm.chunks_asked("p2") == []  # it knew before asking for any chunk
    gap = swarm.sync("p0", swarm.transports["p0"], 4, 6, zeros=True)
    swarm.servers["p0"].release(swarm.syncs["p0"])  # else p0 would take [4, 6) from the stage it holds
    with pytest.raises(StateDownloadError, match=re.escape("no donor (p1) described its state of parameters [4, 6)")):
        fetch_state(swarm.servers["p0"], gap, 4, 6, ["p1"], 0.2)  # p1 holds nothing of it
    assert torch.equal(gap.flat.data, torch.zeros(2))


def test_a_donor_unplugged_midway_has_all_its_chunks_asked_of_another_after_one_deadline(caplog):
    swarm = Swarm([(0, 10)] * 3)
    handler = swarm.transports["p2"].inbox.handlers["state_request"]

    def serve_then_die(header, request):  # p2 serves its description and one chunk, then drops off
        handler(header, request)
        if len(swarm.requests["p2"]) == 2:
            swarm.hub.unplug("p2")

    swarm.transports["p2"].inbox.handlers["state_request"] = serve_then_die
    with caplog.at_level(logging.INFO, "hetpeer.gossip"):
        download = swarm.fetch(["p1", "p2", "p3"], timeout_s=0.1)
    chunks = chunks_of(PIECES)
    lost = [c for c in range(len(chunks)) if c % 3 == 1 and c != 1]
    assert [c for c, _ in swarm.chunks_asked("p2")] == [1]
    assert sorted(c for c, _ in swarm.chunks_asked("p3")) == sorted([c for c in range(len(chunks)) if c % 3 == 2] + lost)
    source = {c: "p3" if c in lost else f"p{c % 3 + 1}" for c in range(len(chunks))}
    assert torch.equal(swarm.state(), swarm.expected(source, chunks))
    assert download.donors == ("p1", "p2", "p3")
    given_up = [r.getMessage() for r in caplog.records if "did not send state chunk" in r.getMessage()]
    assert len(given_up) == 1, given_up  # one deadline for p2, not one per chunk it owed


def test_when_every_donor_is_dead_the_download_fails_and_leaves_the_state_alone():
    swarm = Swarm([(0, 10)] * 2)
    before = swarm.state()
    for donor in ("p1", "p2"):  # they describe what they hold, then drop off
        handler = swarm.transports[donor].inbox.handlers["state_request"]

        def describe_then_die(header, request, handler=handler, donor=donor):
            handler(header, request)
            swarm.hub.unplug(donor)

        swarm.transports[donor].inbox.handlers["state_request"] = describe_then_die
    with pytest.raises(StateDownloadError, match=re.escape("no donor (p1, p2) sent state tensor params [0, 3) within 0.2 s")):
        swarm.fetch(["p1", "p2"], timeout_s=0.2)
    assert torch.equal(swarm.state(), before) and swarm.syncs["p0"].state.step == 0
    with pytest.raises(StateDownloadError, match=re.escape("no donor (p1, p2) described its state of parameters [0, 10) within 0.1 s")):
        swarm.fetch(["p1", "p2"], timeout_s=0.1)  # dead before they are asked
    assert torch.equal(swarm.state(), before)
    with pytest.raises(StateDownloadError, match="p0 has no peer to download its state from"):
        swarm.fetch(["p0"], timeout_s=0.1)


# -- lying donors ------------------------------------------------------------------------------------------


LIES = {
    "wrong shape": (lambda v: torch.cat([v, v[:1]]), 0, r"state chunk \d+ is fp32\[\d\], expected fp32\[\d\]"),
    "wrong dtype": (lambda v: v.to(torch.bfloat16), 0, r"is bf16\[\d\], expected fp32"),
    "NaN": (lambda v: torch.cat([v[:-1], torch.tensor([float("nan")])]), 0, "NaN or infinite"),
    "infinity": (lambda v: torch.cat([torch.tensor([float("inf")]), v[1:]]), 0, "NaN or infinite"),
    "an unasked chunk": (lambda v: v, 1, r"state chunk \d+ of request \d+ was not asked of p1"),
}


def make_liar(swarm: Swarm, device: str, lie: str) -> None:
    """`device` describes what it holds honestly and answers every chunk request with a bad chunk."""
    transport, sync, handler = swarm.transports[device], swarm.syncs[device], swarm.transports[device].inbox.handlers["state_request"]
    change, shift, _ = LIES[lie]

    def serve_bad(header, request):
        k, start, length = request.tolist()
        if k == DESCRIBE:
            return handler(header, request)
        value = change(sync.state_tensors()[k][start : start + length].clone())  # the donor holds [0, 10)
        transport.send(header.sender, "state", value, step=header.step, micro=header.micro + shift, epoch=header.epoch)

    transport.inbox.handlers["state_request"] = serve_bad


@pytest.mark.parametrize("lie", LIES)
def test_a_lying_donor_is_refused_and_its_chunks_asked_of_another(lie):
    swarm = Swarm([(0, 10)] * 2)
    make_liar(swarm, "p1", lie)
    download = swarm.fetch(["p1", "p2"], timeout_s=0.1)
    chunks = chunks_of(PIECES)
    inbox = swarm.transports["p0"].inbox
    assert inbox.misbehaving == {"p1": len(chunks) // 2}  # every chunk it was asked for, refused
    assert all(re.search(LIES[lie][2], reason) for _, reason in inbox.rejections), list(inbox.rejections)
    assert torch.equal(swarm.state(), swarm.state("p2"))  # every chunk from the honest donor
    assert download.donors == ("p2",)

    # with only the liar to ask, the download fails and nothing it sent lands in the state
    alone = Swarm([(0, 10)])
    make_liar(alone, "p1", lie)
    before = alone.state()
    with pytest.raises(StateDownloadError, match=re.escape("no donor (p1) sent state tensor params [0, 3)")):
        alone.fetch(["p1"], timeout_s=0.1)
    assert torch.equal(alone.state(), before) and alone.syncs["p0"].state.step == 0


# -- what a donor refuses -----------------------------------------------------------------------------------


def test_accept_takes_requests_from_known_peers_and_only_the_chunks_asked():
    server = Swarm([(0, 10)]).servers["p0"]
    request = dict(kind="state_request", dtype="int64", shape=(3,), step=7)
    assert server.accept(FrameHeader(sender="p1", **request)) is None
    for sender, changes, reason in [
        ("mallory", {}, "mallory is not a known peer of the swarm"),
        ("p1", {"shape": (1,)}, "a state request is three int64"),
        ("p1", {"dtype": "fp32"}, "a state request is three int64"),
    ]:
        assert server.accept(FrameHeader(sender=sender, **{**request, **changes})) == reason
    server.expect(7, 2, "p1", (3,), "fp32")
    chunk = dict(kind="state", dtype="fp32", shape=(3,), step=7, micro=2)
    assert server.accept(FrameHeader(sender="p1", **chunk)) is None
    for sender, changes, reason in [
        ("p2", {}, "state chunk 2 of request 7 was not asked of p2"),
        ("p1", {"micro": 3}, "state chunk 3 of request 7 was not asked of p1"),
        ("p1", {"step": 8}, "state chunk 2 of request 8 was not asked of p1"),
        ("p1", {"shape": (4,)}, r"state chunk 2 is fp32\[4\], expected fp32\[3\]"),
    ]:
        assert re.fullmatch(reason, server.accept(FrameHeader(sender=sender, **{**chunk, **changes})))
    server.forget(7)
    assert "was not asked" in server.accept(FrameHeader(sender="p1", **chunk))


def test_requests_from_an_unknown_sender_are_refused_and_not_answered():
    swarm = Swarm([(0, 10)])
    mallory = MemoryTransport("mallory", swarm.hub)
    mallory.start()
    received = []
    mallory.set_policy(lambda header: received.append(header))
    for request in ([DESCRIBE, 0, 10], [0, 0, 3]):
        mallory.send("p1", "state_request", torch.tensor(request), step=7)
    assert swarm.transports["p1"].inbox.misbehaving == {"mallory": 2}
    assert swarm.requests["p1"] == [] and received == []


@pytest.mark.parametrize("request_", [[0, 8, 5], [0, -1, 3], [4, 0, 3], [-2, 0, 3], [0, 0, 0], [0, 3, -1],
                                      [0, 0, MAX_CHUNK_ELEMS + 1]],
                         ids=["past-the-holding", "before-it", "no-such-tensor", "negative-tensor", "empty", "negative-length",
                              "too-long"])
def test_a_request_for_what_the_donor_does_not_hold_is_rejected_counted_and_not_answered(request_):
    swarm = Swarm([(0, 10)])
    swarm.transports["p0"].send("p1", "state_request", torch.tensor(request_), step=7)
    assert swarm.transports["p1"].inbox.misbehaving == {"p0": 1}
    assert "which this peer does not hold" in swarm.transports["p1"].inbox.rejections[-1][1]
    assert [h for d, h, _ in swarm.frames if d == "p0"] == []


def test_a_donor_serves_its_last_two_holdings_and_forgets_the_third():
    swarm = Swarm([(0, 10)], distinct=False)
    donor = swarm.servers["p1"]
    first = swarm.syncs["p1"]
    second = swarm.sync("p1", swarm.transports["p1"], 10, 12)
    donor.hold(second, 10, 12)  # p1 moves to the stage [10, 12); [0, 10) is still served while the plan settles
    assert HOLDINGS == 2 and [h.sync for h in donor.holdings] == [second, first]
    swarm.fetch(["p1"], timeout_s=0.2)
    assert torch.equal(swarm.state(), WHOLE[:, :10])
    with pytest.raises(ValueError, match=r"range \[0, 3\) is not the 2 parameters"):
        donor.hold(second, 0, 3)
    donor.hold(second, 10, 12)  # again: still two holdings, not the same one twice
    assert [h.sync for h in donor.holdings] == [second, first]
    donor.hold(swarm.sync("p1", swarm.transports["p1"], 6, 10), 6, 10)  # a third: [0, 10) is forgotten
    assert len(donor.holdings) == 2 and first not in [h.sync for h in donor.holdings]
    with pytest.raises(StateDownloadError, match=re.escape("no donor holds parameters [0, 6) (donors hold p1 [6, 10))")):
        swarm.fetch(["p1"], timeout_s=0.2)
    swarm.transports["p0"].send("p1", "state_request", torch.tensor([0, 0, 3]), step=7)
    assert swarm.transports["p1"].inbox.misbehaving == {"p0": 1}


def test_a_released_holding_is_no_longer_served():
    swarm = Swarm([(0, 10)], distinct=False)
    donor, first = swarm.servers["p1"], swarm.syncs["p1"]
    second = swarm.sync("p1", swarm.transports["p1"], 10, 12)
    donor.hold(second, 10, 12)
    donor.release(first)  # every new holder of [0, 10) has it: p1 lets its old stage go
    assert [h.sync for h in donor.holdings] == [second]
    with pytest.raises(StateDownloadError, match=re.escape("no donor (p1) described its state of parameters [0, 10)")):
        swarm.fetch(["p1"], timeout_s=0.2)


# -- how much one sender may ask ------------------------------------------------------------------------------


def test_the_default_limits_scale_with_the_holding_and_cover_any_small_model():
    swarm = Swarm([(0, 10)])
    requests, served = swarm.servers["p1"].requests.rate, swarm.servers["p1"].served.rate
    assert (requests.burst, served.burst) == (1024, 256 << 20)  # the floors: this stage is tiny
    big = StateLimits().rates([])  # nothing held: the floors too
    assert big == (requests, served)
    assert StateLimits(min_requests=1, min_bytes=1).rates(swarm.servers["p1"].holdings)[1].burst == 2 * TENSORS * 10 * 4
    for bad in (dict(copies=0.5), dict(refill_s=0.0), dict(min_requests=0), dict(min_bytes=0)):
        with pytest.raises(ValueError, match="state limits"):
            StateLimits(**bad)


def test_a_joiner_downloads_two_whole_copies_at_once_and_a_third_once_the_allowance_refills():
    """Without floors, a donor serves one sender two copies of what it holds at once (their requests and
    their bytes), refuses a third as late, and serves it once its clock has moved on."""
    clock = Clock()
    swarm = Swarm([(0, 10)], limits=StateLimits(min_requests=1, min_bytes=1), clock=clock)
    donor = swarm.transports["p1"].inbox
    for _ in range(2):
        swarm.fetch(["p1"], timeout_s=2.0)
        assert torch.equal(swarm.state(), swarm.state("p1"))
    assert donor.late == 0 and not donor.misbehaving
    with pytest.raises(StateDownloadError, match=re.escape("no donor (p1) sent state tensor params [0, 3)")):
        swarm.fetch(["p1"], timeout_s=0.2)
    assert donor.late > 0 and not donor.misbehaving  # an overshoot, not a flood: not counted against p0
    clock.now += 2 * StateLimits().copies * StateLimits().refill_s  # refilled, its debt too
    swarm.fetch(["p1"], timeout_s=2.0)
    assert torch.equal(swarm.state(), swarm.state("p1")) and not donor.misbehaving


def asker(swarm: Swarm) -> MemoryTransport:
    """p0's transport, taking whatever state it is sent (the tests count the answers)."""
    transport = swarm.transports["p0"]
    transport.set_policy(lambda header: None)
    return transport


def answers(swarm: Swarm) -> int:
    return sum(1 for d, h, accepted in swarm.frames if d == "p0" and h.kind == "state" and accepted)


def test_a_flood_of_state_requests_is_refused_late_then_counted_and_served_again_after_a_while():
    clock = Clock()
    swarm = Swarm([(0, 10)], clock=clock)
    server, inbox, p0 = swarm.servers["p1"], swarm.transports["p1"].inbox, asker(swarm)
    burst = int(server.requests.rate.burst)
    for i in range(2 * burst + 10):
        p0.send("p1", "state_request", torch.tensor([DESCRIBE, 0, 10]), step=7, micro=i)
    assert answers(swarm) == burst  # the burst is served; the rest is not
    assert inbox.late == burst  # up to a burst past the limit: no one's fault
    assert inbox.misbehaving == {"p0": 10}  # beyond: a flood, counted
    assert "over 1024 state requests at once or 51.2 a second from p0" in inbox.rejections[-1][1]
    clock.now += 5.0
    p0.send("p1", "state_request", torch.tensor([DESCRIBE, 0, 10]), step=8)
    assert answers(swarm) == burst  # still in debt
    clock.now += (1 - server.requests.available("p0")) / server.requests.rate.per_s
    p0.send("p1", "state_request", torch.tensor([DESCRIBE, 0, 10]), step=9)
    assert answers(swarm) == burst + 1


def test_bytes_served_to_one_sender_are_limited_apart_from_its_requests():
    clock = Clock()
    swarm = Swarm([(0, 10)], limits=StateLimits(min_bytes=1), clock=clock)  # 320 bytes at once: two copies of 160
    server, inbox, p0 = swarm.servers["p1"], swarm.transports["p1"].inbox, asker(swarm)
    assert server.served.rate.burst == 320
    for i in range(60):
        p0.send("p1", "state_request", torch.tensor([0, 0, 3]), step=7, micro=i)  # 12 bytes each
    assert answers(swarm) == 26  # 312 bytes
    assert inbox.late == 27 and inbox.misbehaving == {"p0": 60 - 26 - 27}
    assert "state request for tensor 0 [0, 3) over 320 B at once or 16 B/s served to p0" in inbox.rejections[-1][1]
    assert server.served.available("p2") == 320  # no one else was charged
    clock.now += 1000.0
    p0.send("p1", "state_request", torch.tensor([0, 0, 3]), step=8)
    assert answers(swarm) == 27


def test_a_late_refusal_is_late_and_a_flood_is_not():
    server = Swarm([(0, 10)] * 2, clock=Clock()).servers["p0"]
    request = FrameHeader(sender="p1", kind="state_request", dtype="int64", shape=(3,), step=7)
    burst = int(server.requests.rate.burst)
    reasons = [server.accept(request) for _ in range(2 * burst + 1)]
    assert reasons[:burst] == [None] * burst
    assert all(isinstance(r, Late) for r in reasons[burst:2 * burst])
    assert reasons[-1] is not None and not isinstance(reasons[-1], Late)
    assert server.accept(FrameHeader(sender="p2", kind="state_request", dtype="int64", shape=(3,), step=7)) is None
