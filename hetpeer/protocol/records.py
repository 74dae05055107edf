"""The control plane's contract: DHT keys, the peer announcement and the signed plan record.

Keys (hivemind's SchemaValidator joins the swarm name and the field with "_"):

- `<swarm>_peers`, subkey = the peer's owner marker `[owner:<RSA public key>]`: a `PeerRecord`.
  hivemind's RSASignatureValidator only lets the holder of that key write the subkey.
- `<swarm>_plan`, subkey = the coordinator's owner marker: `{"plan": <plan JSON>, "time": float}`.
  Anyone may write a plan under their own key; peers read only the subkey of the key they trust.

Records are checked twice. The DHT checks the signature and the types (pydantic.v1 models with
strict types, `SCHEMA`), so a malformed or forged record is refused by every node that would store
or return it. `PeerRecord.from_wire` then checks meaning: the device id is bound to the signing key
(`device_id(name, key)`), numbers are finite and in range, and the record is fresh.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field as dataclass_field
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Sequence

from pydantic import v1 as pydantic
from pydantic.v1.fields import SHAPE_LIST, SHAPE_SINGLETON

from hetpeer.protocol.addresses import PeerAddress, peer_maddrs
from hetpeer.protocol.credit import MAX_CLAIMS, MAX_RECEIPTS, RECEIPT_KINDS, Claim, Receipt
from hetpeer.protocol.identity import DEVICE_RE, bound, fingerprint
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.reach import FAILURES, REACHABLE, VIA
from hetpeer.protocol.stepcosts import FIELDS as FIELDS_OF_STEP_COSTS, OLDER_FIELDS as OLDER_STEP_COSTS, StepCosts
from hetpeer.protocol.wire import SchemaError

# 2: records carry the DHT multiaddrs of their writer and what its training achieves
# 3: direct links are authenticated and frames padded; records carry an admission token and the peers suspected
# 4: records say which device a peer computes on (an opaque key peers sharing one device share) and its share of it
# 5: records say whether others can dial the peer (`reachable`); connections carry frames both ways
# 6: plans name each hop's codecs (forward, backward) and frames may be int4
# 10: records say what the peer's own process kept its device busy while it measured the other work (`compute_own`)
# 11: records say how many times the peer has timed its device since it started (`timings`)
# 12: records say the port a peer behind a NAT that keeps ports punches holes from (`punch`), whom it calls now
#     (`calling`), and which peers it reaches through a punched hole or a relay (`punched`, `relayed`)
# 13: records' step costs say what each codec's encoding and decoding costs the peer's device
# 14: records carry the peer's team, the work it claims (`trained`) and its receipts for its neighbours' work (`received`)
# 15: records say how each peer they could not reach failed (`unreachable_how`: refused, no answer, no hole punched...)
PROTOCOL_VERSION = 15
COMPUTE_KEY_RE = re.compile(r"[0-9a-f]{16}\Z")
OWNER_RE = re.compile(rb"\[owner:(.+)\]\Z", re.DOTALL)  # \Z, not $: $ also matches before a final newline
STATES = ("probing", "waiting", "fetching", "training", "standby", "leaving")
MAX_TIMINGS = 2**31 - 1  # the wire's field is 32 bits
MAX_LINKS = 64  # measurements one record carries; a peer probes a handful of others
MAX_DHT_MADDRS = 8
MAX_MADDR_CHARS = 256
MAX_PLAN_BYTES = 1 << 20
MAX_SUSPECTS = 16  # peers one record may report as misbehaving, and as unreachable
MAX_CALLING = 16  # peers one record may call to punch a hole to
MAX_TOKEN_CHARS = 1024
MAX_TEXT_CHARS = 128  # a device name, a software string: shown to organizers on pages and terminals
MAX_MICRO_PER_STEP = 1 << 16  # micro-batches a stage's step may have (a lane's batch over its micro-batch)
TEAM_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}\Z")
TTL_HEARTBEATS = 5  # a peer record expires after this many heartbeats without a new one (loaded machines miss some)


def peers_key(swarm: str) -> str:
    return f"{swarm}_peers"


def plan_key(swarm: str) -> str:
    return f"{swarm}_plan"


def owner_key(subkey: Any) -> bytes:
    """The public key in an owner marker subkey; SchemaError when the subkey is not one."""
    match = OWNER_RE.match(subkey) if isinstance(subkey, bytes) else None
    if match is None:
        raise SchemaError("subkey", "is not an [owner:...] marker: the record is not signed")
    return match.group(1)


class _OwnerMarker(bytes):
    """Bytes that are an owner marker, so an unsigned (unmarked) record is refused by the DHT itself."""

    @classmethod
    def __get_validators__(cls):
        yield cls.validate

    @classmethod
    def validate(cls, value: Any) -> bytes:
        if not isinstance(value, bytes) or OWNER_RE.match(value) is None:
            raise ValueError("subkey must be an [owner:<public key>] marker")
        return value


class _Strict(pydantic.BaseModel):
    class Config:
        extra = pydantic.Extra.forbid


class LinksSchema(_Strict):
    """A peer's link measurements as parallel lists: every DHT node that stores or returns a record checks
    it, for every record of the swarm, so a list of numbers (one model) rather than a model per link
    (checked about four times faster)."""

    peers: List[pydantic.StrictStr]
    latency_s: List[pydantic.StrictFloat]
    bandwidth_bytes_per_s: List[pydantic.StrictFloat]


class ReceiptsSchema(_Strict):
    """A peer's receipts as parallel lists (checked fast, as `LinksSchema`): for each (sender, epoch, kind), the
    steps [first, last] it took the sender's frames of and how many micro-batches and sequences they held."""

    peers: List[pydantic.StrictStr]
    epochs: List[pydantic.StrictInt]
    kinds: List[pydantic.StrictStr]
    first: List[pydantic.StrictInt]
    last: List[pydantic.StrictInt]
    micro: List[pydantic.StrictInt]
    sequences: List[pydantic.StrictInt]


