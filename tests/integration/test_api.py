"""The coordinator's gRPC API on 127.0.0.1: a real server and client, the progress figures, the failures."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import replace

import pytest

from hetpeer import logline
from hetpeer.coordinator.api import ApiServer
from hetpeer.coordinator.api_client import ApiClient
from hetpeer.coordinator.api_errors import ApiError
from hetpeer.coordinator.console import render_status, status_json
from hetpeer.coordinator.view import PeerStatus, Progress, SwarmView, progress
from hetpeer.peer.reach import free_port
from hetpeer.protocol import swarm_pb2
from hetpeer.protocol.addresses import PeerAddress
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.records import LinkMeasurement, PeerRecord
from hetpeer.protocol.stepcosts import StepCosts

NOW = 1000.0


def make_plan() -> Plan:
    """2 stages x 2 lanes over 6 layers; e on standby."""
    return Plan.from_wire({
        "version": 1, "epoch": 3, "start_step": 100, "cost_model": "time", "model": "tiny", "layers": 6,
        "batch": 8, "micro_batch": 1, "micro_batches": 4, "dtype": "fp16",
        "stages": [
            {"index": 0, "layer_start": 0, "layer_end": 4, "devices": ["a", "b"], "sync": "allreduce"},
            {"index": 1, "layer_start": 4, "layer_end": 6, "devices": ["c", "d"], "sync": "gossip"},
        ],
        "standby": ["e"],
        "cost": {"total_s": 1.5, "sync_s": 0.25},
    })


def record(device: str, state: str = "training", **kw) -> PeerRecord:
    base = dict(
        device_id=device, model="tiny", dtype="fp16", device_name=f"GPU {device}", tflops=10.0, memory_bytes=1 << 30,
        address=PeerAddress(
            direct=("127.0.0.1", 7000 + ord(device[0])), p2p=(f"/ip4/127.0.0.1/tcp/9000/p2p/Qm{device}",)
        ),
        state=state, time=NOW - 2.0, epoch=3, software="hetpeer 0.1.0",
    )
    base.update(kw)
    return PeerRecord(**base)


def make_peers() -> dict[str, PeerRecord]:
    peers = [
        record("a", layers=(0, 4), step=105, tokens_per_s=0.0, achieved_tflops=6.5, noise_scale=1000.0,
               links={"b": LinkMeasurement(0.001, 1e9), "c": LinkMeasurement(0.05, 1.25e7)},
               dht=("/ip4/127.0.0.1/tcp/31338/p2p/QmDhta",)),
        # what the coordinator plans by beyond the figures shown: its device shared, its step's costs
        record("b", layers=(0, 4), step=104, compute_key="0123456789abcdef", compute_share=0.5, compute_background=0.2, compute_own=0.05,
               timings=3,
               step_costs=StepCosts(1e-4, 2e-4, 5e-10, 3e-4, int8_s_per_value=4e-9), unreachable=("d",), unreachable_how=("punch",), reachable="none", punch=40123,
               punched=("c",), relayed=("a", "d")),
        # the gradient noise scale its all-reduce group measures: the swarm's is the median over those training
        record("c", layers=(4, 6), step=105, loss=2.0, tokens_per_s=300.0, time=NOW - 7.5, noise_scale=4000.0),
        record("d", layers=(4, 6), step=103, loss=3.0, tokens_per_s=200.0),
        # On standby, still announcing its last lane's figures: counted by state, not for throughput.
        record("e", state="standby", layers=(4, 6), step=999, loss=9.0, tokens_per_s=1000.0, noise_scale=1e9),
        record("f", state="fetching", step=0, address=PeerAddress(direct=("127.0.0.1", 7777))),
    ]
    return {r.device_id: r for r in peers}


def view(plan: Plan | None = None, peers=None) -> SwarmView:
    return SwarmView(
        swarm="demo", coordinator_key="ab" * 32, plan=plan, plan_time=990.0 if plan else None,
        peers=make_peers() if peers is None else peers, dropped=2, now=NOW,
    )


# --- the pure figures -------------------------------------------------------------------------------


def test_progress_counts_the_last_stage_of_the_plan():
    p = progress(view(make_plan()))
    assert p == Progress(
        swarm="demo", coordinator_key="ab" * 32, epoch=3, step=105, loss=2.5, tokens_per_s=500.0,
        peers_by_state={"fetching": 1, "standby": 1, "training": 4}, dropped=2, noise_scale=2500.0,
    )


def test_progress_without_a_plan_or_a_last_stage_loss():
    p = progress(view(None))
    assert (p.epoch, p.step, p.loss, p.tokens_per_s) == (-1, 105, None, 0.0)
    peers = make_peers()
    peers = {d: r for d, r in peers.items() if d not in ("c", "d")}  # the last stage is gone
    p = progress(view(make_plan(), peers))
    assert (p.loss, p.tokens_per_s, p.step) == (None, 0.0, 105)
    assert progress(view(make_plan(), {})).step == 0


def test_progress_mean_loss_over_those_that_announce_one():
    peers = make_peers()
    peers["d"] = record("d", layers=(4, 6), loss=None, tokens_per_s=50.0)
    p = progress(view(make_plan(), peers))
    assert (p.loss, p.tokens_per_s) == (2.0, 350.0)


def test_progress_mean_validation_loss_of_the_last_stage(serve):
    peers = make_peers()
    peers["c"] = record("c", layers=(4, 6), step=105, loss=2.0, val_loss=2.5, tokens_per_s=300.0)
    peers["e"] = record("e", state="standby", layers=(4, 6), val_loss=9.0)  # on standby: not counted
    v = view(make_plan(), peers)
    assert progress(v).val_loss == 2.5 and progress(view(make_plan())).val_loss is None
    server = serve(lambda: v)
    with ApiClient(server.address) as client:
        figures, listed = client.call_get_progress(), {p.record.device_id: p for p in client.call_list_peers()}
    assert figures == progress(v) and listed["c"].record.val_loss == 2.5
    assert "loss 2.5000  val 2.5000" in render_status(make_plan(), list(listed.values()), figures)


def test_status_shows_each_peer_s_int8_rate_where_it_measured_one():
    """b measured 4 ns a value to encode and decode int8: 1,000 MB/s of fp32; the others measured none."""
    text = render_status(make_plan(), [PeerStatus(r, 1.0) for r in make_peers().values()], progress(view(make_plan(), make_peers())))
    rows = {line.split()[0]: line for line in text.splitlines() if line[:1] in "abcdef" and len(line.split()) > 8}
    assert "int8 MB/s" in text
    assert "1,000" in rows["b"].split() and "1,000" not in rows["a"].split()


def test_progress_counts_the_last_step_of_peers_that_left_under_the_plan():
    peers = make_peers()
    peers["c"] = record("c", state="leaving", layers=(4, 6), step=200, loss=1.0, tokens_per_s=300.0)
    peers["g"] = record("g", state="leaving", epoch=2, step=500)  # left under an older plan: not this plan's step
    p = progress(view(make_plan(), peers))
    assert p.step == 200
    assert (p.loss, p.tokens_per_s) == (2.0, 500.0)  # its last loss and pace count too
    assert p.peers_by_state["leaving"] == 2


# --- over gRPC ----------------------------------------------------------------------------------------


def test_plan_round_trips(serve):
    plan = make_plan()
    server = serve(lambda: view(plan))
    assert server.port > 0 and server.address == f"127.0.0.1:{server.port}"
    with ApiClient(server.address) as client:
        got, published = client.call_get_plan()
    assert got == plan and got.to_wire() == plan.to_wire()
    assert published == 990.0


def test_no_plan(serve):
    server = serve(lambda: view(None))
    with ApiClient(server.address) as client:
        assert client.call_get_plan() == (None, None)
        assert client.call_get_progress().epoch == -1


def test_peers_with_links_and_age(serve):
    peers = make_peers()
    server = serve(lambda: view(make_plan(), peers))
    with ApiClient(server.address) as client:
        listed = client.call_list_peers()
    assert [p.record.device_id for p in listed] == sorted(peers)
    for status in listed:
        assert status.record == peers[status.record.device_id]
    by_id = {p.record.device_id: p for p in listed}
    assert by_id["a"].record.links == {"b": LinkMeasurement(0.001, 1e9), "c": LinkMeasurement(0.05, 1.25e7)}
    assert by_id["c"].age_s == 7.5 and by_id["a"].age_s == 2.0
    assert by_id["f"].record.layers is None and by_id["f"].record.address.p2p == ()


def test_progress_over_the_wire_matches_the_pure_figures(serve):
    v = replace(view(make_plan()), step_overhead_s=0.025)
    server = serve(lambda: v)
    with ApiClient(server.address) as client:
        assert client.call_get_progress() == progress(v)


def test_render_status_and_json(serve):
    v = view(make_plan())
    server = serve(lambda: v)
    with ApiClient(server.address) as client:
        plan, published = client.call_get_plan()
        peers = client.call_list_peers()
        figures = client.call_get_progress()
    text = render_status(plan, peers, figures, published)
    for needle in ("swarm demo", "epoch 3", "step 105", "loss 2.5000", "tokens/s 500.0", "noise scale 2,500 tokens",
                   "2 records dropped",
                   "GPU c", "s1/l0 [4,6)", "standby", "lane 1: b -> d", "stage 0 layers [0,4) allreduce: a b",
                   f"published {logline.at(published)}: 2 stage(s) x 2 lane(s)"):
        assert needle in text, needle
    row = next(line for line in text.splitlines() if line.startswith("c "))
    assert "training" in row and "300.0" in row and "2.0000" in row
    assert "6.5" in next(line for line in text.splitlines() if line.startswith("a "))  # what its training achieved
    doc = json.loads(json.dumps(status_json(plan, peers, figures, published)))
    assert doc["tokens_per_s"] == 500.0 and doc["loss"] == 2.5 and doc["plan"] == make_plan().to_wire()
    assert [p["device_id"] for p in doc["peers"]] == ["a", "b", "c", "d", "e", "f"]
    assert "no plan yet" in render_status(None, [], progress(view(None, {})))


# --- failures -----------------------------------------------------------------------------------------


def test_unreachable_address_fails_fast():
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with ApiClient(address, timeout_s=2.0) as client, pytest.raises(ApiError) as error:
        client.call_get_progress()
    assert time.monotonic() - started < 3.0
    message = str(error.value)
    assert address in message and "cannot reach" in message and "\n" not in message


def test_busy_port_is_refused(serve):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ApiError, match=f"127.0.0.1:{port}"):
            ApiServer(lambda: view(None), listen=f"127.0.0.1:{port}").start()
    first = serve(lambda: view(None))
    with pytest.raises(ApiError, match=first.address):
        ApiServer(lambda: view(None), listen=first.address).start()


class _CorruptPlan(ApiServer):
    plan_json = "{not json"

    def rpc_get_plan(self, request, context):
        return swarm_pb2.GetPlanReply(has_plan=True, plan_json=self.plan_json, epoch=3)


class _NewerPlan(_CorruptPlan):
    plan_json = json.dumps({**make_plan().to_wire(), "version": 2})


class _BadPeer(ApiServer):
    fields: dict = {"tflops": float("nan")}

    def rpc_list_peers(self, request, context):
        return swarm_pb2.ListPeersReply(peers=[swarm_pb2.Peer(device_id="x", state="training", **self.fields)])


class _NoShare(_BadPeer):
    fields = {"compute_share": 0.0}


class _ShortCosts(_BadPeer):
    fields = {"step_costs": [1e-4, 2e-4]}


class _NegativeCost(_BadPeer):
    fields = {"step_costs": [1e-4, -2e-4, 0.0, 0.0]}


class _BadProgress(ApiServer):
    def rpc_get_progress(self, request, context):
        return swarm_pb2.GetProgressReply(swarm="demo", step_overhead_s=float("inf"))


@pytest.mark.parametrize("cls, call", [
    (_CorruptPlan, "call_get_plan"), (_NewerPlan, "call_get_plan"), (_BadPeer, "call_list_peers"), (_NoShare, "call_list_peers"),
    (_ShortCosts, "call_list_peers"), (_NegativeCost, "call_list_peers"), (_BadProgress, "call_get_progress"),
])
def test_client_refuses_what_does_not_parse(serve, cls, call):
    server = serve(lambda: view(make_plan()), cls)
    with ApiClient(server.address) as client, pytest.raises(ApiError, match="does not parse") as error:
        getattr(client, call)()
    assert server.address in str(error.value)


def test_server_error_becomes_api_error(serve):
    def broken() -> SwarmView:
        raise RuntimeError("view lost")

    server = serve(broken)
    with ApiClient(server.address) as client, pytest.raises(ApiError, match=server.address):
        client.call_get_plan()


# --- credit -------------------------------------------------------------------------------------------


def make_board():
    from hetpeer.coordinator.ledger import Credit, CreditBoard, TeamCredit

    alice = Credit("alice-0123456789ab", "red", 40, 160, 20480, 3.5e13, 7200.0, 5400.0, 2048, 4e12, 16, False, NOW - 1)
    bob = Credit("bob-abcdef012345", None, 10, 40, 5120, 8.75e12, 3600.0, 3600.0, 4096, 6e12, 90, True, NOW - 3)
    carol = Credit("carol-00112233aabb", "red", 0, 0, 0, 0.0, 60.0, 0.0, 0, 0.0, 0, False, NOW - 30)
    team = TeamCredit("red", 2, 20480, 3.5e13, 7260.0, 5400.0, 2048, 4e12)
    return CreditBoard(NOW, (alice, bob, carol), (team,))


def test_credit_round_trips(serve):
    board = make_board()
    server = serve(lambda: view(None), get_credit=lambda: board)
    with ApiClient(server.address) as client:
        got = client.call_get_credit()
    assert got == board and got.to_wire() == board.to_wire()
    assert got.of("bob-abcdef012345").team is None and got.of("bob-abcdef012345").suspect


def test_no_credit_yet(serve):
    server = serve(lambda: view(None))  # the coordinator keeps no ledger (yet)
    with ApiClient(server.address) as client:
        got = client.call_get_credit()
    assert (got.time, got.volunteers, got.teams) == (0.0, (), ())


def test_credit_of_a_ledger_round_trips(serve):
    from hetpeer.coordinator.ledger import Ledger

    board = Ledger(seq_len=128).board(NOW)
    server = serve(lambda: view(None), get_credit=lambda: board)
    with ApiClient(server.address) as client:
        assert client.call_get_credit() == board


def test_status_credit_prints_the_leaderboard(serve):
    import subprocess
    import sys

    server = serve(lambda: view(None), get_credit=make_board)

    def status(*args):
        return subprocess.run([sys.executable, "-m", "hetpeer", "status", "--api", server.address, "--credit", *args],
                              capture_output=True, text=True, timeout=60)

    done = status()
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    rows = [line.split() for line in lines if line.split()[:1] in (["1"], ["2"], ["3"])]
    assert rows[0][:7] == ["1", "alice", "alice-0123456789ab", "red", "20,480", "35", "2,048"]
    assert rows[1][:4] == ["2", "bob", "bob-abcdef012345", "-"] and rows[1][-1] == "!"
    assert rows[2][:4] == ["3", "carol", "carol-00112233aabb", "red"]
    assert rows[3][:3] == ["1", "red", "2"]  # the teams' table
    done = status("--sort", "last_hour_tokens")
    assert [line.split()[1] for line in done.stdout.splitlines() if line.split()[:1] in (["1"], ["2"])][:2] == ["bob", "alice"]
    done = status("--json")
    assert json.loads(done.stdout) == json.loads(json.dumps(make_board().to_wire()))
    done = subprocess.run([sys.executable, "-m", "hetpeer", "status", "--api", server.address, "--sort", "flops"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--sort ranks the --credit leaderboard" in done.stderr


class _NegativeCredit(ApiServer):
    def rpc_get_credit(self, request, context):
        return swarm_pb2.GetCreditReply(time=NOW, volunteers=[swarm_pb2.VolunteerCredit(device_id="eve-0123456789ab", tokens=-5)])


def test_client_refuses_negative_credit(serve):
    server = serve(lambda: view(None), _NegativeCredit)
    with ApiClient(server.address) as client, pytest.raises(ApiError, match="does not parse") as error:
        client.call_get_credit()
    assert server.address in str(error.value) and "tokens" in str(error.value) and "-5" in str(error.value)
