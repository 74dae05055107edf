"""The credit ledger: credit is the work a peer's neighbours confirm, inflation gets nothing, the file survives a
restart, and 10,000 volunteers stay within the stated size."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hetpeer.coordinator.ledger import OPEN_EPOCHS, SUSPECT_ROUNDS, VOLUNTEER_BYTES, Ledger, LedgerError, csv_text
from hetpeer.peer.data.corpus import Corpus
from hetpeer.peer.pipeline.tally import Tally
from hetpeer.protocol.addresses import PeerAddress
from hetpeer.protocol.identity import DEVICE_RE
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.records import Claim, PeerRecord, Receipt
from hetpeer.protocol.workload import Workload
from test_worker import Pipeline, make_plan

SPEC = preset("tiny")
WORKLOAD = Workload(SPEC, batch=4, micro_batch=2, dtype="fp32")


def device(name: str) -> str:
    return f"{name}-{'0' * 12}"


def named(plan: Plan) -> Plan:
    """`plan` with its s<stage>l<lane> devices named as device ids."""
    stages = tuple(replace(s, devices=tuple(device(d) for d in s.devices)) for s in plan.stages)
    return replace(plan, stages=stages)


def record(device_id: str, tally: Tally | None = None, time: float = 0.0, state: str = "training", **changes) -> PeerRecord:
    fields = dict(device_id=device_id, model="tiny", dtype="fp32", device_name="cpu", tflops=1.0, memory_bytes=1 << 30,
                  address=PeerAddress(direct=("127.0.0.1", 7000)), state=state, time=time)
    if tally is not None:
        fields.update(received=tally.receipts(), trained=tally.claims())
    fields.update(changes)
    return PeerRecord(**fields)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus.default()


def trained(plan: Plan, corpus: Corpus, steps: int) -> dict[str, Tally]:
    """Each device's tally after `steps` real steps of `plan` in memory."""
    pipeline = Pipeline(plan, corpus)
    pipeline.run(lambda worker: [worker.train_step() for _ in range(steps)])
    return {d: w.tally for d, w in pipeline.workers.items()}


def folded(plans: list[Plan], records: dict[str, PeerRecord], rounds: int = 1, ledger: Ledger | None = None) -> tuple[Ledger, list[str]]:
    ledger = ledger or Ledger(SPEC.seq_len)
    said = []
    for r in range(rounds):
        said += ledger.fold(plans, records, float(r), WORKLOAD)
    return ledger, said


def test_a_pipelines_credit_is_what_each_stage_trained(corpus):
    plan = make_plan(3, lanes=2, lane_batch=4, micro_batch=2, epoch=1, start_step=5)
    steps = 3
    tallies = trained(plan, corpus, steps)
    records = {d: record(d, t) for d, t in tallies.items()}
    board = folded([plan], records)[0].board(0.0)
    for d in plan.devices:
        credit = board.of(d)
        assert credit.sequences == steps * plan.lane_sequences(plan.position(d)[1]), d
        assert credit.micro_batches == steps * 2 and credit.tokens == credit.sequences * SPEC.seq_len
        stage = plan.stages[plan.position(d)[0]]
        last = stage.index == len(plan.stages) - 1
        assert credit.flops == pytest.approx(WORKLOAD.stage_flops(stage.layers, last=last, sequences=credit.sequences))
        assert not credit.suspect
    # each claim is the steps it trained, each receipt the neighbour's frames it took
    assert tallies["s1l0"].claims() == (Claim(1, 5, 7, 6, 12),)
    assert {(r.sender, r.kind) for r in tallies["s1l0"].receipts()} == {("s0l0", "activations"), ("s2l0", "gradients")}