class ClaimsSchema(_Strict):
    """The work a peer claims, per epoch, as parallel lists: the steps [first, last] it trained, their micro-batches
    and sequences."""

    epochs: List[pydantic.StrictInt]
    first: List[pydantic.StrictInt]
    last: List[pydantic.StrictInt]
    micro: List[pydantic.StrictInt]
    sequences: List[pydantic.StrictInt]


class PeerSchema(_Strict):
    version: pydantic.StrictInt
    software: pydantic.StrictStr
    device_id: pydantic.StrictStr
    model: pydantic.StrictStr
    dtype: pydantic.StrictStr
    device_name: pydantic.StrictStr
    tflops: pydantic.StrictFloat
    achieved_tflops: Optional[pydantic.StrictFloat]
    memory_bytes: pydantic.StrictInt
    direct: Optional[pydantic.StrictStr]
    p2p: List[pydantic.StrictStr]
    dht: List[pydantic.StrictStr]
    state: pydantic.StrictStr
    epoch: pydantic.StrictInt
    layers: Optional[List[pydantic.StrictInt]]
    step: pydantic.StrictInt
    loss: Optional[pydantic.StrictFloat]
    val_loss: Optional[pydantic.StrictFloat] = None
    noise_scale: Optional[pydantic.StrictFloat] = None
    checkpoint: Optional[List[pydantic.StrictInt]] = None
    tokens_per_s: pydantic.StrictFloat
    links: LinksSchema
    time: pydantic.StrictFloat
    token: Optional[pydantic.StrictStr] = None
    suspects: List[pydantic.StrictStr] = []
    compute_key: Optional[pydantic.StrictStr] = None
    compute_share: pydantic.StrictFloat = 1.0
    compute_background: pydantic.StrictFloat = 0.0
    compute_own: pydantic.StrictFloat = 0.0
    timings: pydantic.StrictInt = 0
    step_costs: List[pydantic.StrictFloat] = [0.0] * len(FIELDS_OF_STEP_COSTS)
    reachable: pydantic.StrictStr = "unknown"
    unreachable: List[pydantic.StrictStr] = []
    unreachable_how: List[pydantic.StrictStr] = []
    punch: pydantic.StrictInt = 0
    calling: List[pydantic.StrictStr] = []
    punched: List[pydantic.StrictStr] = []
    relayed: List[pydantic.StrictStr] = []
    team: Optional[pydantic.StrictStr] = None
    received: ReceiptsSchema
    trained: ClaimsSchema


class PlanSchema(_Strict):
    plan: pydantic.StrictStr
    time: pydantic.StrictFloat


class SCHEMA(_Strict):
    """The swarm's DHT keys for hivemind's SchemaValidator (with prefix = the swarm name)."""

    peers: Dict[_OwnerMarker, PeerSchema]
    plan: Dict[_OwnerMarker, PlanSchema]


