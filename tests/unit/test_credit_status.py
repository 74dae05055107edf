"""`hetpeer status --credit` without a server: the leaderboard as text, and a client that refuses credit no
ledger would hold."""

from __future__ import annotations

import pytest

from hetpeer.cli import build_parser
from hetpeer.coordinator.api_client import ApiClient
from hetpeer.coordinator.api_errors import ApiError
from hetpeer.coordinator.console import CREDIT_SORTS, render_credit
from hetpeer.coordinator.ledger import Credit, CreditBoard, TeamCredit
from hetpeer.protocol import swarm_pb2

NOW = 1_800_000_000.0


def credit(device_id: str, tokens: int, team: str | None = None, suspect: bool = False, **kw) -> Credit:
    fields = dict(micro_batches=tokens // 128, sequences=tokens // 128, tokens=tokens, flops=tokens * 1e9, online_s=3600.0,
                  training_s=1800.0, last_hour_tokens=tokens // 2, last_hour_flops=tokens * 5e8, claimed_sequences=0,
                  suspect=suspect, last_seen=NOW)
    fields.update(kw)
    return Credit(device_id, team, **fields)


def rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines() if line.split()[:1] and line.split()[0].isdigit()]


def test_the_leaderboard_ranks_marks_suspects_and_adds_the_teams():
    board = CreditBoard(NOW, (credit("ann-0123456789ab", 256_000, "owls"), credit("ben-abcdef012345", 1280, suspect=True,
                                                                                  training_s=7200.0)),
                        (TeamCredit("owls", 1, 256_000, 2.56e14, 3600.0, 1800.0, 128_000, 1.28e14),))
    text = render_credit(board)
    assert text.splitlines()[0].startswith("credit at ") and "2 volunteer(s), 1 team(s), ranked by tokens" in text
    header = next(line for line in text.splitlines() if line.startswith("rank  volunteer"))
    assert header.split() == ["rank", "volunteer", "device", "team", "tokens", "TFLOP", "last", "hour", "tokens",
                              "training", "h", "online", "h"]
    ann, ben, owls = rows(text)
    assert ann == ["1", "ann", "ann-0123456789ab", "owls", "256,000", "256", "128,000", "0.50", "1.00"]
    assert ben[:4] == ["2", "ben", "ben-abcdef012345", "-"] and ben[-1] == "!" and "!: claimed work" in text
    assert owls == ["1", "owls", "1", "256,000", "256", "128,000", "0.50", "1.00"]
    assert [r[1] for r in rows(render_credit(board, "training_s"))[:2]] == ["ben", "ann"]
    assert not any(line != line.rstrip() for line in text.splitlines())


def test_no_teams_no_teams_table_and_no_credit_says_so():
    text = render_credit(CreditBoard(NOW, (credit("ann-0123456789ab", 128),), ()))
    assert "rank  team" not in text and "!:" not in text and len(rows(text)) == 1
    assert render_credit(CreditBoard(0.0, (), ())) == "no credit yet: the coordinator keeps no ledger yet\n"
    assert render_credit(CreditBoard(NOW, (), ())) == "no credit yet\n"
    with pytest.raises(ValueError, match="not 'loss'"):
        render_credit(CreditBoard(NOW, (), ()), "loss")


def test_the_cli_offers_the_console_s_sorts():
    sort = next(a for a in build_parser()._subparsers._group_actions[0].choices["status"]._actions if a.dest == "sort")
    assert tuple(sort.choices) == CREDIT_SORTS and sort.default == "tokens"


class _Stub:
    def __init__(self, reply: swarm_pb2.GetCreditReply) -> None:
        self.reply = reply

    def GetCredit(self, request, timeout):  # noqa: N802 (grpc's name)
        return self.reply


def volunteer(**kw) -> swarm_pb2.VolunteerCredit:
    return swarm_pb2.VolunteerCredit(**{"device_id": "eve-0123456789ab", "tokens": 128, **kw})


@pytest.mark.parametrize("reply, where", [
    (swarm_pb2.GetCreditReply(time=NOW, volunteers=[volunteer(tokens=-5)]), "tokens: must be a finite number not below 0, got -5"),
    (swarm_pb2.GetCreditReply(time=NOW, volunteers=[volunteer(flops=float("nan"))]), "flops"),
    (swarm_pb2.GetCreditReply(time=NOW, volunteers=[volunteer(online_s=float("inf"))]), "online_s"),
    (swarm_pb2.GetCreditReply(time=float("nan")), "credit.time"),
    (swarm_pb2.GetCreditReply(time=NOW, volunteers=[volunteer(device_id="eve\x1b[2J")]), "device_id"),
    (swarm_pb2.GetCreditReply(time=NOW, volunteers=[volunteer(), volunteer()]), "listed twice"),
    (swarm_pb2.GetCreditReply(time=NOW, volunteers=[volunteer(team="no spaces")]), "team"),
    (swarm_pb2.GetCreditReply(time=NOW, teams=[swarm_pb2.TeamCredit(team="owls", volunteers=-1)]), "teams[0].volunteers"),
    (swarm_pb2.GetCreditReply(time=NOW, teams=[swarm_pb2.TeamCredit(team="")]), "teams[0].team"),
])
def test_the_client_refuses_credit_no_ledger_holds(reply, where):
    with ApiClient("127.0.0.1:1") as client:
        client._stub = _Stub(reply)
        with pytest.raises(ApiError) as error:
            client.call_get_credit()
    message = str(error.value)
    assert "the coordinator API at 127.0.0.1:1 sent credit that does not parse" in message and where in message, message
    assert "\n" not in message and "\x1b" not in message


def test_the_client_parses_good_credit():
    reply = swarm_pb2.GetCreditReply(time=NOW, volunteers=[volunteer(team="owls", suspect=True)],
                                     teams=[swarm_pb2.TeamCredit(team="owls", volunteers=1, tokens=128)])
    with ApiClient("127.0.0.1:1") as client:
        client._stub = _Stub(reply)
        board = client.call_get_credit()
    assert board.volunteers[0] == Credit("eve-0123456789ab", "owls", 0, 0, 128, 0.0, 0.0, 0.0, 0, 0.0, 0, True, 0.0)
    assert board.teams == (TeamCredit("owls", 1, 128, 0.0, 0.0, 0.0, 0, 0.0),)