def test_a_one_stage_lanes_credit_comes_from_the_group_that_mixed_it_in(corpus):
    plan = make_plan(1, lanes=2, lane_batch=2, micro_batch=1, epoch=1)
    plan = replace(plan, stages=(replace(plan.stages[0], sync="allreduce"),))
    tallies = trained(plan, corpus, 4)
    assert [r.kind for r in tallies["s0l0"].receipts()] == ["params"]
    board = folded([plan], {d: record(d, t) for d, t in tallies.items()})[0].board(0.0)
    assert [board.of(d).sequences for d in plan.devices] == [8, 8]
    # alone in its group, nobody sees its work: no credit
    alone = make_plan(1, lanes=1, lane_batch=2, micro_batch=1, epoch=1)
    tallies = trained(alone, corpus, 2)
    assert folded([alone], {d: record(d, t) for d, t in tallies.items()})[0].board(0.0).of("s0l0").sequences == 0


def honest(plan: Plan, steps: int) -> dict[str, Tally]:
    """Tallies as a plan's workers count them over `steps` steps, without running the model (`trained` shows the
    workers count so)."""
    tallies, lanes = {d: Tally() for d in plan.devices}, plan.lanes
    for step in range(plan.start_step, plan.start_step + steps):
        for lane in range(plan.group_size):
            devices, sizes = lanes[lane], plan.micro_batch_sizes(lane)
            for s, d in enumerate(devices):
                tallies[d].trained(plan.epoch, step, len(sizes), sum(sizes))
                for size in sizes:
                    if s > 0:
                        tallies[d].received(devices[s - 1], plan.epoch, "activations", step, size)
                    if s + 1 < len(devices):
                        tallies[d].received(devices[s + 1], plan.epoch, "gradients", step, size)
    return tallies


def inflated(tally: Tally, factor: int, sender: str | None = None) -> Tally:
    """A tally whose claims (or, with `sender`, its receipts for that peer) say `factor` times as much."""
    out = Tally()
    for c in tally.claims():
        out.trained(c.epoch, c.first, c.micro, c.sequences * (factor if sender is None else 1))
        out.trained(c.epoch, c.last * (factor if sender is None else 1), 0, 0)
    for r in tally.receipts():
        grow = factor if r.sender == sender else 1
        out.received(r.sender, r.epoch, r.kind, r.first, r.sequences * grow, micro=r.micro * grow)
        out.received(r.sender, r.epoch, r.kind, r.last * grow, 0, micro=0)
    return out


def test_inflated_claims_and_receipts_earn_nothing_and_a_repeated_claim_is_reported():
    plan = named(make_plan(3, lanes=2, lane_batch=4, micro_batch=2, epoch=1))
    tallies = honest(plan, 10)
    fair = folded([plan], {d: record(d, t) for d, t in tallies.items()})[0].board(0.0)
    liar, helper = plan.lanes[0][1], plan.lanes[0][0]
    cheating = dict(tallies, **{liar: inflated(tallies[liar], 10)})
    ledger, said = folded([plan], {d: record(d, t) for d, t in cheating.items()}, rounds=SUSPECT_ROUNDS)
    board = ledger.board(0.0)
    assert board.of(liar).sequences == fair.of(liar).sequences == 40
    assert board.of(liar).suspect and not board.of(helper).suspect
    assert len(said) == 1 and liar in said[0] and "confirm 40" in said[0]
    # one neighbour vouching for more than the other saw gets nothing beyond the other's receipt
    vouching = dict(cheating, **{helper: inflated(tallies[helper], 10, sender=liar)})
    assert folded([plan], {d: record(d, t) for d, t in vouching.items()})[0].board(0.0).of(liar).sequences == 40
    # receipts for a peer that is not the witness's neighbour do not count
    stranger = plan.lanes[1][0]
    extra = Tally()
    extra.received(liar, 1, "activations", 0, 400)
    assert folded([plan], {**{d: record(d, t) for d, t in cheating.items()}, stranger: record(stranger, extra)})[0] \
        .board(0.0).of(liar).sequences == 40


