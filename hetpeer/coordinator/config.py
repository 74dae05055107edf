"""What a coordinator is told (`hetpeer coordinator`'s options): `CoordinatorConfig`, plain data checked
when it is made. The live objects it names (the DHT, the API, the dashboard) are made by
`service.Coordinator` when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hetpeer.coordinator import gate
from hetpeer.coordinator.tls import ServerTls
from hetpeer.protocol.modelspec import PRESETS, ModelSpec
from hetpeer.protocol.plan import MAX_OUTER_EVERY, SYNC_CHOICES, Dataset
from hetpeer.protocol.recipe import Recipe
from hetpeer.protocol.workload import Workload


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    swarm: str
    home: Path  # keeps the coordinator's key: peers trust plans signed by it
    initial_peers: tuple[str, ...] = ()
    dht_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    dht_announce: tuple[str, ...] = ()  # DHT multiaddrs peers should dial, when they differ from dht_maddrs
    api_listen: str | None = "127.0.0.1:0"  # None: no gRPC API
    api_tls: ServerTls | None = None  # the API's certificate and key: serve it (and the dashboard) over TLS
    http_listen: str | None = None  # where to serve the web dashboard and /metrics; None: nowhere
    model: ModelSpec = PRESETS["tiny"]  # a preset, or a model folder's spec (`modelspec.load_model`)
    batch: int = 16
    micro_batch: int = 2
    dtype: str = "fp32"
    heartbeat_s: float = 2.0
    replan_interval_s: float = 300.0  # docs/churn.md: breaks are repaired at once; a full re-solve this often
    settle_s: float | None = None  # default: two heartbeats
    min_peers: int = 2
    gain: float = 0.1  # a new plan must predict a step this much faster (moving weights included)
    time_budget_s: float = 2.0
    workers: int = 1  # planner searches at once (`planner/islands.py`); `hetpeer coordinator` defaults to its cores
    stages: int | None = None
    group_size: int | None = None
    compress: tuple[str, str] = ("auto", "auto")  # codecs between stages: auto (the planner's, per hop) or a fixed pair
    sync: str = "auto"  # how groups average: auto (per group), allreduce, gossip or outer (`plan.SYNC_CHOICES`)
    outer_every: int | None = 0  # groups may take outer steps: every N steps, or 0 (chosen per group); None: never
    seed: int = 0
    plan_ttl_s: float = 3600.0  # the plan stays in the DHT this long after its last (re)publication
    steps: int | None = None  # the swarm's last step: no new plan once the running one reaches it
    join_file: Path | None = None  # where to write what peers need to join (`hetpeer join --join-file`)
    reach_port: int | None = 0  # the reach service's port on the DHT's host (0: any free one; None: no service)
    recipe: Recipe = Recipe()  # the training recipe every plan carries: every peer trains by it (protocol/recipe.py)
    admission: str = "open"  # who may be planned: open, allowlist (of `allowlist`) or token (`hetpeer invite`)
    allowlist: Path | None = None  # read again whenever it changes
    ban_period_s: float = 300.0  # the first ban of a peer its group reports; doubles on each repeat; 0: no bans
    # the prepared corpus plans name (its URL empty: served from `data_folder` on the dashboard's port); None: each
    # peer's own data
    dataset: Dataset | None = None
    data_folder: Path | None = None

    def __post_init__(self) -> None:
        self.workload  # a ValueError naming what does not fit
        if self.admission not in gate.ADMISSIONS or (self.admission == "allowlist") != (self.allowlist is not None):
            raise ValueError(f"admission must be one of {', '.join(gate.ADMISSIONS)}, with an allow-list file exactly "
                             f"for 'allowlist'; got {self.admission!r} and {self.allowlist}")
        if not self.ban_period_s >= 0:
            raise ValueError(f"ban period must be a non-negative number of seconds, got {self.ban_period_s}")
        if not self.heartbeat_s > 0 or not self.replan_interval_s > 0 or not self.time_budget_s > 0:
            raise ValueError("heartbeat, re-plan interval and time budget must be positive")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.sync not in SYNC_CHOICES:
            raise ValueError(f"sync must be one of {', '.join(SYNC_CHOICES)}, got {self.sync!r}")
        if self.outer_every is not None and not 0 <= self.outer_every <= MAX_OUTER_EVERY:
            raise ValueError(f"outer steps must be 1 to {MAX_OUTER_EVERY} steps apart (0: chosen per group), got {self.outer_every}")
        if self.dataset is not None and not self.dataset.url and (self.data_folder is None or self.http_listen is None):
            raise ValueError("a dataset with no URL is served by the coordinator: give its folder and --http (or --data-url)")
        if self.min_peers < 1 or not 0 <= self.gain < 1:
            raise ValueError(f"min_peers must be >= 1 and gain in [0, 1), got {self.min_peers}, {self.gain}")

    @property
    def workload(self) -> Workload:
        return Workload(self.model, batch=self.batch, micro_batch=self.micro_batch, dtype=self.dtype)
