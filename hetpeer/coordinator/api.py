"""The coordinator's gRPC API for organizers' tools: the plan, the peers, the swarm's progress and the
volunteers' credit.

`ApiServer` serves whatever `get_view()` returns (the coordinator's latest read of the DHT, `view.py`)
and `get_credit()` (its credit ledger's board, `ledger.py`); it holds no state of its own. Its client, what `hetpeer status --api HOST:PORT` uses, is
`api_client.ApiClient`.

The API is read-only and binds 127.0.0.1 unless told otherwise. Given a certificate and its key
(`tls.ServerTls`) it serves TLS only.
"""

from __future__ import annotations

import json
import math
from concurrent import futures
from typing import Any, Callable

import grpc
from google.protobuf.message import DecodeError

from hetpeer.coordinator.api_errors import ApiError
from hetpeer.coordinator.ledger import CreditBoard
from hetpeer.coordinator.tls import ServerTls
from hetpeer.coordinator.view import SwarmView, progress
from hetpeer.protocol import swarm_pb2
from hetpeer.protocol.records import PeerRecord


def _handlers(api: "ApiServer") -> grpc.GenericRpcHandler:
    """The service's methods, each parsing its own request: grpcio (1.85) keeps memory for every request its
    own deserializer refuses (about 17 KB each, grpc/grpc#36908), so anyone reaching the port could grow the
    coordinator without end. Parsed here, a malformed request is answered INVALID_ARGUMENT and forgotten."""

    def method(handler: Callable, request_type: Any, reply_type: Any) -> grpc.RpcMethodHandler:
        def parse_and_call(raw: bytes, context: Any) -> Any:
            try:
                request = request_type.FromString(raw)
            except DecodeError:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a {request_type.DESCRIPTOR.name}")
            return handler(request, context)

        return grpc.unary_unary_rpc_method_handler(parse_and_call, request_deserializer=None,
                                                   response_serializer=reply_type.SerializeToString)

    return grpc.method_handlers_generic_handler("hetpeer.Coordinator", {
        "GetPlan": method(api.rpc_get_plan, swarm_pb2.GetPlanRequest, swarm_pb2.GetPlanReply),
        "ListPeers": method(api.rpc_list_peers, swarm_pb2.ListPeersRequest, swarm_pb2.ListPeersReply),
        "GetProgress": method(api.rpc_get_progress, swarm_pb2.GetProgressRequest, swarm_pb2.GetProgressReply),
        "GetCredit": method(api.rpc_get_credit, swarm_pb2.GetCreditRequest, swarm_pb2.GetCreditReply),
    })


