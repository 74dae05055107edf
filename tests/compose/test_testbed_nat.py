"""`hetpeer testbed` with devices behind home routers: one public peer, one behind a cone NAT and one behind a
symmetric NAT, each router a container that masquerades its device. The NATed peers join with no address
flag, learn that nobody can dial them, register at the public peer's relay; the swarm trains with all three."""

from __future__ import annotations

from compose_helpers import TestbedRun, wait_for
from hetpeer.coordinator.api_client import ApiClient

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
    # one group of all three: the two NATed peers average with each other, through the public peer's relay
    with TestbedRun(TOPOLOGY, tmp_path, image, "--slowdown", "4", "--heartbeat", "1", "--stages", "1", "--group-size", "3",
                    prefix="hetpeer-nat") as bed:
        with ApiClient(bed.api, timeout_s=5.0) as client:

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
        output = bed.stop()
    report = bed.report()
    assert report.steps >= 5 and report.samples[-1].loss < report.samples[0].loss, output[-2000:]
    for name in ("cone", "sym"):
        log = bed.log(name)
        assert "reachable: no, others cannot dial this peer" in log and "DHT: client mode" in log, log[-2000:]
    assert "relay: carried" in bed.log("pub")
    assert not bed.left(), "the testbed's containers were not removed"