def test_a_colluding_pair_gets_no_more_than_every_step_of_the_swarms_window():
    plan = named(make_plan(2, lanes=3, lane_batch=4, micro_batch=2, epoch=1))
    tallies = honest(plan, 10)
    pair = plan.lanes[0]
    cheating = dict(tallies, **{pair[0]: inflated(tallies[pair[0]], 10, sender=pair[1]),
                                pair[1]: inflated(tallies[pair[1]], 10, sender=pair[0])})
    cheating = {d: inflated(t, 10) if d in pair else t for d, t in cheating.items()}
    board = folded([plan], {d: record(d, t) for d, t in cheating.items()})[0].board(0.0)
    # the other lanes' peers say the epoch is at step 9: the pair is credited at most steps 0-9 of its lane
    assert board.of(pair[0]).sequences <= 11 * 4 and board.of(pair[1]).sequences <= 11 * 4


def test_work_on_steps_a_later_plan_rolled_back_is_taken_back():
    first = named(make_plan(2, lanes=1, lane_batch=4, micro_batch=2, epoch=1))
    ledger, _ = folded([first], {d: record(d, t) for d, t in honest(first, 20).items()})
    assert ledger.board(0.0).of(first.devices[0]).sequences == 80
    resumed = replace(first, epoch=2, start_step=12)  # from checkpoints of step 12: steps 12-19 are trained again
    folded([first, resumed], {}, ledger=ledger)
    assert [ledger.board(0.0).of(d).sequences for d in first.devices] == [48, 48]


def test_the_ledger_survives_a_restart_and_settles_old_epochs(tmp_path):
    plans = [named(make_plan(2, lanes=2, lane_batch=4, micro_batch=2, epoch=e, start_step=10 * e)) for e in range(1, 3)]
    ledger = Ledger(SPEC.seq_len)
    for plan in plans:
        ledger.fold([plan], {d: record(d, t, time=1.0, team="red") for d, t in honest(plan, 10).items()}, 5.0, WORKLOAD)
    path = tmp_path / "credit.json"
    ledger.save(path)
    again = Ledger.load(path, SPEC.seq_len)
    assert again.board(5.0) == ledger.board(5.0)
    assert again.board(5.0).teams[0].team == "red" and again.board(5.0).teams[0].tokens == 4 * 80 * SPEC.seq_len
    # epochs beyond the open ones are settled into the totals: the credit stays
    for e in range(3, 4 + OPEN_EPOCHS):
        again.fold([named(make_plan(2, lanes=2, lane_batch=4, micro_batch=2, epoch=e, start_step=10 * e))], {}, 6.0, WORKLOAD)
    assert len(again.epochs) == OPEN_EPOCHS
    assert [c.sequences for c in again.board(6.0).volunteers] == [80] * 4
    assert "device_id,name,team" in csv_text(again.board(6.0)).splitlines()[0]


def test_a_file_that_is_not_a_ledger_is_refused_naming_it(tmp_path):
    path = tmp_path / "credit.json"
    for text in ("{", json.dumps({"version": 99}), json.dumps({"version": 1, "last_round": None, "volunteers": {"a": [1]},
                                                                "epochs": {}})):
        path.write_text(text)
        with pytest.raises(LedgerError, match="credit.json"):
            Ledger.load(path, SPEC.seq_len)
        assert path.read_text() == text  # nothing is lost
    assert Ledger.load(tmp_path / "none.json", SPEC.seq_len).volunteers == {}