class ApiServer:
    def __init__(
        self, get_view: Callable[[], SwarmView], listen: str = "127.0.0.1:0", workers: int = 4, tls: ServerTls | None = None,
        get_credit: Callable[[], CreditBoard | None] = lambda: None,
    ) -> None:
        self.get_view, self.get_credit = get_view, get_credit
        self.listen = listen
        self.workers = workers
        self.tls = tls
        self._server: grpc.Server | None = None
        self._port: int | None = None

    def start(self) -> None:
        if self._server is not None:
            raise ApiError("the coordinator API is already started")
        # No SO_REUSEPORT: a second coordinator on the same port must fail, not share its clients.
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.workers), options=[("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers((_handlers(self),))
        try:
            if self.tls is None:
                port = server.add_insecure_port(self.listen)
            else:
                credentials = grpc.ssl_server_credentials([(self.tls.key_pem, self.tls.cert_pem)])
                port = server.add_secure_port(self.listen, credentials)
        except RuntimeError:  # grpcio raises on a failed bind; older releases returned 0
            port = 0
        if not port:
            server.stop(None)
            raise ApiError(
                f"cannot serve the coordinator API on {self.listen}: "
                "the port is in use or the address is not this host's"
            )
        server.start()
        self._server, self._port = server, port

    @property
    def port(self) -> int:
        if self._port is None:
            raise ApiError("the coordinator API is not started")
        return self._port

    @property
    def address(self) -> str:
        return f"{self.listen.rsplit(':', 1)[0]}:{self.port}"

    def shutdown(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            self._server.stop(grace_s).wait()
            self._server, self._port = None, None

    def rpc_get_plan(self, request: swarm_pb2.GetPlanRequest, context: Any) -> swarm_pb2.GetPlanReply:
        view = self.get_view()
        if view.plan is None:
            return swarm_pb2.GetPlanReply(has_plan=False, epoch=-1)
        return swarm_pb2.GetPlanReply(
            has_plan=True,
            plan_json=json.dumps(view.plan.to_wire(), separators=(",", ":")),
            epoch=view.plan.epoch,
            start_step=view.plan.start_step,
            step_s=view.plan.total_s,
            time=view.plan_time if view.plan_time is not None else math.nan,
        )

    def rpc_list_peers(self, request: swarm_pb2.ListPeersRequest, context: Any) -> swarm_pb2.ListPeersReply:
        view = self.get_view()
        return swarm_pb2.ListPeersReply(
            peers=[_peer_to_pb(view.peers[d], max(0.0, view.now - view.peers[d].time)) for d in sorted(view.peers)]
        )

    def rpc_get_progress(self, request: swarm_pb2.GetProgressRequest, context: Any) -> swarm_pb2.GetProgressReply:
        p = progress(self.get_view())
        return swarm_pb2.GetProgressReply(
            swarm=p.swarm,
            coordinator_key=p.coordinator_key,
            epoch=p.epoch,
            step=p.step,
            loss=p.loss,
            tokens_per_s=p.tokens_per_s,
            peers_by_state=dict(p.peers_by_state),
            dropped=p.dropped,
            val_loss=p.val_loss,
            step_overhead_s=p.step_overhead_s,
            noise_scale=p.noise_scale,
        )

    def rpc_get_credit(self, request: swarm_pb2.GetCreditRequest, context: Any) -> swarm_pb2.GetCreditReply:
        """The ledger's board; an empty one at time 0 while the coordinator keeps none yet."""
        board = self.get_credit()
        if board is None:
            return swarm_pb2.GetCreditReply(time=0.0)
        return swarm_pb2.GetCreditReply(
            time=board.time,
            volunteers=[swarm_pb2.VolunteerCredit(
                device_id=c.device_id, team=c.team, micro_batches=c.micro_batches, sequences=c.sequences, tokens=c.tokens,
                flops=c.flops, online_s=c.online_s, training_s=c.training_s, last_hour_tokens=c.last_hour_tokens,
                last_hour_flops=c.last_hour_flops, claimed_sequences=c.claimed_sequences, suspect=c.suspect,
                last_seen=c.last_seen) for c in board.volunteers],
            teams=[swarm_pb2.TeamCredit(
                team=t.team, volunteers=t.volunteers, tokens=t.tokens, flops=t.flops, online_s=t.online_s,
                training_s=t.training_s, last_hour_tokens=t.last_hour_tokens, last_hour_flops=t.last_hour_flops)
                for t in board.teams],
        )


def _peer_to_pb(record: PeerRecord, age_s: float) -> swarm_pb2.Peer:
    direct = record.address.direct
    return swarm_pb2.Peer(
        device_id=record.device_id,
        model=record.model,
        dtype=record.dtype,
        device_name=record.device_name,
        tflops=record.tflops,
        achieved_tflops=record.achieved_tflops,
        memory_bytes=record.memory_bytes,
        direct=f"{direct[0]}:{direct[1]}" if direct else None,
        p2p=list(record.address.p2p),
        state=record.state,
        time=record.time,
        epoch=record.epoch,
        layer_start=record.layers[0] if record.layers else None,
        layer_end=record.layers[1] if record.layers else None,
        step=record.step,
        loss=record.loss,
        val_loss=record.val_loss,
        tokens_per_s=record.tokens_per_s,
        links=[
            swarm_pb2.Link(peer=peer, latency_s=m.latency_s, bandwidth_bytes_per_s=m.bandwidth_bytes_per_s)
            for peer, m in sorted(record.links.items())
        ],
        software=record.software,
        version=record.version,
        age_s=age_s,
        dht=list(record.dht),
        reachable=record.reachable,
        compute_key=record.compute_key,
        compute_share=record.compute_share,
        compute_background=record.compute_background,
        compute_own=record.compute_own,
        timings=record.timings,
        step_costs=record.step_costs.to_wire(),
        unreachable=list(record.unreachable),
        unreachable_how=list(record.unreachable_how),
        noise_scale=record.noise_scale,
        punch=record.punch,
        punched=list(record.punched),
        relayed=list(record.relayed),
    )
