"""Dashboard benchmark: a coordinator that sees 1,000 peers; how long the page takes to draw, how long /metrics takes.

    python3 benchmarks/dashboard.py [--peers 1000] [--rounds 120] [--renders 5] [--scrapes 50] [--out DIR] [--json]

A real `Coordinator` (its rounds, history and dashboard server) reads synthetic peer records made here as
DHT entries (signed subkeys and wire dicts), through the same parsing path as the DHT's records
(`ControlPlane.read_peers` -> `PeerRecord.from_wire`); only the DHT itself is left out. The swarm runs a
plan of 8 stages with the rest of the peers on standby; each record carries its links to its lane and group
neighbours. `--rounds` rounds of training (steps, losses, a plan switch) fill the history first.

Measured, for --peers and for a 10-peer swarm in the same run (the ratio shows what size costs):
- first render: headless Chromium (selenium, the browser tests' flags) opens the page; the time from the
  navigation's start to the page's own mark after it drew everything from /api/state (plan picture,
  charts, tables). Cold (a fresh browser: plotly.js fetched) and warm (the median of --renders reloads).
  Goal: under 2 s.
- /metrics: the median over --scrapes new rounds of a GET of the Prometheus text (while a scraper comes by,
  the coordinator makes the text at the end of each round, off the request path), and of making the text
  (what that adds to a round). Goal: a scrape under 50 ms.
- a coordinator round (read and parse every record, decide, update the board): median wall time.
A screenshot of the large swarm's page goes to --out. `--json` prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

from prometheus_client import generate_latest

from hetpeer.coordinator.config import CoordinatorConfig
from hetpeer.coordinator.service import Coordinator
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.records import PROTOCOL_VERSION
from hetpeer.swarm import browser
from synthetic_swarm import SyntheticControlPlane, spread

RENDER_GOAL_S = 2.0
SCRAPE_GOAL_S = 0.050
STAGES = 8
LAYERS = 32


class SyntheticDht(SyntheticControlPlane):
    """Peers of a tiny-model swarm running a plan of 8 stages, the rest on standby."""

    def __init__(self, swarm: str, peers: int) -> None:
        super().__init__(swarm, peers)
        lanes, per = min(peers // STAGES, 100), LAYERS // STAGES  # peers >= 10: at least one lane
        self.plan = Plan(
            cost_model="time", model="tiny", layers=LAYERS, batch=4 * lanes, micro_batch=2, micro_batches=2, dtype="fp32",
            stages=tuple(StagePlan(s, s * per, (s + 1) * per, tuple(self.ids[s * lanes + l] for l in range(lanes)),
                                   "gossip" if lanes > 1 else "none") for s in range(STAGES)),
            standby=tuple(self.ids[STAGES * lanes:]), cost={"total_s": 0.8}, epoch=1,
        )
        self.step = 0

    def record(self, i: int) -> dict:
        """Peer i's announcement as it travels: a wire dict."""
        device = self.ids[i]
        try:
            stage, lane = self.plan.position(device)
        except KeyError:
            stage, lane = None, None
        lanes = self.plan.group_size
        neighbours = []
        if stage is not None:
            neighbours = [self.plan.stages[s].devices[lane] for s in (stage - 1, stage + 1) if 0 <= s < len(self.plan.stages)]
            neighbours += [self.plan.stages[stage].devices[(lane + d) % lanes] for d in (-1, 1) if lanes > 2]
        neighbours = sorted(set(neighbours) - {device})
        last = stage == len(self.plan.stages) - 1
        loss = 6.0 * 0.995 ** self.step + 0.01 * (i % 7) if last and self.step > 0 else None
        return {
            "version": PROTOCOL_VERSION, "software": "hetpeer 0.1.0", "device_id": device, "model": "tiny", "dtype": "fp32",
            "device_name": ("NVIDIA RTX 4090", "NVIDIA A100-SXM4-80GB", "cpu: AMD EPYC x8")[i % 3],
            "tflops": float(20 + (i * 37) % 160), "achieved_tflops": float(10 + (i * 11) % 60) if stage is not None else None,
            "memory_bytes": (8 + i % 72) << 30, "direct": f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}:7000",
            "p2p": [], "dht": [], "state": "training" if stage is not None else "standby", "epoch": self.plan.epoch,
            "layers": [self.plan.stages[stage].layer_start, self.plan.stages[stage].layer_end] if stage is not None else None,
            "step": self.step, "loss": loss, "val_loss": None, "noise_scale": None, "checkpoint": None,
            "tokens_per_s": 2048.0 + (i % 13) * 10 if last else 0.0,
            "links": {"peers": neighbours, "latency_s": [0.002 + 0.001 * (spread(n) % 40) for n in neighbours],
                      "bandwidth_bytes_per_s": [1e7 * (1 + spread(device + n) % 90) for n in neighbours]},
            "time": self.clock - 0.5, "token": None, "suspects": [], "compute_key": None, "compute_share": 1.0, "compute_background": 0.0, "compute_own": 0.0, "timings": 2, "step_costs": [0.0, 0.0, 0.0, 0.0],
            "reachable": "direct", "unreachable": [], "unreachable_how": [], "punch": 0, "calling": [], "punched": [], "relayed": [], "team": None,
            "received": {"peers": [], "epochs": [], "kinds": [], "first": [], "last": [], "micro": [], "sequences": []},
            "trained": {"epochs": [], "first": [], "last": [], "micro": [], "sequences": []},
        }