def test_ten_thousand_volunteers_fit_the_stated_size():
    ledger = Ledger(SPEC.seq_len)
    names = [f"volunteer_{i:014d}"[:24] + "-" + f"{i:012x}" for i in range(10_000)]
    assert all(DEVICE_RE.match(n) for n in names[:3])
    plan = Plan(cost_model="time", model="tiny", layers=SPEC.layers, batch=10_000, micro_batch=1, micro_batches=2,
                dtype="fp32", stages=(StagePlan(0, 0, 2, tuple(names[0::2]), "gossip"),
                                      StagePlan(1, 2, 4, tuple(names[1::2]), "gossip")), epoch=1)
    tallies = honest(plan, 3)
    records = {d: record(d, t, team=f"team-{i % 100}", time=1e9 + 0.1 * i) for i, (d, t) in enumerate(tallies.items())}
    for r in range(BUCKETS_FILLED := 6):
        ledger.fold([plan], records, 1e9 + 600.0 * r, WORKLOAD)
        for d in records:  # a full last hour: credit gained in every bucket
            ledger._gained(d, 1_000_000, 1e15, 1e9 + 600.0 * r)
    for epoch in range(2, 2 + OPEN_EPOCHS):
        ledger.fold([replace(plan, epoch=epoch)], {}, 1e9 + 4000.0, WORKLOAD)  # the work is settled into the totals
    assert len(ledger.volunteers) == 10_000 and all(len(v.buckets) == BUCKETS_FILLED for v in ledger.volunteers.values())
    size = len(json.dumps(ledger.to_wire()["volunteers"], separators=(",", ":")))
    assert size < 10_000 * VOLUNTEER_BYTES, size


def test_a_large_swarm_is_folded_in_turns_and_a_leaving_peer_at_once(monkeypatch):
    monkeypatch.setattr("hetpeer.coordinator.ledger.FOLD_PER_ROUND", 2)  # 6 peers: each folded every 3rd round
    plan = named(make_plan(3, lanes=2, lane_batch=4, micro_batch=2, epoch=1))
    ledger = Ledger(SPEC.seq_len)
    ledger.fold([plan], {d: record(d, t) for d, t in honest(plan, 1).items()}, 0.0, WORKLOAD)  # newcomers: all at once
    assert all(c.sequences == 4 for c in ledger.board(0.0).volunteers)
    later = {d: record(d, t, time=1.0) for d, t in honest(plan, 5).items()}
    ledger.fold([plan], later, 1.0, WORKLOAD)
    assert 4 in [c.sequences for c in ledger.board(1.0).volunteers]  # not every record's turn yet
    for r in range(2, 8):
        ledger.fold([plan], later, float(r), WORKLOAD)
    assert [c.sequences for c in ledger.board(8.0).volunteers] == [20] * 6
    leaving = {d: record(d, t, time=9.0, state="leaving") for d, t in honest(plan, 6).items()}
    ledger.fold([plan], leaving, 9.0, WORKLOAD)
    assert ledger.board_due and [c.sequences for c in ledger.board(9.0).volunteers] == [24] * 6


def test_a_banned_peers_credit_for_the_epoch_is_voided_and_stays_voided_across_a_restart(tmp_path):
    plan = named(make_plan(2, lanes=2, lane_batch=4, micro_batch=2, epoch=1))
    tallies = honest(plan, 10)
    records = {d: record(d, t) for d, t in tallies.items()}
    ledger, _ = folded([plan], records)
    banned, kept = plan.devices[0], plan.devices[1]
    before = ledger.board(0.0).of(kept).sequences
    assert ledger.board(0.0).of(banned).sequences > 0
    assert ledger.void(banned, plan.epoch, 1.0)
    assert ledger.board(1.0).of(banned).sequences == 0
    assert ledger.board(1.0).of(kept).sequences == before
    folded([plan], records, ledger=ledger)  # its records say the same work again: still nothing
    assert ledger.board(2.0).of(banned).sequences == 0
    ledger.save(tmp_path / "credit.json")
    again = Ledger.load(tmp_path / "credit.json", ledger.seq_len)
    folded([plan], records, ledger=again)
    assert again.board(3.0).of(banned).sequences == 0 and again.board(3.0).of(kept).sequences == before
    assert not ledger.void(banned, 7, 4.0)  # an epoch the ledger never saw
