"""Credit ledger benchmark: what a coordinator round's credit fold costs at 10,000 volunteers, and how large the
ledger's file grows.

    python3 benchmarks/credit.py [--peers 10000] [--rounds 5] [--stages 4] [--json]

A plan of `--stages` stages over `--peers` peers (lanes of one peer a stage). Every round each peer has trained
one more step: its record's claim and its receipts for its lane neighbours grow, as on a live swarm, so every
record's credit changes (the worst case). A round folds about `FOLD_PER_ROUND` records (each volunteer's every
`share` rounds; newcomers and leavers at once) and makes the board afresh every `share` rounds. The fold is timed
against the heartbeat it must fit in (2 s; the goal is under 1% of it) and, measured in the same run, against
what the coordinator already spends each round parsing the same records from the wire (`PeerRecord.from_wire`,
the fast exact path). The file's size is measured with every volunteer's last hour full (six buckets).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetpeer.coordinator.ledger import BUCKETS, BUCKET_S, FOLD_PER_ROUND, OPEN_EPOCHS, VOLUNTEER_BYTES, Ledger  # noqa: E402
from hetpeer.peer.pipeline.tally import Tally  # noqa: E402
from hetpeer.protocol.addresses import PeerAddress  # noqa: E402
from hetpeer.protocol.modelspec import preset  # noqa: E402
from hetpeer.protocol.plan import Plan, StagePlan  # noqa: E402
from hetpeer.protocol.records import PeerRecord  # noqa: E402
from hetpeer.protocol.workload import Workload  # noqa: E402

HEARTBEAT_S = 2.0
GOAL_SHARE = 0.01


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    spec = preset("tiny")
    workload = Workload(spec, batch=args.peers, micro_batch=1, dtype="fp32")
    lanes = args.peers // args.stages
    names = [[f"v{s}_{lane}-{s * lanes + lane:012x}" for lane in range(lanes)] for s in range(args.stages)]
    per = spec.layers // args.stages or 1
    plan = Plan(cost_model="time", model="tiny", layers=spec.layers, batch=lanes * 2, micro_batch=1, micro_batches=2,
                dtype="fp32", stages=tuple(StagePlan(s, min(s * per, spec.layers - 1), min((s + 1) * per, spec.layers),
                                                     tuple(names[s]), "gossip") for s in range(args.stages)), epoch=1)
    tallies = {d: Tally() for stage in names for d in stage}
    ledger = Ledger(spec.seq_len)
    fold_s, parse_s = [], []
    for r in range(args.rounds):
        for lane in range(lanes):  # one more step of every lane
            for s in range(args.stages):
                d = names[s][lane]
                tallies[d].trained(1, r, 2, 2)
                if s > 0:
                    tallies[d].received(names[s - 1][lane], 1, "activations", r, 2, micro=2)
                if s + 1 < args.stages:
                    tallies[d].received(names[s + 1][lane], 1, "gradients", r, 2, micro=2)
        now = 1e9 + HEARTBEAT_S * r
        records = {d: PeerRecord(device_id=d, model="tiny", dtype="fp32", device_name="cpu", tflops=1.0, memory_bytes=1 << 30,
                                 address=PeerAddress(direct=("10.0.0.1", 7000)), state="training", time=now, team=f"t{i % 100}",
                                 received=t.receipts(), trained=t.claims())
                   for i, (d, t) in enumerate(tallies.items())}
        wires = [(r_.to_wire(), d) for d, r_ in list(records.items())[:500]]
        started = time.perf_counter()
        for raw, d in wires:  # what the round already does for every record: the fast exact path of from_wire
            try:
                PeerRecord.from_wire(raw, b"", now, 60.0)
            except Exception:  # the signer check fails last, after the parse this measures (no keys here)
                pass
        parse_s.append((time.perf_counter() - started) * len(records) / len(wires))
        started = time.perf_counter()
        ledger.fold([plan], records, now, workload)
        if ledger.board_due:  # as the coordinator's round does
            ledger.board(now)
        fold_s.append(time.perf_counter() - started)
    credit = ledger.board(now)
    share = -(-args.peers // FOLD_PER_ROUND)
    least = 2 * (args.rounds - 2 * share)  # its record and its witnesses' are folded every `share` rounds
    low = min(c.sequences for c in credit.volunteers)
    assert low >= least, f"every step confirmed but the last {2 * share} rounds': the least credited has {low} of {2 * args.rounds}"
    for d in ledger.volunteers:  # a full last hour for the size
        for b in range(BUCKETS):
            ledger._gained(d, 10**9, 1e18, now + BUCKET_S * (b - BUCKETS + 1))
    for epoch in range(2, 2 + OPEN_EPOCHS):  # the credit settled into the totals, as after a few plans
        ledger.fold([Plan.from_wire({**plan.to_wire(), "epoch": epoch})], {}, now, workload)
    size = len(json.dumps(ledger.to_wire()["volunteers"], separators=(",", ":")))
    fold, parse = statistics.mean(fold_s[share:]), statistics.median(parse_s)  # the first rounds see every newcomer
    figures = {"peers": args.peers, "fold_s": fold, "share_of_heartbeat": fold / HEARTBEAT_S, "parse_s": parse,
               "fold_over_parse": fold / parse, "bytes_per_volunteer": size / len(ledger.volunteers),
               "goal_share": GOAL_SHARE, "goal_bytes": VOLUNTEER_BYTES}
    if args.json:
        print(json.dumps(figures, indent=1))
        return
    print(f"{args.peers} volunteers, {args.stages} stages, {args.rounds} rounds; each record folded every {share} round(s)")
    print(f"  credit fold and board: {fold * 1e3:.1f} ms a round (mean) = {fold / HEARTBEAT_S:.2%} of a {HEARTBEAT_S:g} s heartbeat "
          f"(goal under {GOAL_SHARE:.0%})")
    print(f"  parsing the same records (the round's own cost): {parse * 1e3:.1f} ms; the fold is {fold / parse:.2f}x that")
    print(f"  ledger file: {size / len(ledger.volunteers):.0f} bytes a volunteer (stated bound {VOLUNTEER_BYTES})")


if __name__ == "__main__":
    main()