@dataclass(frozen=True, slots=True)
class LinkMeasurement:
    latency_s: float
    bandwidth_bytes_per_s: float


@dataclass(frozen=True, slots=True)
class PeerRecord:
    """A peer's announcement: who it is, what it measured, where it is in training."""

    device_id: str
    model: str
    dtype: str
    device_name: str
    tflops: float
    memory_bytes: int
    address: PeerAddress
    state: str
    time: float  # DHT time of the announcement
    epoch: int = -1  # the plan epoch it runs; -1 before its first plan
    layers: tuple[int, int] | None = None  # [start, end) of the layers it holds
    step: int = 0
    loss: float | None = None
    val_loss: float | None = None  # its lane's latest validation loss (last stage), once the plan asked for one
    noise_scale: float | None = None  # the gradient noise scale (tokens) its all-reduce group measures (peer/gossip/noise.py)
    # (start, end, step, data position) of the stage checkpoint it can resume from: its layers, the next step to
    # train and the windows the swarm had read before that step (peer/data/order.py)
    checkpoint: tuple[int, int, int, int] | None = None
    tokens_per_s: float = 0.0
    links: Dict[str, LinkMeasurement] = dataclass_field(default_factory=dict)
    achieved_tflops: float | None = None  # what its training steps achieve (FLOPs over compute time), once it trains
    dht: tuple[str, ...] = ()  # where its DHT node listens (/p2p/<id> included): others bootstrap through it
    token: str | None = None  # the admission token it joined with (`hetpeer invite`), for swarms that need one
    suspects: tuple[str, ...] = ()  # peers it saw misbehave lately: frames refused, parameters clipped round after round
    # the device it computes on, opaque: peers on one machine's CPU cores or one GPU announce the same key (None:
    # unknown), and what of that device it uses computing flat out (`coordinator.planner.sharing`)
    compute_key: str | None = None
    compute_share: float = 1.0
    compute_background: float = 0.0  # of that device, what other work kept busy while the peer did not train
    compute_own: float = 0.0  # of that device, what the peer's own process kept busy over the same time
    timings: int = 0  # how many times it has timed its device since it started (a burst of peers starting slows the first)
    step_costs: StepCosts = StepCosts()  # what a stage's step costs it beyond its blocks (embedding, head, optimizer)
    # others can dial it ("direct"), cannot ("none": it dials them), only through a relay ("via:<device>"), or it
    # could not tell ("unknown")
    reachable: str = "unknown"
    unreachable: tuple[str, ...] = ()  # peers it could not reach lately, neither directly nor through a relay
    unreachable_how: tuple[str, ...] = ()  # and how, each (`protocol.reach.FAILURES`)
    # behind a NAT that keeps ports: the port it punches holes from (0: it does not), and the peers it calls now (each
    # that punches too dials it back: `peer/transport/punch.py`)
    punch: int = 0
    calling: tuple[str, ...] = ()
    punched: tuple[str, ...] = ()  # peers it reaches now over a hole punched through both NATs
    relayed: tuple[str, ...] = ()  # and through a relay; any other peer it measured, directly
    team: str | None = None  # the volunteer's team, for the credit leaderboard (`coordinator/ledger.py`)
    received: tuple[Receipt, ...] = ()  # its receipts for its lane neighbours' (one-stage lanes: group members') work
    trained: tuple[Claim, ...] = ()  # the work it claims, per epoch: credited as far as its neighbours' receipts agree
    software: str = ""
    version: int = PROTOCOL_VERSION

    @property
    def relay(self) -> str | None:
        """The peer that relays for this one, when others reach it only through a relay."""
        return self.reachable.removeprefix(VIA) if self.reachable.startswith(VIA) else None

    @property
    def behind_nat(self) -> bool:
        """Nobody can dial it: it dials others, and peers like it reach it through its relay, if any."""
        return self.reachable == "none" or self.relay is not None

    def reach_words(self) -> str:
        """`reachable` for people, with whether it punches and how many peers it reaches over punched holes and
        relays: "none, punches: 3 punched, 1 relayed"."""
        paths = [f"{len(peers)} {word}" for peers, word in ((self.punched, "punched"), (self.relayed, "relayed")) if peers]
        return self.reachable + (", punches" if self.punch else "") + (": " + ", ".join(paths) if paths else "")

    def failed(self) -> dict[str, str]:
        """The peers it could not reach lately, each with how (`protocol.reach.FAILURES`)."""
        return dict(zip(self.unreachable, self.unreachable_how or ("lost",) * len(self.unreachable)))

    def punches_with(self, other: "PeerRecord") -> bool:
        """Whether this peer and `other`, both behind NAT, can punch a hole to each other: both punch, and not from
        one public address (that would need their router to hairpin)."""
        return (self.behind_nat and other.behind_nat and self.punch != 0 and other.punch != 0
                and self.address.direct is not None and other.address.direct is not None
                and self.address.direct[0] != other.address.direct[0])

    def to_wire(self) -> dict[str, Any]:
        direct = self.address.direct
        return {
            "version": self.version,
            "software": self.software,
            "device_id": self.device_id,
            "model": self.model,
            "dtype": self.dtype,
            "device_name": self.device_name,
            "tflops": float(self.tflops),
            "achieved_tflops": float(self.achieved_tflops) if self.achieved_tflops is not None else None,
            "memory_bytes": int(self.memory_bytes),
            "direct": f"{direct[0]}:{direct[1]}" if direct else None,
            "p2p": list(self.address.p2p),
            "dht": list(self.dht),
            "state": self.state,
            "epoch": self.epoch,
            "layers": list(self.layers) if self.layers is not None else None,
            "step": self.step,
            "loss": float(self.loss) if self.loss is not None else None,
            "val_loss": float(self.val_loss) if self.val_loss is not None else None,
            "noise_scale": float(self.noise_scale) if self.noise_scale is not None else None,
            "checkpoint": list(self.checkpoint) if self.checkpoint is not None else None,
            "tokens_per_s": float(self.tokens_per_s),
            "links": {
                "peers": sorted(self.links),
                "latency_s": [float(self.links[p].latency_s) for p in sorted(self.links)],
                "bandwidth_bytes_per_s": [float(self.links[p].bandwidth_bytes_per_s) for p in sorted(self.links)],
            },
            "time": float(self.time),
            "token": self.token,
            "suspects": list(self.suspects),
            "compute_key": self.compute_key,
            "compute_share": float(self.compute_share),
            "compute_background": float(self.compute_background),
            "compute_own": float(self.compute_own),
            "timings": int(self.timings),
            "step_costs": self.step_costs.to_wire(),
            "reachable": self.reachable,
            "unreachable": list(self.unreachable),
            "unreachable_how": list(self.unreachable_how),
            "punch": int(self.punch),
            "calling": list(self.calling),
            "punched": list(self.punched),
            "relayed": list(self.relayed),
            "team": self.team,
            "received": {
                "peers": [r.sender for r in self.received], "epochs": [r.epoch for r in self.received],
                "kinds": [r.kind for r in self.received], "first": [r.first for r in self.received],
                "last": [r.last for r in self.received], "micro": [r.micro for r in self.received],
                "sequences": [r.sequences for r in self.received],
            },
            "trained": {
                "epochs": [c.epoch for c in self.trained], "first": [c.first for c in self.trained],
                "last": [c.last for c in self.trained], "micro": [c.micro for c in self.trained],
                "sequences": [c.sequences for c in self.trained],
            },
        }

    @staticmethod
    def from_wire(raw: Any, signer: bytes, now: float, max_age_s: float) -> "PeerRecord":
        """Parse an announcement written under `signer`'s key; SchemaError names what is wrong."""
        _an_object(raw, "peer")
        parsed = _read_exact(raw, _PEER_EXACT)  # a coordinator reads every record every heartbeat: the common case, fast
        if parsed is None:  # pydantic says what is wrong
            try:
                parsed = PeerSchema.parse_obj(raw)
            except pydantic.ValidationError as error:
                first = error.errors()[0]
                raise SchemaError("peer." + ".".join(str(p) for p in first["loc"]), first["msg"]) from None
            if parsed.dict() != raw:
                raise SchemaError("peer", "needed type conversions to match the schema")
        if parsed.version != PROTOCOL_VERSION:
            raise SchemaError("peer.version", f"protocol {parsed.version}, this side speaks {PROTOCOL_VERSION}")
        if not bound(parsed.device_id, signer):
            raise SchemaError(
                "peer.device_id", f"{parsed.device_id!r} is not bound to the key that signed it (fingerprint {fingerprint(signer)})"
            )
        if parsed.state not in STATES:
            raise SchemaError("peer.state", f"must be one of {', '.join(STATES)}, got {parsed.state!r}")
        for name_, value in (("tflops", parsed.tflops), ("tokens_per_s", parsed.tokens_per_s), ("time", parsed.time)):
            if not math.isfinite(value) or value < 0:
                raise SchemaError(f"peer.{name_}", f"must be a finite, non-negative number, got {value!r}")
        if parsed.tflops <= 0:
            raise SchemaError("peer.tflops", f"must be positive, got {parsed.tflops!r}")
        if parsed.achieved_tflops is not None and not (math.isfinite(parsed.achieved_tflops) and parsed.achieved_tflops > 0):
            raise SchemaError("peer.achieved_tflops", f"must be a finite, positive number, got {parsed.achieved_tflops!r}")
        for name_, value, least in (("memory_bytes", parsed.memory_bytes, 0), ("step", parsed.step, 0), ("epoch", parsed.epoch, -1)):
            if value < least:
                raise SchemaError(f"peer.{name_}", f"must be at least {least}, got {value}")
        if not 0 <= parsed.timings <= MAX_TIMINGS:
            raise SchemaError("peer.timings", f"must be 0 to {MAX_TIMINGS}, got {parsed.timings}")
        for name_, value in (("loss", parsed.loss), ("val_loss", parsed.val_loss)):
            if value is not None and not math.isfinite(value):
                raise SchemaError(f"peer.{name_}", f"must be finite, got {value!r}")
        if parsed.noise_scale is not None and not (math.isfinite(parsed.noise_scale) and parsed.noise_scale > 0):
            raise SchemaError("peer.noise_scale", f"must be a finite, positive number of tokens, got {parsed.noise_scale!r}")
        check_age(parsed.time, now, max_age_s)
        layers = None
        if parsed.layers is not None:
            if len(parsed.layers) != 2 or not 0 <= parsed.layers[0] < parsed.layers[1]:
                raise SchemaError("peer.layers", f"must be [start, end) with 0 <= start < end, got {parsed.layers}")
            layers = (parsed.layers[0], parsed.layers[1])
        checkpoint = None
        if parsed.checkpoint is not None:
            if (len(parsed.checkpoint) != 4 or not 0 <= parsed.checkpoint[0] < parsed.checkpoint[1]
                    or min(parsed.checkpoint[2:]) < 0):
                raise SchemaError("peer.checkpoint", f"must be [start, end, step, data position] with 0 <= start < end, "
                                                     f"step >= 0 and data position >= 0, got {parsed.checkpoint}")
            checkpoint = (parsed.checkpoint[0], parsed.checkpoint[1], parsed.checkpoint[2], parsed.checkpoint[3])
        measured = parsed.links
        count = len(measured.peers)
        if count > MAX_LINKS:
            raise SchemaError("peer.links", f"at most {MAX_LINKS} measurements, got {count}")
        if len(measured.latency_s) != count or len(measured.bandwidth_bytes_per_s) != count:
            raise SchemaError("peer.links", f"{count} peers but {len(measured.latency_s)} latencies and "
                              f"{len(measured.bandwidth_bytes_per_s)} bandwidths")
        if len(set(measured.peers)) != count:
            raise SchemaError("peer.links.peers", "names a peer twice")
        links = {}
        for i, (peer, latency, bandwidth) in enumerate(zip(measured.peers, measured.latency_s, measured.bandwidth_bytes_per_s)):
            if not (math.isfinite(latency) and latency >= 0):
                raise SchemaError(f"peer.links.latency_s[{i}]", f"must be finite and non-negative, got {latency!r}")
            if not (math.isfinite(bandwidth) and bandwidth > 0):
                raise SchemaError(f"peer.links.bandwidth_bytes_per_s[{i}]", f"must be finite and positive, got {bandwidth!r}")
            links[peer] = LinkMeasurement(latency, bandwidth)
        if len(parsed.dht) > MAX_DHT_MADDRS or any(len(m) > MAX_MADDR_CHARS for m in parsed.dht):
            raise SchemaError("peer.dht", f"at most {MAX_DHT_MADDRS} multiaddrs of at most {MAX_MADDR_CHARS} characters")
        dht = peer_maddrs(parsed.dht, "peer.dht")
        for name_, text in (("device_name", parsed.device_name), ("software", parsed.software)):
            if len(text) > MAX_TEXT_CHARS or not text.isprintable():
                raise SchemaError(f"peer.{name_}", f"must be at most {MAX_TEXT_CHARS} printable characters, got {text[:64]!r}")
        if parsed.token is not None and not 0 < len(parsed.token) <= MAX_TOKEN_CHARS:
            raise SchemaError("peer.token", f"must be 1 to {MAX_TOKEN_CHARS} characters, got {len(parsed.token)}")
        step_costs = planning_fields("peer", parsed.compute_key, parsed.compute_share, parsed.compute_background,
                                     parsed.compute_own, parsed.step_costs)
        relay = parsed.reachable.removeprefix(VIA)
        if parsed.reachable not in REACHABLE and not (relay != parsed.reachable and DEVICE_RE.match(relay) and relay != parsed.device_id):
            raise SchemaError("peer.reachable", f"must be one of {', '.join(REACHABLE)} or {VIA}<another peer's device id>, "
                                                f"got {parsed.reachable[:64]!r}")
        if not 0 <= parsed.punch <= 65535 or (parsed.punch and parsed.direct is None):
            raise SchemaError("peer.punch", f"must be a port in 1..65535 of a peer with a direct address, or 0, got {parsed.punch}")
        for name_, peers, most in (("suspects", parsed.suspects, MAX_SUSPECTS), ("unreachable", parsed.unreachable, MAX_SUSPECTS),
                                   ("calling", parsed.calling, MAX_CALLING), ("punched", parsed.punched, MAX_LINKS),
                                   ("relayed", parsed.relayed, MAX_LINKS)):
            if len(peers) > most or len(set(peers)) != len(peers):
                raise SchemaError(f"peer.{name_}", f"at most {most} different peers, got {len(peers)}")
            for i, peer in enumerate(peers):
                if not DEVICE_RE.match(peer) or peer == parsed.device_id:
                    raise SchemaError(f"peer.{name_}[{i}]", f"must be another peer's device id, got {peer[:64]!r}")
        if len(parsed.unreachable_how) != len(parsed.unreachable) or any(h not in FAILURES for h in parsed.unreachable_how):
            raise SchemaError("peer.unreachable_how", f"one of {', '.join(FAILURES)} for each peer in unreachable, "
                                                      f"got {[h[:32] for h in parsed.unreachable_how[:MAX_SUSPECTS + 1]]}")
        if parsed.team is not None and not TEAM_RE.match(parsed.team):
            raise SchemaError("peer.team", f"must be 1-32 of A-Z, a-z, 0-9, _, . and - starting with a letter or digit, "
                                           f"got {parsed.team[:64]!r}")
        received = _receipts(parsed.received, parsed.device_id)
        trained = _claims(parsed.trained)
        address = PeerAddress.from_wire(
            {"p2p": parsed.p2p, **({"direct": parsed.direct} if parsed.direct is not None else {})}, "peer.address"
        )
        return PeerRecord(
            device_id=parsed.device_id,
            model=parsed.model,
            dtype=parsed.dtype,
            device_name=parsed.device_name,
            tflops=parsed.tflops,
            memory_bytes=parsed.memory_bytes,
            address=address,
            state=parsed.state,
            time=parsed.time,
            epoch=parsed.epoch,
            layers=layers,
            step=parsed.step,
            loss=parsed.loss,
            val_loss=parsed.val_loss,
            noise_scale=parsed.noise_scale,
            checkpoint=checkpoint,
            tokens_per_s=parsed.tokens_per_s,
            links=links,
            achieved_tflops=parsed.achieved_tflops,
            dht=dht,
            token=parsed.token,
            suspects=tuple(parsed.suspects),
            compute_key=parsed.compute_key,
            compute_share=parsed.compute_share,
            compute_background=parsed.compute_background,
            compute_own=parsed.compute_own,
            timings=parsed.timings,
            step_costs=step_costs,
            reachable=parsed.reachable,
            unreachable=tuple(parsed.unreachable),
            unreachable_how=tuple(parsed.unreachable_how),
            punch=parsed.punch,
            calling=tuple(parsed.calling),
            punched=tuple(parsed.punched),
            relayed=tuple(parsed.relayed),
            team=parsed.team,
            received=received,
            trained=trained,
            software=parsed.software,
            version=parsed.version,
        )


