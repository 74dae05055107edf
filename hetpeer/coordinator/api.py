"""The coordinator's gRPC API for organizers' tools: the plan, the peers and the swarm's progress.

`ApiServer` serves whatever `get_view()` returns (the coordinator's latest read of the DHT); it holds
no state of its own. `ApiClient` is what `hetpeer status --api HOST:PORT` uses (`console.py` draws what
it reads); it parses every reply as strictly as a peer parses a DHT record, and turns every failure into
one `ApiError` line.

The API is read-only and binds 127.0.0.1 unless told otherwise. Given a certificate and its key
(`ServerTls`) it serves TLS only; a client then trusts the certificate it is given (`ClientTls`, often
the server's own self-signed one). Both check their files when they load them, so a certificate that
does not parse or a key that is not the certificate's is one clear `ApiTlsError`, not a failed bind.
"""

from __future__ import annotations

import datetime
import json
import math
from collections import Counter
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import grpc
from google.protobuf.message import DecodeError
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from hetpeer.protocol import swarm_pb2, swarm_pb2_grpc
from hetpeer.protocol.addresses import PeerAddress
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.records import MAX_PLAN_BYTES, STATES, LinkMeasurement, PeerRecord
from hetpeer.protocol.wire import SchemaError


class ApiError(RuntimeError):
    """The API could not be served or reached, or it answered something that does not parse."""


class ApiTlsError(ApiError):
    """TLS set up wrong at either end: files that do not read, parse or match, or a client and a server
    that do not agree (one speaks TLS, the other not; a certificate the client does not trust)."""


