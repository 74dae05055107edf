"""hetpeer against hivemind's collaborative training, on the same testbed of containers, back to back.

    python3 benchmarks/vs_hivemind.py [--duration 300] [--inter-mbit 5] [--case both] [--compress auto]
                                      [--outer-every auto] [--diloco-every 50] [--out DIR] [--json]

The testbed (`hetpeer testbed`'s project: one container per device, each shaping what it sends to every
other device with htb): 8 devices in two regions, a fast site (`--fast-tflops`, 4 devices) and a slow one
(half as fast); links inside a site `--intra-mbit`, between the sites `--inter-mbit`, per pair of devices.
Latency is not emulated for either system: hivemind's traffic goes through its own libp2p daemon, which
hetpeer's user-space latency emulation cannot reach, so both run on the shaped bandwidth alone. Compute is
slowed (`--slowdown` for the fast site, twice that for the slow one) with the same emulation in both.

(a) speed, the `small` GPT: both systems train from the same initial weights, batches drawn by the same
    rule (seed, lane or peer, step) from the same corpus, AdamW with the same lr, betas (0.9, 0.95) and
    weight decay 0.1 on matrices (hetpeer's rule), global batch `--batch` sequences, weights and
    gradients averaged in fp16, for `--duration` seconds from each system's first step:
    - hetpeer: `hetpeer coordinator` plans from the peers' own measurements (stages, groups, lanes; the
      time model, with the codecs of activations and their gradients chosen per hop: `--compress`,
      default auto; each group's sync chosen among every-step gossip, all-reduce and outer steps:
      `--outer-every`, default auto, from a cold start: `--outer-warmup 0`), peers train with decentralized
      Adam in their groups (`--sync-compress fp16`);
    - hetpeer-CODEC (with `--fixed-compress CODEC`): the same with every hop in CODEC, hetpeer's setting
      before its planner chose codecs;
    - hivemind: benchmarks/hivemind_peer.py on every device: `hivemind.Optimizer` over AdamW on the whole
      model, target batch = hetpeer's global batch, set up as hivemind's ALBERT example does for the
      internet (offloaded optimizer, delayed optimizer step and gradient averaging, fp16 gradients and
      state, state averaged every epoch, matchmaking 5 s, averaging timeout 60 s);
    - diloco (unless `--diloco-every none`): DiLoCo as OpenDiLoCo runs it on hivemind (hivemind_peer.py
      --diloco H): each peer trains the whole model on its share of the global batch, an outer step every H.
    Reported: tokens/s (tokens trained over the duration), loss against wall time and against tokens,
    bytes each container sent (its eth0 counter), and hivemind's averaging rounds.
(b) memory, the `medium` GPT (38M parameters) on the same devices with their containers limited to
    `--memory-gb`: hivemind's and DiLoCo's peers hold the whole model with its optimizer state (DiLoCo's also
    the anchor and outer momentum); hetpeer's hold a stage.

Output folder: the two compose projects with every container's log, `loss_vs_time.png`,
`loss_vs_tokens.png` (matplotlib: `pip install -e '.[plots]'`), `curves.json` (the loss curves they are
drawn from: `--replot CURVES.json` draws them again) and `result.json`. `--json` prints one
JSON object as the last line: `hetpeer`, `hivemind`, `diloco` (and `hetpeer-CODEC`), each with `tokens_per_s` and
`loss_at_equal_time`, `speedup` (over hivemind) and `speedup_over_diloco`, and `memory` for case (b).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import yaml

from hetpeer import logline
from hetpeer.cli.common import compress_choice, compress_text, outer_every_choice, outer_every_text
from hetpeer.coordinator.planner.outer import OUTER_AUTO
from hetpeer.coordinator.api_client import ApiClient
from hetpeer.coordinator.api_errors import ApiError
from hetpeer.peer.launch import free_port
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.modelspec import preset
from hetpeer.swarm.plots import available, charts_png
from hetpeer.swarm.report import samples_from_lanes
from hetpeer.testbed.compose import Compose, ComposeError, check_docker, free_subnet, image_exists, run
from hetpeer.testbed.project import (
    COORDINATOR,
    TestbedConfig,
    compose_project,
    script,
    service_name,
    shaping,
    slowdowns,
)
from hetpeer.testbed.run import Testbed, lane_steps

GOAL_SPEEDUP = 4.0  # hetpeer's tokens/s over hivemind's in (a), at equal or lower loss after equal time
GOAL_CODECS = 1.5  # hetpeer's tokens/s with the codecs its coordinator chose over every hop in fp16 (docs/compression.md)
BENCH = Path(__file__).resolve().parent
PEERS_FILE = "/swarm/hivemind-peers.txt"
HIVEMIND_RE = re.compile(r"^hivemind peer (\d+) step (\d+) loss ([\d.naif]+) samples (\d+) epoch (\d+) peak (\d+) MiB")
HIVEMIND_LOG_RE = re.compile(r"\[INFO\] (Averaged gradients with (\d+) peers|Proceeding with local gradients)")
DILOCO_LOG_RE = re.compile(r"hivemind peer \d+ outer step \d+: (averaged with (\d+) peer)")
LOSS_WINDOW, LOSS_WINDOW_S = 0.1, 30.0  # the loss "after time T": the mean over its last tenth (at least 30 s)


def two_sites(args: argparse.Namespace, memory_gb: float | None = None) -> Topology:
    devices = [{"id": f"{site}-{i}", "region": site, "tflops": tflops} | ({"memory_gb": memory_gb} if memory_gb else {})
               for site, tflops in (("fast", args.fast_tflops), ("slow", args.fast_tflops / 2)) for i in range(4)]
    return Topology.from_wire({
        "name": "two sites, two speeds",
        "devices": devices,
        "regions": {site: {"latency_ms": 1, "bandwidth_gbps": args.intra_mbit / 1000} for site in ("fast", "slow")},
        "region_links": [{"a": "fast", "b": "slow", "latency_ms": 1, "bandwidth_gbps": args.inter_mbit / 1000}],
    })


@dataclass
class Outcome:
    """One system's run: points (seconds since its first step, tokens trained by then, loss), what each
    container sent, and notes."""

    system: str
    points: list[tuple[float, float, float]] = field(default_factory=list)
    sent_bytes: dict[str, int] = field(default_factory=dict)
    notes: dict = field(default_factory=dict)

    def within(self, seconds: float) -> list[tuple[float, float, float]]:
        return [p for p in self.points if p[0] <= seconds]


def sent_bytes(compose: Compose, services: list[str]) -> dict[str, int]:
    """Bytes each running container has sent on its network interface since it started."""
    found = {}
    for name in services:
        done = run(["docker", "exec", compose.container(name), "cat", "/sys/class/net/eth0/statistics/tx_bytes"], check=False)
        if done.returncode == 0 and done.stdout.strip().isdigit():
            found[name] = int(done.stdout)
    return found


def container_state(compose: Compose, service: str) -> dict:
    done = run(["docker", "inspect", "-f", "{{json .State}}", compose.container(service)])
    state = json.loads(done.stdout)
    return {"running": state["Running"], "oom_killed": state["OOMKilled"], "exit_code": state["ExitCode"]}


def peer_services(config: TestbedConfig) -> list[str]:
    return [service_name(d.id) for d in config.topology.devices]


# -- hetpeer ---------------------------------------------------------------------------------------


def run_hetpeer(config: TestbedConfig, duration_s: float, say, system: str = "hetpeer") -> Outcome:
    bed = Testbed(config, lambda line: None)
    outcome = Outcome(system)
    try:
        bed.start()
        say(f"{system}: {len(config.topology.devices)} peers and a coordinator started; waiting for the first step")
        first = None
        deadline = time.monotonic() + 600
        with ApiClient(bed.api_address, timeout_s=5.0) as client:
            while first is None or time.monotonic() < first + duration_s:
                if time.monotonic() > deadline and first is None:
                    raise SystemExit(f"{system}: no step within 600 s (see the logs in the output folder)")
                try:
                    progress = client.call_get_progress()
                except ApiError:
                    progress = None
                if first is None and progress is not None and progress.step >= 1:
                    first = time.monotonic()
                    say(f"{system}: training")
                elif first is not None and progress is not None and int(time.monotonic() - first) % 30 == 0:
                    plan = client.call_get_plan()[0]
                    shape = f"{len(plan.stages)} stage(s) x {plan.group_size} lane(s)" if plan else "no plan"
                    say(f"{system}: {time.monotonic() - first:.0f} s, step {progress.step}, loss "
                        f"{cell(progress.loss, '.3f')}, plan epoch {progress.epoch} ({shape})")
                time.sleep(1.0)
            plan = client.call_get_plan()[0]
            peers = client.call_list_peers()
        outcome.sent_bytes = sent_bytes(bed.compose, peer_services(config))
        outcome.notes["plan"] = {"stages": [[s.layer_start, s.layer_end, list(s.devices)] for s in plan.stages],
                                 "hops": [s.hop_codecs or "raw" for s in plan.stages[:-1]],
                                 "sync": [s.sync_words for s in plan.stages],
                                 "standby": list(plan.standby), "epoch": plan.epoch} if plan else None
        outcome.notes["announced_memory_bytes"] = {p.record.device_id: p.record.memory_bytes for p in peers}
        outcome.notes["oom_killed"] = [s for s in peer_services(config) if container_state(bed.compose, s)["oom_killed"]]
    finally:
        logs = bed.logs()
        bed.shutdown()
    samples = samples_from_lanes(lane_steps(logs))
    if not samples:
        return outcome
    start = samples[0].time_s
    tokens_per_step = config.batch * preset(config.model).seq_len
    outcome.points = [(s.time_s - start, (s.step + 1) * tokens_per_step, s.loss) for s in samples]
    outcome.notes["plans_run"] = sorted({s.epoch for s in samples})
    return outcome


# -- hivemind --------------------------------------------------------------------------------------


def hivemind_project(config: TestbedConfig, args: argparse.Namespace, model: str, diloco: int | None = None) -> Compose:
    """The testbed's project (the same addresses, shaping and memory limits) with hivemind_peer.py in every
    container instead of hetpeer (hivemind.Optimizer, or DiLoCo every `diloco` steps), and its bootstrap DHT
    node where the coordinator was."""
    out = config.out
    (out / "run").mkdir(parents=True, exist_ok=True)
    (out / "swarm").mkdir(exist_ok=True)
    (out / "swarm" / "hivemind-peers.txt").unlink(missing_ok=True)
    addresses = config.addresses
    program = ["python", "/bench/hivemind_peer.py", "--peers-file", PEERS_FILE]
    texts = {COORDINATOR: script([], program + ["--bootstrap", "--announce-ip", addresses[COORDINATOR]])}
    slow = slowdowns(config)
    peers = len(config.topology.devices)
    # DiLoCo: each peer's share of the global batch a step, as OpenDiLoCo splits its total batch over its workers
    training = ["--diloco", str(diloco), "--peers", str(peers), "--local-batch", str(max(1, config.batch // peers))] if diloco else [
        "--target-batch", str(config.batch), "--local-batch", str(args.local_batch)]
    for i, device in enumerate(config.topology.devices):
        name = service_name(device.id)
        uplink_mbit = sum(config.topology.link(device, other).bandwidth_gbps * 1000 * config.scale
                          for other in config.topology.devices if other.id != device.id)
        texts[name] = script(shaping(config, device), program + [
            "--announce-ip", addresses[name], "--peer", str(i), "--model", model, *training, "--lr", repr(args.lr), "--seed", "0", "--slowdown", f"{slow[device.id]:.6g}",
            "--threads", "1", "--bandwidth-mbit", f"{uplink_mbit:.6g}",
        ])
    for name, text in texts.items():
        (out / "run" / f"{name}.sh").write_text(text)
    project = compose_project(config)
    for service in project["services"].values():
        service["volumes"] = ["./run:/testbed/run:ro", "./swarm:/swarm", f"{BENCH}:/bench:ro"]
        service.pop("ports", None)
    path = out / "compose.yaml"
    path.write_text("# hivemind's peers on the testbed: written by benchmarks/vs_hivemind.py\n" + yaml.safe_dump(project, sort_keys=False))
    return Compose(path, config.project)


def run_hivemind(config: TestbedConfig, args: argparse.Namespace, model: str, duration_s: float, say,
                 diloco: int | None = None) -> Outcome:
    system = "diloco" if diloco else "hivemind"
    compose = hivemind_project(config, args, model, diloco)
    services = peer_services(config)
    outcome = Outcome(system)
    logs: dict[str, str] = {}
    try:
        compose.up()
        say(f"{system}: {len(services)} peers and a bootstrap node started; waiting for the first step")
        first, deadline = None, time.monotonic() + 600
        while first is None or time.monotonic() < first + duration_s:
            time.sleep(5.0)
            if first is None:
                if any(" step 1 " in compose.logs(s) for s in services[:2]):
                    first = time.monotonic()
                    say(f"{system}: training")
                elif not set(compose.running()) & set(services):
                    say(f"{system}: every peer has exited")
                    break
                elif time.monotonic() > deadline:
                    say(f"{system}: no step within 600 s")
                    break
            elif int(time.monotonic() - first) % 30 < 5:
                say(f"{system}: {time.monotonic() - first:.0f} s")
        outcome.sent_bytes = sent_bytes(compose, [s for s in services if s in compose.running()])
        outcome.notes["containers"] = {s: container_state(compose, s) for s in services}
    finally:
        folder = config.out / "logs"
        folder.mkdir(exist_ok=True)
        for name in [COORDINATOR] + services:
            try:
                logs[name] = compose.logs(name)
            except ComposeError as error:
                logs[name] = f"(no log: {error})"
            (folder / f"{name}.log").write_text(logs[name] + "\n")
        compose.down()
    lines, rounds, peaks, last_words = [], {"averaged": 0, "local": 0, "peers": []}, {}, {}
    for name in services:
        for line in logs[name].splitlines():
            if (found := HIVEMIND_LOG_RE.search(line) or DILOCO_LOG_RE.search(line)) is not None:
                if found.group(2) and int(found.group(2)) > 1:
                    rounds["averaged"] += 1
                    rounds["peers"].append(int(found.group(2)))
                else:
                    rounds["local"] += 1
            when, text = logline.split(line)
            if when is not None and (found := HIVEMIND_RE.match(text)) is not None:
                lines.append((logline.seconds(when), float(found.group(3)), int(found.group(4))))
                peaks[name] = int(found.group(6))
        last_words[name] = next((line for line in reversed(logs[name].splitlines()) if line.strip()), "")
    outcome.notes.update(peak_mib=peaks, averaging=rounds, last_lines=last_words)
    if lines:
        lines.sort()
        start = lines[0][0]
        seq_len = preset(model).seq_len
        tokens = np.cumsum([samples * seq_len for _, _, samples in lines])
        outcome.points = [(t - start, float(n), loss) for (t, loss, _), n in zip(lines, tokens)]
    return outcome


# -- figures ---------------------------------------------------------------------------------------


def figures(outcome: Outcome, duration_s: float, equal_time_s: float, equal_tokens: float) -> dict:
    points = outcome.within(duration_s)
    if not points:
        return {"tokens_per_s": 0.0, "tokens_per_s_second_half": None, "tokens": 0, "loss_first": None,
                "loss_at_equal_time": None, "loss_at_equal_tokens": None, "sent_mb_per_peer": None, "sent_mb_max": None}
    tokens = points[-1][1]
    late = [p for p in points if p[0] >= duration_s / 2]
    window_s = max(LOSS_WINDOW * equal_time_s, LOSS_WINDOW_S)
    early = [loss for t, _, loss in points if t <= window_s]
    in_time = [loss for t, _, loss in points if equal_time_s - window_s <= t <= equal_time_s]
    in_tokens = [loss for _, n, loss in outcome.points if equal_tokens * (1 - LOSS_WINDOW) <= n <= equal_tokens]
    sent = list(outcome.sent_bytes.values())
    return {
        "tokens_per_s": tokens / duration_s,
        "tokens_per_s_second_half": (late[-1][1] - late[0][1]) / max(late[-1][0] - late[0][0], 1e-9) if len(late) > 1 else None,
        "tokens": tokens,
        "loss_first": float(np.mean(early)) if early else None,
        "loss_at_equal_time": float(np.mean(in_time)) if in_time else None,
        "loss_at_equal_tokens": float(np.mean(in_tokens)) if in_tokens else None,
        "sent_mb_per_peer": float(np.mean(sent)) / 1e6 if sent else None,
        "sent_mb_max": max(sent) / 1e6 if sent else None,
    }


def curve(points: list[tuple[float, float, float]], x: int, bins: int = 40) -> tuple[list[float], list[float]]:
    """The loss binned along time (x=0) or tokens (x=1): each bin's mean, at the bin's end."""
    if not points:
        return [], []
    values = np.array([(p[x], p[2]) for p in points])
    edges = np.linspace(0, values[:, 0].max(), bins + 1)
    xs, ys = [], []
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = values[(values[:, 0] > lo) & (values[:, 0] <= hi), 1]
        if inside.size:
            xs.append(float(hi))
            ys.append(float(inside.mean()))
    return xs, ys


def plots(out: Path, outcomes: list[Outcome], duration_s: float) -> None:
    for x, name, label in ((0, "loss_vs_time.png", "seconds since the first step"), (1, "loss_vs_tokens.png", "tokens trained")):
        series = [(o.system, *curve(o.within(duration_s), x)) for o in outcomes]
        (out / name).write_bytes(charts_png([{"series": series, "title": "training loss, hetpeer and hivemind on the same "
                                              "testbed", "x_label": label, "y_label": "loss"}]))


def replot(path: Path, duration_s: float, parser: argparse.ArgumentParser) -> int:
    """The pictures of a finished run, from the curves it saved (what docs/images holds beside them)."""
    if not available():
        parser.error("the loss pictures need matplotlib: pip install -e '.[plots]'")
    try:
        curves = json.loads(path.read_text())
        outcomes = [Outcome(system, [tuple(float(v) for v in p) for p in points]) for system, points in curves.items()]
    except (OSError, ValueError, KeyError, TypeError) as error:
        parser.error(f"{path} is not a run's curves.json ({{'hetpeer': [[s, tokens, loss], ...], 'hivemind': ...}}): {error}")
    plots(path.parent, outcomes, duration_s)
    print(f"drawn: {path.parent / 'loss_vs_time.png'} and {path.parent / 'loss_vs_tokens.png'} from {path}")
    return 0


# -- main ------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("both", "speed", "memory"), default="both", help="(a) speed, (b) memory, or both (default)")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds each system trains in (a), from its first step (default 300)")
    parser.add_argument("--memory-duration", type=float, default=180.0, help="seconds hetpeer trains in (b) (default 180)")
    parser.add_argument("--intra-mbit", type=float, default=100.0, help="each link inside a site, Mbit/s (default 100)")
    parser.add_argument("--inter-mbit", type=float, default=5.0, help="each link between the sites, Mbit/s (default 5)")
    parser.add_argument("--fast-tflops", type=float, default=2.0, help="the fast site's devices (the slow site's: half; only the ratio matters)")
    parser.add_argument("--slowdown", type=float, default=6.0, help="the fast site's compute slowdown; the slow site's is twice it (default 6)")
    parser.add_argument("--batch", type=int, default=64, help="global batch in sequences: hetpeer's batch and hivemind's target (default 64)")
    parser.add_argument("--local-batch", type=int, default=4, help="hivemind: sequences per local step (default 4)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate of both (default 3e-3)")
    parser.add_argument("--memory-gb", type=float, default=1.5, help="(b): each container's memory limit, GB (default 1.5)")
    parser.add_argument("--compress", type=compress_choice, default=("auto", "auto"), metavar="auto|CODEC[/CODEC]",
                        help="hetpeer's coordinator's --compress in (a) (default auto: it chooses each hop's codecs)")
    parser.add_argument("--fixed-compress", type=fixed_compress, default=None, metavar="CODEC|none",
                        help="(a) also runs hetpeer with every hop in this codec, as before its planner chose codecs, e.g. "
                        "fp16 (default none: not run)")
    parser.add_argument("--outer-every", type=outer_every_choice, default=OUTER_AUTO, metavar="N|auto|never",
                        help="hetpeer's coordinator's --outer-every (default auto: its planner gives a group outer steps where they "
                        "take the least time to loss; never: every-step sync only)")
    parser.add_argument("--outer-warmup", type=int, default=0, metavar="STEPS",
                        help="hetpeer's coordinator's --outer-warmup (default 0 here: a cold start, as the DiLoCo baseline's)")
    parser.add_argument("--diloco-every", type=outer_choice, default=50, metavar="H|none",
                        help="also run the DiLoCo baseline (hivemind_peer.py --diloco H; default 50, OpenDiLoCo's setting for "
                        "its 150M model; none: not run)")
    parser.add_argument("--heartbeat", type=float, default=2.0, help="hetpeer's record heartbeat, seconds (default 2)")
    parser.add_argument("--image", default="hetpeer:latest", help="the testbed's image, from docker/build.sh (default hetpeer:latest)")
    parser.add_argument("--out", type=Path, help="output folder (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--replot", type=Path, metavar="CURVES.json",
                        help="run nothing: draw loss_vs_time.png and loss_vs_tokens.png again, beside it, from a run's curves.json")
    args = parser.parse_args()
    if args.replot is not None:
        return replot(args.replot, args.duration, parser)
    for name in ("duration", "memory_duration", "intra_mbit", "inter_mbit", "fast_tflops", "memory_gb", "heartbeat", "lr"):
        if not np.isfinite(getattr(args, name)) or getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be a positive number, not {getattr(args, name)!r}")
    if args.slowdown < 1 or not np.isfinite(args.slowdown):
        parser.error(f"--slowdown must be a number >= 1, not {args.slowdown!r}")
    if args.batch < 1 or args.local_batch < 1:
        parser.error("--batch and --local-batch must be at least 1")
    if not available():
        parser.error("the loss pictures need matplotlib: pip install -e '.[plots]'")
    try:
        check_docker()
        if not image_exists(args.image):
            raise ComposeError(f"no image {args.image}: build it first (docker/build.sh, see docker/README.md)")
    except ComposeError as error:
        print(f"vs_hivemind: {error}", file=sys.stderr)
        return 2
    out = (args.out or Path(tempfile.mkdtemp(prefix="hetpeer-vs-hivemind-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def say(text: str) -> None:
        print(f"[{time.monotonic() - started:6.0f} s] {text}", flush=True)

    def config(name: str, topology: Topology, model: str, batch: int, compress: str = compress_text(args.compress)) -> TestbedConfig:
        outer = ("--outer-every", outer_every_text(args.outer_every), "--outer-warmup", str(args.outer_warmup))
        return TestbedConfig(
            topology=topology, out=out / name, slowdown=args.slowdown if model == "small" else 1.0, emulate_latency=False,
            image=args.image, project=f"hetpeer-vs-{name}-{time.time_ns() % 10**8}", subnet=free_subnet(), api_port=free_port(),
            swarm="vs", model=model, batch=batch, micro_batch=2, heartbeat_s=args.heartbeat,
            coordinator_args=("--compress", compress, *outer, "--set", "sync_codec=fp16", "--set", f"lr={args.lr!r}"),
            peer_args=("--probe-targets", "7"),
        )

    result: dict = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    say(f"output in {out}")
    if args.case in ("both", "speed"):
        base = config("speed-hetpeer", two_sites(args), "small", args.batch)
        say(f"(a) speed: the small GPT on 8 devices, two sites, {args.intra_mbit:g} Mbit/s inside a site and "
            f"{args.inter_mbit:g} Mbit/s between them, compute {args.slowdown:g}x / {2 * args.slowdown:g}x slower")
        het = run_hetpeer(base, args.duration, say)
        outcomes = [het]
        if args.fixed_compress is not None:
            fixed = config("speed-hetpeer-fixed", two_sites(args), "small", args.batch, args.fixed_compress)
            outcomes.append(run_hetpeer(fixed, args.duration, say, f"hetpeer-{args.fixed_compress}"))
        hm = run_hivemind(replace(base, out=out / "speed-hivemind", project=base.project.replace("-hetpeer-", "-hivemind-")),
                          args, "small", args.duration, say)
        outcomes.append(hm)
        if args.diloco_every:
            outcomes.append(run_hivemind(replace(base, out=out / "speed-diloco", project=base.project.replace("-hetpeer-", "-diloco-")),
                                         args, "small", args.duration, say, diloco=args.diloco_every))
        equal_time = min([args.duration] + [o.points[-1][0] if o.points else 0 for o in outcomes])
        equal_tokens = min(o.within(args.duration)[-1][1] if o.within(args.duration) else 0 for o in outcomes)
        for o in outcomes:
            result[o.system] = {**figures(o, args.duration, equal_time, equal_tokens), "notes": o.notes}
        result["equal_time_s"], result["equal_tokens"] = equal_time, equal_tokens
        result["systems"] = [o.system for o in outcomes]
        result["speedup"] = ratio(result, "hetpeer", "hivemind")
        if args.diloco_every:
            result["speedup_over_diloco"] = ratio(result, "hetpeer", "diloco")
        result["goal"] = {"speedup": GOAL_SPEEDUP, "loss": "hetpeer's loss at equal time <= hivemind's"}
        if args.fixed_compress is not None:
            result["speedup_over_fixed"] = ratio(result, "hetpeer", f"hetpeer-{args.fixed_compress}")
            result["goal"]["speedup_over_fixed"] = GOAL_CODECS
        plots(out, outcomes, args.duration)
        (out / "curves.json").write_text(json.dumps({o.system: o.points for o in outcomes}))
    if args.case in ("both", "memory"):
        topology = two_sites(args, memory_gb=args.memory_gb)
        base = config("memory-hetpeer", topology, "medium", 16)
        say(f"(b) memory: the medium GPT, every container limited to {args.memory_gb:g} GB")
        hm = run_hivemind(replace(base, out=out / "memory-hivemind", project=base.project.replace("-hetpeer-", "-hivemind-")),
                          args, "medium", args.memory_duration, say)
        dl = run_hivemind(replace(base, out=out / "memory-diloco", project=base.project.replace("-hetpeer-", "-diloco-")),
                          args, "medium", args.memory_duration, say, diloco=args.diloco_every) if args.diloco_every else None
        het = run_hetpeer(base, args.memory_duration, say)
        result["memory"] = {
            "memory_gb": args.memory_gb,
            "hivemind": {"trained": bool(hm.points), "containers": hm.notes.get("containers"),
                         "peak_mib": hm.notes.get("peak_mib"), "last_lines": hm.notes.get("last_lines")},
            **({"diloco": {"trained": bool(dl.points), "containers": dl.notes.get("containers"), "peak_mib": dl.notes.get("peak_mib"),
                           "last_lines": dl.notes.get("last_lines")}} if dl is not None else {}),
            "hetpeer": {**figures(het, args.memory_duration, args.memory_duration, 0.0), "notes": het.notes},
        }
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print_summary(result)
    if args.json:
        print(json.dumps(result, default=str))
    return 0


def ratio(result: dict, a: str, b: str) -> float | None:
    """a's tokens/s over b's; None when either never trained (no speed to compare)."""
    return result[a]["tokens_per_s"] / result[b]["tokens_per_s"] if result[a]["tokens"] and result[b]["tokens"] else None


def outer_choice(text: str) -> int | None:
    """auto (0), a number of steps, or none."""
    return None if text == "none" else outer_every_choice(text)


def fixed_compress(text: str) -> str | None:
    if text == "none":
        return None
    codec = compress_choice(text)
    if codec[0] != codec[1] or codec[0] == "auto":
        raise argparse.ArgumentTypeError(f"one codec for every hop, or none, not {text!r}")
    return codec[0]


def cell(value: float | None, spec: str) -> str:
    """A figure for the summary table; n/a where a system has no point to measure it (too few steps in the window)."""
    return "n/a" if value is None else format(value, spec)


def print_summary(result: dict) -> None:
    if "hetpeer" in result:
        print(f"\n(a) speed, each system {result['settings']['duration']:g} s from its first step; loss at equal time: the mean over "
              f"its last {LOSS_WINDOW:.0%} (at least {LOSS_WINDOW_S:g} s) of {result['equal_time_s']:.0f} s, at equal tokens: over the last {LOSS_WINDOW:.0%} of "
              f"{result['equal_tokens']:,.0f} tokens")
        print(f"{'system':<12} {'tokens/s':>9} {'2nd half':>9} {'loss start':>10} {'loss @time':>10} {'loss @tokens':>12} {'MB sent/peer':>12}")
        for name in result["systems"]:
            r = result[name]
            print(f"{name:<12} {r['tokens_per_s']:>9.0f} {cell(r['tokens_per_s_second_half'], '.0f'):>9} {cell(r['loss_first'], '.3f'):>10} "
                  f"{cell(r['loss_at_equal_time'], '.3f'):>10} {cell(r['loss_at_equal_tokens'], '.3f'):>12} "
                  f"{cell(r['sent_mb_per_peer'], '.1f'):>12}")
        for name in ("hivemind", "diloco"):
            if name in result:
                averaging = result[name]["notes"].get("averaging", {})
                print(f"{name}'s rounds: {averaging.get('averaged', 0)} averaged (mean group {np.mean(averaging.get('peers') or [0]):.1f} "
                      f"peers), {averaging.get('local', 0)} with local gradients only")
        silent = [name for name in result["systems"] if not result[name]["tokens"]]
        if silent:
            print(f"{' and '.join(silent)} never trained (the containers' last lines are in result.json)")
        if result["speedup"] is not None:
            print(f"hetpeer over hivemind: {result['speedup']:.2f}x tokens/s (goal >= {GOAL_SPEEDUP:g}x at equal or lower loss)")
        if result.get("speedup_over_diloco") is not None:
            print(f"hetpeer over diloco: {result['speedup_over_diloco']:.2f}x tokens/s; loss at equal time "
                  f"{cell(result['hetpeer']['loss_at_equal_time'], '.3f')} against {cell(result['diloco']['loss_at_equal_time'], '.3f')}")
        if result.get("speedup_over_fixed") is not None:
            fixed = result["systems"][1]
            print(f"hetpeer over {fixed}: {result['speedup_over_fixed']:.2f}x tokens/s (goal >= {GOAL_CODECS:g}x at equal or lower "
                  f"loss); hops {result['hetpeer']['notes'].get('plan', {}).get('hops')} against {result[fixed]['notes'].get('plan', {}).get('hops')}")
    if "memory" in result:
        m = result["memory"]
        print(f"\n(b) memory, the medium GPT, {m['memory_gb']:g} GB per container:")
        states = m["hivemind"]["containers"] or {}
        killed = [s for s, st in states.items() if st["oom_killed"]]
        print(f"  hivemind: trained={m['hivemind']['trained']}; {len(killed)} of {len(states)} peers killed by the kernel's "
              f"out-of-memory killer (exit codes {sorted({st['exit_code'] for st in states.values()})})")
        if "diloco" in m:
            states = m["diloco"]["containers"] or {}
            killed = [s for s, st in states.items() if st["oom_killed"]]
            print(f"  diloco: trained={m['diloco']['trained']}; {len(killed)} of {len(states)} peers killed by the out-of-memory killer")
        h = m["hetpeer"]
        print(f"  hetpeer: {h['tokens_per_s']:.0f} tokens/s, loss {cell(h['loss_first'], '.3f')} -> {cell(h['loss_at_equal_time'], '.3f')}, "
              f"plan {h['notes'].get('plan')}, out-of-memory kills {h['notes'].get('oom_killed')}")


if __name__ == "__main__":
    sys.exit(main())