_Check = Callable[[Any], bool]


def _columns(path: str, parsed: Any, names: Sequence[str], most: int) -> list[tuple]:
    """The rows of a record's parallel lists (`names` of `parsed`), at most `most` of them, all of one length."""
    columns = [getattr(parsed, name) for name in names]
    count = len(columns[0])
    if count > most:
        raise SchemaError(path, f"at most {most} entries, got {count}")
    if any(len(column) != count for column in columns):
        raise SchemaError(path, f"its lists ({', '.join(names)}) must be of one length, got "
                                f"{', '.join(str(len(c)) for c in columns)}")
    return list(zip(*columns))


def _counts(path: str, first: int, last: int, micro: int, sequences: int) -> None:
    """SchemaError unless steps [first, last] and the micro-batches and sequences of them make sense."""
    if not 0 <= first <= last or not 1 <= micro <= sequences or micro > (last - first + 1) * MAX_MICRO_PER_STEP:
        raise SchemaError(path, f"steps [{first}, {last}] with {micro} micro-batches of {sequences} sequences: needs "
                                f"0 <= first <= last and 1 <= micro-batches <= sequences, at most {MAX_MICRO_PER_STEP} a step")


def _receipts(parsed: Any, me: str) -> tuple[Receipt, ...]:
    rows = _columns("peer.received", parsed, ("peers", "epochs", "kinds", "first", "last", "micro", "sequences"), MAX_RECEIPTS)
    if len({(sender, epoch, kind) for sender, epoch, kind, *_ in rows}) != len(rows):
        raise SchemaError("peer.received", "names one (sender, epoch, kind) twice")
    for i, (sender, epoch, kind, first, last, micro, sequences) in enumerate(rows):
        if not DEVICE_RE.match(sender) or sender == me:
            raise SchemaError(f"peer.received[{i}]", f"must name another peer's device id, got {sender[:64]!r}")
        if kind not in RECEIPT_KINDS or epoch < 0:
            raise SchemaError(f"peer.received[{i}]", f"kind must be one of {', '.join(RECEIPT_KINDS)} and the epoch "
                                                     f"non-negative, got {kind[:32]!r} in epoch {epoch}")
        _counts(f"peer.received[{i}]", first, last, micro, sequences)
    return tuple(Receipt(*row) for row in rows)


