"""`hetpeer testbed` with devices behind home routers: one public peer, one behind a cone NAT and one behind a
symmetric NAT, each router a container that masquerades its device. The NATed peers join with no address
flag, learn that nobody can dial them, register at the public peer's relay; the swarm trains with all three."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from compose_helpers import ROOT, unique, wait_for
from hetpeer.coordinator.api_client import ApiClient
from hetpeer.peer.launch import free_port
from hetpeer.swarm.report import RunReport
from hetpeer.testbed.compose import Compose, run

TOPOLOGY = {
    "name": "home-routers",
    "devices": [
        {"id": "pub", "region": "net", "tflops": 1.0},
        {"id": "cone", "region": "net", "tflops": 1.0, "nat": "cone"},
        {"id": "sym", "region": "net", "tflops": 1.0, "nat": "symmetric"},
    ],
    "regions": {"net": {"latency_ms": 5, "bandwidth_gbps": 0.2}},
}


def test_peers_behind_cone_and_symmetric_routers_join_unaided_and_train(image, tmp_path):
    path = tmp_path / "home-routers.json"
    path.write_text(json.dumps(TOPOLOGY))
    port, project, out = free_port(), unique("hetpeer-nat"), tmp_path / "bed"
    # one group of all three: the two NATed peers average with each other, through the public peer's relay
    command = [sys.executable, "-m", "hetpeer", "testbed", str(path), "--slowdown", "4", "--heartbeat", "1", "--stages", "1", "--group-size", "3", "--out", str(out),
               "--project", project, "--api-port", str(port), "--http-port", str(free_port()), "--image", image]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with ApiClient(f"127.0.0.1:{port}", timeout_s=5.0) as client:

            def reachability():
                records = {p.record.device_id.rsplit("-", 1)[0]: p.record for p in client.call_list_peers()}
                if len(records) < 3 or any(r.reachable == "unknown" for r in records.values()):
                    return None
                return records

            records = wait_for(reachability, "every peer to announce whether others can dial it", 240)
            public = records["pub"].device_id
            assert records["pub"].reachable == "direct", records["pub"]
            for name in ("cone", "sym"):  # registered at the only public peer's relay, once registered
                wait_for(lambda: next((p.record for p in client.call_list_peers()
                                       if p.record.device_id.startswith(name + "-") and p.record.reachable == f"via:{public}"), None),
                         f"{name} to announce the relay it registered at", 120)

            def training():
                peers = [p.record for p in client.call_list_peers()]
                return peers if len(peers) == 3 and all(r.state == "training" and r.step >= 5 for r in peers) else None

            wait_for(training, "all three peers to train 5 steps", 300)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        if (out / "compose.yaml").exists():
            Compose(out / "compose.yaml", project).down()
    assert process.returncode == 0, output[-3000:]
    report = RunReport.from_json((out / "report.json").read_text())
    assert report.steps >= 5 and report.samples[-1].loss < report.samples[0].loss, output[-2000:]
    for name in ("cone", "sym"):
        log = (out / "logs" / f"{name}.log").read_text()
        assert "reachable: no, others cannot dial this peer" in log and "DHT: client mode" in log, log[-2000:]
    assert "relay: carried" in (out / "logs" / "pub.log").read_text()
    left = run(["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={project}"]).stdout.split()
    assert not left, "the testbed's containers were not removed"