def build(peers: int, rounds: int, home: Path) -> tuple[Coordinator, SyntheticDht, list[float]]:
    """A started coordinator over `peers` synthetic peers after `rounds` rounds; the rounds' wall times."""
    dht = SyntheticDht("bench", peers)
    config = CoordinatorConfig(swarm="bench", home=home, api_listen=None, http_listen="127.0.0.1:0", heartbeat_s=2.0,
                               replan_interval_s=1e9, min_peers=1, time_budget_s=0.5)
    coordinator = Coordinator(config, lambda line: None)
    coordinator.control = dht
    coordinator.start()
    took = []
    for r in range(rounds):
        dht.clock += 2.0
        dht.step += 3
        if r == rounds // 2:  # a plan switch halfway: the charts mark it
            dht.plan, dht.plan_time = replace(dht.plan, epoch=2, start_step=dht.step), dht.clock
        started = time.perf_counter()
        coordinator.tick()
        took.append(time.perf_counter() - started)
    return coordinator, dht, took


def first_render(url: str) -> float:
    """Seconds from navigation to the page's own mark after its first full render, in a fresh browser."""
    chrome = browser.driver()
    try:
        return render(chrome, url)
    finally:
        browser.close(chrome)


def render(chrome, url: str) -> float:
    chrome.get(url)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        mark = chrome.execute_script("const m = performance.getEntriesByName('hetpeer-rendered'); return m.length ? m[0].startTime : null")
        if mark is not None:
            return mark / 1000
        time.sleep(0.05)
    raise RuntimeError(f"the page at {url} did not render within 60 s")


def scrape(coordinator: Coordinator, dht: SyntheticDht, times: int) -> tuple[float, float, int]:
    """Medians over `times` new rounds of: a /metrics GET (with a scraper about, each round makes the text at its
    end, off the request path), and making the text (what that costs the round); and the reply's size."""
    url = coordinator.dashboard.url
    get, make, size = [], [], 0
    urllib.request.urlopen(url + "metrics", timeout=10).close()  # a scraper came by
    for _ in range(times):
        dht.clock += 2.0
        coordinator.tick()
        started = time.perf_counter()
        with urllib.request.urlopen(url + "metrics", timeout=10) as reply:
            size = len(reply.read())
        get.append(time.perf_counter() - started)
        started = time.perf_counter()
        generate_latest(coordinator.dashboard.registry)
        make.append(time.perf_counter() - started)
    return statistics.median(get), statistics.median(make), size