def _claims(parsed: Any) -> tuple[Claim, ...]:
    rows = _columns("peer.trained", parsed, ("epochs", "first", "last", "micro", "sequences"), MAX_CLAIMS)
    if len({row[0] for row in rows}) != len(rows):
        raise SchemaError("peer.trained", "claims one epoch twice")
    for i, (epoch, first, last, micro, sequences) in enumerate(rows):
        if epoch < 0:
            raise SchemaError(f"peer.trained[{i}]", f"epoch must be non-negative, got {epoch}")
        _counts(f"peer.trained[{i}]", first, last, micro, sequences)
    return tuple(Claim(*row) for row in rows)


def check_age(time: float, now: float, max_age_s: float) -> None:
    """SchemaError unless a record announced at `time` is at most `max_age_s` old at `now`, nor as far ahead."""
    if time < now - max_age_s:
        raise SchemaError("peer.time", f"announced {now - time:.1f} s ago, older than {max_age_s:g} s (stale)")
    if time > now + max_age_s:  # clocks differ a little; more than the whole window is a lie
        raise SchemaError("peer.time", f"announced {time - now:.1f} s in the future, more than {max_age_s:g} s ahead")


def planning_fields(path: str, compute_key: str | None, compute_share: float, compute_background: float,
                    compute_own: float, step_costs: Sequence[float]) -> StepCosts:
    """Check what a record says of the device a peer computes on and of what its step costs (the record's
    fields of those names; `path` names the record in errors) and return its `StepCosts`: for records read from
    the DHT and for peers an API client reads, which plan from them alike."""
    if compute_key is not None and not COMPUTE_KEY_RE.match(compute_key):
        raise SchemaError(f"{path}.compute_key", f"must be 16 lowercase hex digits, got {compute_key[:64]!r}")
    if not (math.isfinite(compute_share) and 0 < compute_share <= 1):
        raise SchemaError(f"{path}.compute_share", f"must be in (0, 1], got {compute_share!r}")
    for name, value in (("compute_background", compute_background), ("compute_own", compute_own)):
        if not (math.isfinite(value) and 0 <= value < 1):
            raise SchemaError(f"{path}.{name}", f"must be in [0, 1), got {value!r}")
    if compute_background + compute_own > 1 + 1e-9:
        raise SchemaError(f"{path}.compute_own", f"with compute_background ({compute_background!r}) is more than the whole "
                                                 f"device, got {compute_own!r}")
    if len(step_costs) not in (*OLDER_STEP_COSTS, len(FIELDS_OF_STEP_COSTS)):  # older peers time no recomputation, no codecs
        raise SchemaError(f"{path}.step_costs", f"must be {len(FIELDS_OF_STEP_COSTS)} numbers "
                                                f"({', '.join(FIELDS_OF_STEP_COSTS)}; "
                                                f"{' or '.join(map(str, OLDER_STEP_COSTS))} from older peers), "
                                                f"got {len(step_costs)}")
    try:
        return StepCosts(*step_costs)
    except ValueError as error:
        raise SchemaError(f"{path}.step_costs", str(error)) from None


