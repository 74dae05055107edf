"""The client of the coordinator's gRPC API (`api.py`): what `hetpeer status --api HOST:PORT`, the swarm
demo and the testbed read the plan, the peers, the progress and the credit with (`console.py` draws what it
reads).

It parses every reply as strictly as a peer parses a DHT record, and turns every failure into one
`ApiError` line; over TLS (`tls.ClientTls`), a client and server that do not agree are one
`ApiTlsError` that says which flag to change.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

import grpc

from hetpeer.coordinator.api_errors import ApiError, ApiTlsError
from hetpeer.coordinator.ledger import Credit, CreditBoard, TeamCredit
from hetpeer.coordinator.tls import ClientTls
from hetpeer.coordinator.view import PeerStatus, Progress
from hetpeer.protocol import swarm_pb2, swarm_pb2_grpc
from hetpeer.protocol.addresses import PeerAddress
from hetpeer.protocol.identity import DEVICE_RE
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.records import MAX_PLAN_BYTES, STATES, TEAM_RE, LinkMeasurement, PeerRecord, planning_fields
from hetpeer.protocol.stepcosts import StepCosts
from hetpeer.protocol.wire import SchemaError


def _peer_from_pb(pb: swarm_pb2.Peer) -> PeerStatus:
    """A peer as the server describes it; SchemaError for what no coordinator would serve."""
    path = f"peers[{pb.device_id!r}]"
    if not pb.device_id:
        raise SchemaError("peers", "a peer without a device id")
    if pb.state not in STATES:
        raise SchemaError(f"{path}.state", f"must be one of {', '.join(STATES)}, got {pb.state!r}")
    numbers = [pb.tflops, pb.tokens_per_s, pb.time, pb.age_s]
    numbers += [x for link in pb.links for x in (link.latency_s, link.bandwidth_bytes_per_s)]
    numbers += [getattr(pb, name) for name in ("loss", "val_loss") if pb.HasField(name)]
    if pb.HasField("noise_scale") and not (math.isfinite(pb.noise_scale) and pb.noise_scale > 0):
        raise SchemaError(f"{path}.noise_scale", f"must be a finite, positive number of tokens, got {pb.noise_scale!r}")
    if pb.HasField("achieved_tflops"):
        numbers.append(pb.achieved_tflops)
    if not all(math.isfinite(x) for x in numbers):
        raise SchemaError(path, "carries a number that is not finite")
    if pb.HasField("layer_start") != pb.HasField("layer_end"):
        raise SchemaError(f"{path}.layers", "has a start without an end, or an end without a start")
    # an older coordinator sends none of these: the record's defaults
    key = pb.compute_key if pb.HasField("compute_key") else None
    share = pb.compute_share if pb.HasField("compute_share") else 1.0
    costs = planning_fields(path, key, share, pb.compute_background, pb.compute_own, list(pb.step_costs) or StepCosts().to_wire())
    address = PeerAddress.from_wire(
        {"p2p": list(pb.p2p), **({"direct": pb.direct} if pb.HasField("direct") else {})}, f"{path}.address"
    )
    record = PeerRecord(
        device_id=pb.device_id,
        model=pb.model,
        dtype=pb.dtype,
        device_name=pb.device_name,
        tflops=pb.tflops,
        memory_bytes=pb.memory_bytes,
        address=address,
        state=pb.state,
        time=pb.time,
        epoch=pb.epoch,
        layers=(pb.layer_start, pb.layer_end) if pb.HasField("layer_start") else None,
        step=pb.step,
        loss=pb.loss if pb.HasField("loss") else None,
        val_loss=pb.val_loss if pb.HasField("val_loss") else None,
        noise_scale=pb.noise_scale if pb.HasField("noise_scale") else None,
        tokens_per_s=pb.tokens_per_s,
        links={link.peer: LinkMeasurement(link.latency_s, link.bandwidth_bytes_per_s) for link in pb.links},
        achieved_tflops=pb.achieved_tflops if pb.HasField("achieved_tflops") else None,
        dht=tuple(pb.dht),
        reachable=pb.reachable or "unknown",
        compute_key=key,
        compute_share=share,
        compute_background=pb.compute_background,
        compute_own=pb.compute_own,
        timings=pb.timings,
        step_costs=costs,
        unreachable=tuple(pb.unreachable),
        unreachable_how=tuple(pb.unreachable_how),
        punch=pb.punch,
        punched=tuple(pb.punched),
        relayed=tuple(pb.relayed),
        software=pb.software,
        version=pb.version,
    )
    return PeerStatus(record=record, age_s=pb.age_s)


_CREDIT_COUNTS = ("micro_batches", "sequences", "tokens", "last_hour_tokens", "claimed_sequences")
_CREDIT_AMOUNTS = ("flops", "online_s", "training_s", "last_hour_flops", "last_seen")
_TEAM_COUNTS = ("volunteers", "tokens", "last_hour_tokens")
_TEAM_AMOUNTS = ("flops", "online_s", "training_s", "last_hour_flops")


def _amounts(path: str, pb: Any, names: tuple[str, ...]) -> dict[str, float]:
    """The named fields of `pb`, each a finite number not below 0; SchemaError names the first that is not."""
    for name in names:
        value = getattr(pb, name)
        if not (math.isfinite(value) and value >= 0):
            raise SchemaError(f"{path}.{name}", f"must be a finite number not below 0, got {value!r}")
    return {name: getattr(pb, name) for name in names}


def _team(path: str, team: str) -> str:
    if not TEAM_RE.match(team):
        raise SchemaError(f"{path}.team", f"must match {TEAM_RE.pattern}, got {team[:64]!r}")
    return team


def _credit_from_pb(reply: swarm_pb2.GetCreditReply) -> CreditBoard:
    """The board as the server describes it; SchemaError for what no ledger would hold. O(volunteers + teams)."""
    if not (math.isfinite(reply.time) and reply.time >= 0):
        raise SchemaError("credit.time", f"must be a finite number not below 0, got {reply.time!r}")
    volunteers, seen = [], set()
    for i, pb in enumerate(reply.volunteers):
        path = f"credit.volunteers[{i}]"
        if not DEVICE_RE.match(pb.device_id):
            raise SchemaError(f"{path}.device_id", f"must be NAME-<12 hex digits>, got {pb.device_id[:64]!r}")
        if pb.device_id in seen:
            raise SchemaError(f"{path}.device_id", f"{pb.device_id} is listed twice")
        seen.add(pb.device_id)
        path = f"credit.volunteers[{pb.device_id!r}]"
        volunteers.append(Credit(
            device_id=pb.device_id, team=_team(path, pb.team) if pb.HasField("team") else None, suspect=pb.suspect,
            **_amounts(path, pb, _CREDIT_COUNTS), **_amounts(path, pb, _CREDIT_AMOUNTS)))
    teams, named = [], set()
    for i, pb in enumerate(reply.teams):
        path = f"credit.teams[{i}]"
        team = _team(path, pb.team)
        if team in named:
            raise SchemaError(f"{path}.team", f"{team} is listed twice")
        named.add(team)
        teams.append(TeamCredit(team=team, **_amounts(path, pb, _TEAM_COUNTS), **_amounts(path, pb, _TEAM_AMOUNTS)))
    return CreditBoard(reply.time, tuple(volunteers), tuple(teams))


class ApiClient:
    """A client of the API at `address`; over TLS, trusting `tls.ca_pem`, when given `tls`."""

    def __init__(self, address: str, timeout_s: float = 5.0, tls: ClientTls | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.tls = tls
        if tls is None:
            self._channel = grpc.insecure_channel(address)
        else:
            self._channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=tls.ca_pem))
        self._stub = swarm_pb2_grpc.CoordinatorStub(self._channel)

    def __enter__(self) -> "ApiClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: Callable, request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as error:
            mismatch = self._tls_mismatch(error)
            raise mismatch if mismatch is not None else ApiError(self._explain(error)) from None
        except ValueError as error:  # grpc refuses some malformed targets before dialling
            raise ApiError(f"cannot reach the coordinator API at {self.address}: {error}") from None

    def _tls_mismatch(self, error: grpc.RpcError) -> ApiTlsError | None:
        """The failure as the TLS disagreement it shows, or None. grpc tells only in the text of its details."""
        if not hasattr(error, "code") or error.code() != grpc.StatusCode.UNAVAILABLE:
            return None
        details = " ".join(str(error.details() if hasattr(error, "details") else error).split())
        at, lower = f"the coordinator API at {self.address}", details.lower()
        if self.tls is None:
            # a TLS server closes a connection that does not open with a TLS handshake
            if "socket closed" in lower or "connection reset" in lower:
                return ApiTlsError(f"{at} closed the connection unanswered: does it serve TLS? Then give --tls-ca with "
                                   "its certificate")
            return None
        if "wrong_version_number" in lower or "wrong version number" in lower:
            return ApiTlsError(f"{at} does not speak TLS: leave out --tls-ca")
        if "certificate_verify_failed" in lower:
            reason = lower.rsplit("certificate_verify_failed", 1)[1].strip(" :").removesuffix(": ok").strip(" :")
            return ApiTlsError(
                f"{at} presented a certificate the --tls-ca certificates do not vouch for ({reason or 'verify failed'})"
            )
        if "hostname verification" in lower or "not in peer certificate" in lower:
            host = self.address.rsplit(":", 1)[0]
            return ApiTlsError(f"{at} presented a certificate that does not name {host}: dial a name or address it lists")
        if "handshake" in lower:
            return ApiTlsError(f"{at}: the TLS handshake failed: {details}")
        return None

    def _explain(self, error: grpc.RpcError) -> str:
        code = error.code() if hasattr(error, "code") else None
        details = " ".join(str(error.details() if hasattr(error, "details") else error).split())
        if code == grpc.StatusCode.UNAVAILABLE:
            reason = details.rsplit(": ", 1)[-1].lower() if "refused" in details.lower() else details
            return f"cannot reach the coordinator API at {self.address}: {reason}"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"cannot reach the coordinator API at {self.address}: no answer within {self.timeout_s:g} s"
        name = code.name if code is not None else "error"
        return f"the coordinator API at {self.address} failed: {name}: {details}"

    def _refuse(self, what: str, error: object) -> ApiError:
        return ApiError(f"the coordinator API at {self.address} sent {what} that does not parse: {error}")

    def call_get_plan(self) -> tuple[Plan | None, float | None]:
        """(plan, publication time), or (None, None) when the coordinator has no plan yet."""
        reply = self._call(self._stub.GetPlan, swarm_pb2.GetPlanRequest())
        if not reply.has_plan:
            return None, None
        try:
            if len(reply.plan_json) > MAX_PLAN_BYTES:
                raise SchemaError("plan", f"{len(reply.plan_json)} bytes, at most {MAX_PLAN_BYTES}")
            plan = Plan.from_wire(json.loads(reply.plan_json))
            if (plan.epoch, plan.start_step) != (reply.epoch, reply.start_step):
                raise SchemaError("plan.epoch", f"the plan says epoch {plan.epoch}, the reply {reply.epoch}")
        except (SchemaError, json.JSONDecodeError) as error:
            raise self._refuse("a plan", error) from None
        return plan, reply.time if math.isfinite(reply.time) else None

    def call_list_peers(self) -> list[PeerStatus]:
        reply = self._call(self._stub.ListPeers, swarm_pb2.ListPeersRequest())
        try:
            return [_peer_from_pb(pb) for pb in reply.peers]
        except SchemaError as error:
            raise self._refuse("a peer", error) from None

    def call_get_progress(self) -> Progress:
        reply = self._call(self._stub.GetProgress, swarm_pb2.GetProgressRequest())
        optional = [getattr(reply, name) for name in ("loss", "val_loss", "noise_scale") if reply.HasField(name)]
        if not all(math.isfinite(x) for x in [reply.tokens_per_s, reply.step_overhead_s, *optional]):
            raise self._refuse("progress", "a number that is not finite")
        return Progress(
            swarm=reply.swarm,
            coordinator_key=reply.coordinator_key,
            epoch=reply.epoch,
            step=reply.step,
            loss=reply.loss if reply.HasField("loss") else None,
            tokens_per_s=reply.tokens_per_s,
            peers_by_state=dict(sorted(reply.peers_by_state.items())),
            dropped=reply.dropped,
            val_loss=reply.val_loss if reply.HasField("val_loss") else None,
            step_overhead_s=reply.step_overhead_s,  # 0 from an older coordinator: its predictions are the model's own
            noise_scale=reply.noise_scale if reply.HasField("noise_scale") else None,
        )

    def call_get_credit(self) -> CreditBoard:
        """The volunteers' and teams' credit, most tokens first; an empty board at time 0 while the coordinator keeps
        no ledger yet."""
        reply = self._call(self._stub.GetCredit, swarm_pb2.GetCreditRequest())
        try:
            return _credit_from_pb(reply)
        except SchemaError as error:
            raise self._refuse("credit", error) from None