def measure(peers: int, rounds: int, renders: int, scrapes: int, out: Path, picture: bool) -> dict:
    coordinator, dht, rounds_s = build(peers, rounds, out / f"coordinator-{peers}")
    try:
        url = coordinator.dashboard.url
        with urllib.request.urlopen(url + "api/state", timeout=30) as reply:
            state_bytes = len(reply.read())
        cold = first_render(url)
        chrome = browser.driver()
        try:
            warm = statistics.median(render(chrome, url) for _ in range(renders))
            if picture:
                chrome.set_window_size(1440, 2400)
                render(chrome, url)
                chrome.get_screenshot_as_file(str(out / f"dashboard-{peers}.png"))
        finally:
            browser.close(chrome)
        metrics_s, metrics_make_s, metrics_bytes = scrape(coordinator, dht, scrapes)
        return {"peers": peers, "planned": len(dht.plan.devices), "round_s": statistics.median(rounds_s),
                "state_bytes": state_bytes, "render_cold_s": cold, "render_warm_s": warm, "metrics_s": metrics_s,
                "metrics_make_s": metrics_make_s, "metrics_bytes": metrics_bytes, "samples": len(coordinator.history.samples)}
    finally:
        coordinator.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=1000, help="peer records the coordinator reads (default 1000)")
    parser.add_argument("--rounds", type=int, default=120, help="coordinator rounds before measuring (default 120)")
    parser.add_argument("--renders", type=int, default=5, help="warm renders to take the median of (default 5)")
    parser.add_argument("--scrapes", type=int, default=50, help="/metrics GETs to take the median of (default 50)")
    parser.add_argument("--out", type=Path, help="the screenshot and the coordinators' homes (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    if args.peers < 10 or args.rounds < 2 or args.renders < 1 or args.scrapes < 1:
        parser.error("--peers must be at least 10, --rounds 2, --renders and --scrapes 1")
    if browser.find_chromium() is None:
        parser.error("needs Chromium and chromedriver (Debian: apt-get install chromium chromium-driver) and selenium")
    out = (args.out or Path(tempfile.mkdtemp(prefix="hetpeer-dashboard-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    small = measure(10, args.rounds, args.renders, args.scrapes, out, picture=False)
    large = measure(args.peers, args.rounds, args.renders, args.scrapes, out, picture=True)
    for run in (small, large):
        print(f"{run['peers']:>5} peers ({run['planned']} planned): round {run['round_s'] * 1000:.0f} ms, /api/state "
              f"{run['state_bytes'] / 1e3:.0f} kB, first render {run['render_cold_s']:.2f} s cold / {run['render_warm_s']:.2f} s "
              f"warm, /metrics {run['metrics_s'] * 1000:.1f} ms ({run['metrics_bytes'] / 1e3:.0f} kB, made in "
              f"{run['metrics_make_s'] * 1000:.1f} ms at the end of the round)")
    ratio = {k: large[k] / small[k] for k in ("round_s", "render_cold_s", "render_warm_s", "metrics_s", "metrics_make_s")}
    print(f"{args.peers} against 10 peers: round {ratio['round_s']:.1f}x, first render {ratio['render_cold_s']:.2f}x cold, "
          f"{ratio['render_warm_s']:.2f}x warm, /metrics {ratio['metrics_s']:.1f}x (making it {ratio['metrics_make_s']:.1f}x)")
    render_ok, scrape_ok = large["render_cold_s"] < RENDER_GOAL_S, large["metrics_s"] < SCRAPE_GOAL_S
    print(f"goal: first render under {RENDER_GOAL_S:g} s: {'met' if render_ok else 'MISSED'} ({large['render_cold_s']:.2f} s); "
          f"/metrics under {SCRAPE_GOAL_S * 1000:g} ms: {'met' if scrape_ok else 'MISSED'} ({large['metrics_s'] * 1000:.1f} ms)")
    print(f"screenshot: {out / f'dashboard-{args.peers}.png'}")
    if args.json:
        print(json.dumps({"small": small, "large": large, "ratio": ratio, "render_goal_met": render_ok, "scrape_goal_met": scrape_ok}))
    return 0 if render_ok and scrape_ok else 1


if __name__ == "__main__":
    sys.exit(main())