def _exact_check(model: type[pydantic.BaseModel]) -> _Check:
    """A check that `raw` is exactly what `model` parses without changing anything: every field present and
    nothing else, each value of its strict type (a bool is no int), lists as lists, nested models likewise.
    What it passes, `model.parse_obj(raw).dict() == raw` passes too; what it refuses goes through pydantic for
    the error's words. Derived from the model, so the schema stays defined once; about 20x faster than
    parse_obj and dict(), which a coordinator of 10,000 peers does every heartbeat. A field type it does not
    know makes it refuse everything (the slow path then decides alone)."""
    scalar: dict[type, _Check] = {
        pydantic.StrictStr: lambda v: isinstance(v, str),
        pydantic.StrictInt: lambda v: isinstance(v, int) and not isinstance(v, bool),
        pydantic.StrictFloat: lambda v: isinstance(v, float),
    }
    checks: list[tuple[str, _Check]] = []
    for name, info in model.__fields__.items():
        one = scalar.get(info.type_)
        if one is None and isinstance(info.type_, type) and issubclass(info.type_, pydantic.BaseModel):
            one = _exact_check(info.type_)
        if one is None or info.shape not in (SHAPE_SINGLETON, SHAPE_LIST):
            return lambda raw: False
        check = one if info.shape == SHAPE_SINGLETON else (lambda v, one=one: isinstance(v, list) and all(map(one, v)))
        checks.append((name, (lambda v, check=check: v is None or check(v)) if info.allow_none else check))
    names = {name for name, _ in checks}
    return lambda raw: isinstance(raw, dict) and raw.keys() == names and all(check(raw[name]) for name, check in checks)