def _read(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ApiTlsError(f"cannot read the {what} {path}: {error.strerror or error}") from None


def _certificate(pem: bytes, path: Path, what: str) -> x509.Certificate:
    """The file's first certificate (the server's own, or the CA to trust), valid now."""
    try:
        certificate = x509.load_pem_x509_certificates(pem)[0]
    except ValueError:
        raise ApiTlsError(f"the {what} {path} holds no PEM certificate") from None
    now = datetime.datetime.now(datetime.timezone.utc)
    if not certificate.not_valid_before_utc <= now <= certificate.not_valid_after_utc:
        raise ApiTlsError(
            f"the {what} {path} is valid from {certificate.not_valid_before_utc:%Y-%m-%d %H:%M} to "
            f"{certificate.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now"
        )
    return certificate


def _public_der(key: Any) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


@dataclass(frozen=True, slots=True)
class ServerTls:
    """The API's certificate (PEM, the server's first, then any chain) and its private key (PEM, unencrypted)."""

    cert_pem: bytes
    key_pem: bytes

    @classmethod
    def load(cls, cert_path: Path, key_path: Path) -> "ServerTls":
        """Read and check them: ApiTlsError naming the file that does not read or parse, is out of its
        validity, or does not match the other."""
        cert_pem, key_pem = _read(cert_path, "TLS certificate"), _read(key_path, "TLS key")
        certificate = _certificate(cert_pem, cert_path, "TLS certificate")
        try:
            key = serialization.load_pem_private_key(key_pem, password=None)
        except TypeError:
            raise ApiTlsError(f"the TLS key {key_path} is encrypted: give it without a passphrase") from None
        except (ValueError, UnsupportedAlgorithm):
            raise ApiTlsError(f"the TLS key {key_path} holds no PEM private key") from None
        if _public_der(key.public_key()) != _public_der(certificate.public_key()):
            raise ApiTlsError(f"the TLS key {key_path} is not the key of the certificate {cert_path}")
        return cls(cert_pem, key_pem)


@dataclass(frozen=True, slots=True)
class ClientTls:
    """The certificates (PEM) a client trusts: the server's own self-signed one, or the CA that signed it."""

    ca_pem: bytes

    @classmethod
    def load(cls, ca_path: Path) -> "ClientTls":
        ca_pem = _read(ca_path, "TLS CA certificate")
        _certificate(ca_pem, ca_path, "TLS CA certificate")
        return cls(ca_pem)


@dataclass(frozen=True)
class SwarmView:
    """The coordinator's current view of the swarm, as of DHT time `now`."""

    swarm: str
    coordinator_key: str  # SHA-256 of the coordinator's public key, hex
    plan: Plan | None
    plan_time: float | None
    peers: Mapping[str, PeerRecord]  # device id -> its latest parsed announcement
    dropped: int  # records refused in the last read
    now: float


@dataclass(frozen=True)
class Progress:
    swarm: str
    coordinator_key: str
    epoch: int  # the current plan's; -1 without a plan
    step: int  # highest step among peers training (or leaving, having trained) under the current plan
    loss: float | None  # mean over the last stage's counted peers (see `progress`); None when none announces one
    tokens_per_s: float  # sum over the lanes' last stages
    peers_by_state: Mapping[str, int]
    dropped: int
    val_loss: float | None = None  # mean of the validation losses the same peers announce, when the plan asks for them


@dataclass(frozen=True)
class PeerStatus:
    record: PeerRecord
    age_s: float  # how old the announcement was when the coordinator read it


def progress(view: SwarmView) -> Progress:
    """The swarm's progress from one view. Pure; O(peers).

    Each lane's last stage computes the loss and counts the tokens its lane trained, so loss and
    throughput come from the current plan's last-stage peers that say they are training; a peer
    left on standby, or still fetching, may announce stale figures and is not counted. Peers leaving
    under the current plan count with their last figures: a peer that stops at its last step says so
    only in its leaving record, and a watcher waiting for that step must see it (a plan without them
    follows at once when they leave early).
    """
    epoch = view.plan.epoch if view.plan is not None else None
    counted = [r for r in view.peers.values() if r.state == "training" or (r.state == "leaving" and r.epoch == epoch)]
    last = set(view.plan.stages[-1].devices) if view.plan is not None else set()
    heads = [r for r in counted if r.device_id in last]
    losses = [r.loss for r in heads if r.loss is not None]
    val_losses = [r.val_loss for r in heads if r.val_loss is not None]
    return Progress(
        swarm=view.swarm,
        coordinator_key=view.coordinator_key,
        epoch=view.plan.epoch if view.plan is not None else -1,
        step=max((r.step for r in counted), default=0),
        loss=sum(losses) / len(losses) if losses else None,
        tokens_per_s=float(sum(r.tokens_per_s for r in heads)),
        peers_by_state=dict(sorted(Counter(r.state for r in view.peers.values()).items())),
        dropped=view.dropped,
        val_loss=sum(val_losses) / len(val_losses) if val_losses else None,
    )


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
    })


class ApiServer:
    def __init__(
        self, get_view: Callable[[], SwarmView], listen: str = "127.0.0.1:0", workers: int = 4, tls: ServerTls | None = None
    ) -> None:
        self.get_view = get_view
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
    )


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
    if pb.HasField("achieved_tflops"):
        numbers.append(pb.achieved_tflops)
    if not all(math.isfinite(x) for x in numbers):
        raise SchemaError(path, "carries a number that is not finite")
    if pb.HasField("layer_start") != pb.HasField("layer_end"):
        raise SchemaError(f"{path}.layers", "has a start without an end, or an end without a start")
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
        tokens_per_s=pb.tokens_per_s,
        links={link.peer: LinkMeasurement(link.latency_s, link.bandwidth_bytes_per_s) for link in pb.links},
        achieved_tflops=pb.achieved_tflops if pb.HasField("achieved_tflops") else None,
        dht=tuple(pb.dht),
        software=pb.software,
        version=pb.version,
    )
    return PeerStatus(record=record, age_s=pb.age_s)


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
        optional = [getattr(reply, name) for name in ("loss", "val_loss") if reply.HasField(name)]
        if not all(math.isfinite(x) for x in [reply.tokens_per_s, *optional]):
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
        )