def _read_exact(raw: Any, check: _Check) -> SimpleNamespace | None:
    """`raw` as attributes (nested objects too) when `check` passes it, else None."""
    if not check(raw):
        return None
    return SimpleNamespace(**{k: SimpleNamespace(**v) if isinstance(v, dict) else v for k, v in raw.items()})


_PEER_EXACT = _exact_check(PeerSchema)


def _an_object(raw: Any, what: str) -> None:
    """SchemaError unless `raw` is a dict with string keys: pydantic's parse_obj would take a list of pairs for
    one, and fail on other keys with a TypeError."""
    if not isinstance(raw, dict) or not all(isinstance(key, str) for key in raw):
        raise SchemaError(what, f"must be an object with string keys, got {type(raw).__name__}")


def plan_to_wire(plan: Plan, time: float) -> dict[str, Any]:
    return {"plan": json.dumps(plan.to_wire(), separators=(",", ":")), "time": float(time)}


def plan_from_wire(raw: Any) -> tuple[Plan, float]:
    """(plan, publication time) from a plan record; SchemaError names what is wrong."""
    _an_object(raw, "plan_record")
    try:
        parsed = PlanSchema.parse_obj(raw)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        raise SchemaError("plan_record." + ".".join(str(p) for p in first["loc"]), first["msg"]) from None
    if len(parsed.plan) > MAX_PLAN_BYTES:
        raise SchemaError("plan_record.plan", f"{len(parsed.plan)} bytes, at most {MAX_PLAN_BYTES}")
    try:
        wire = json.loads(parsed.plan)
    except (ValueError, RecursionError) as error:  # also too deep, and integers past Python's digit limit
        raise SchemaError("plan_record.plan", f"is not JSON: {str(error)[:120]}") from None
    try:
        return Plan.from_wire(wire), parsed.time
    except (OverflowError, RecursionError) as error:  # e.g. an integer cost too large for a float
        raise SchemaError("plan_record.plan", f"has a value out of range: {error}") from None
