"""`hetpeer testbed` as users run it: four containers whose links are shaped like a topology file's. The
peers' own probes measure those links, a device's memory limits its container, the swarm trains until it
is stopped (`kill`, as Ctrl+C), and the command then leaves logs and a run report and removes its
containers."""

from __future__ import annotations

import time

from compose_helpers import TestbedRun, wait_for
from hetpeer.coordinator.api_client import ApiClient
from hetpeer.protocol.topology import Topology
from hetpeer.testbed.project import peer_name

TOPOLOGY = {
    "name": "two-sites",
    "devices": [
        {"id": "a-0", "region": "a", "tflops": 1.0}, {"id": "a-1", "region": "a", "tflops": 1.0},
        {"id": "b-0", "region": "b", "tflops": 1.0}, {"id": "b-1", "region": "b", "tflops": 0.5, "memory_gb": 2.0},
    ],
    "regions": {"a": {"latency_ms": 2, "bandwidth_gbps": 0.2}, "b": {"latency_ms": 3, "bandwidth_gbps": 0.1}},
    "region_links": [{"a": "a", "b": "b", "latency_ms": 30, "bandwidth_gbps": 0.04}],
}
TOLERANCE = 0.25
# what a peer announces for a link is the median of its last three probe rounds (one every 5 heartbeats of
# 2 s): rounds made while the containers still start up are noisy, so the check waits for later ones
SETTLED_S = 40.0


def test_a_shaped_testbed_is_measured_as_shaped_and_trains(image, tmp_path):
    topology = Topology.from_wire(TOPOLOGY)
    by_name = {peer_name(d.id): d for d in topology.devices}

    def device_of(device_id: str):
        return by_name[device_id.rsplit("-", 1)[0]]

    # compute slowed 4x: a peer mostly waits, as beside a GPU, and its probes are not timed on a starved CPU
    with TestbedRun(TOPOLOGY, tmp_path, image, "--scale", "1", "--slowdown", "4") as bed:
        with ApiClient(bed.api, timeout_s=5.0) as client:

            def measured():
                records = {p.record.device_id: p.record for p in client.call_list_peers()}
                if len(records) < 4 or any(len(r.links) < 3 for r in records.values()):
                    return None
                return records

            wait_for(measured, "every peer to measure its links to the three others", 240)
            time.sleep(SETTLED_S)
            off: list = []
            seen: set = set()  # links whose reading has agreed with their shaping

            def as_shaped():
                """The records once every link has read as shaped. A reading is the median of a peer's last three
                rounds, taken while the swarm trains: a link the plan does not use must read within the tolerance
                of its shaping (each counts once a reading agrees, rather than all at one instant); a link the plan
                keeps busy (a lane, a group or a stage check across it) is shared with the training traffic, and must read no
                faster and no nearer than its shaping allows."""
                records = measured()
                plan = client.call_get_plan()[0]
                if records is None or plan is None:
                    return None
                busy = set(plan.links) | set(plan.check_links)  # stage checks copy inputs across lanes
                off.clear()
                for sender, record in records.items():
                    for receiver, link in record.links.items():
                        shaped = topology.link(device_of(sender), device_of(receiver))
                        rate = shaped.bandwidth_gbps * 1e9 / 8
                        speed, delay = link.bandwidth_bytes_per_s / rate - 1, link.latency_s * 1e3 / shaped.latency_ms - 1
                        long = shaped.latency_ms >= 10  # only long links: a few ms of the container's own count
                        if tuple(sorted((sender, receiver))) in busy:
                            agrees = speed <= TOLERANCE and (not long or delay >= -TOLERANCE)
                        else:
                            agrees = abs(speed) <= TOLERANCE and (not long or abs(delay) <= TOLERANCE)
                        if agrees:
                            seen.add((sender, receiver))
                        elif (sender, receiver) not in seen:
                            off.append((sender, receiver, link, shaped))
                return records if not off else None

            records = wait_for(as_shaped, f"every link to read within {TOLERANCE:.0%} of its shaping", 240,
                               explain=lambda: "\n".join(map(str, off)))
        # b-1's container is limited to its 2 GB, and its peer announces what that limit leaves it
        limited = {d: r.memory_bytes for d, r in records.items() if device_of(d).memory_gb is not None}
        assert len(limited) == 1 and 0 < next(iter(limited.values())) <= 2e9, limited
        assert all(r.memory_bytes > 2e9 for d, r in records.items() if d not in limited), records
        output = bed.stop()  # `kill`, as Ctrl+C
    report = bed.report()
    assert report.steps >= 50 and report.samples[-1].loss < report.samples[0].loss, output[-2000:]
    assert {p.device_id.rsplit("-", 1)[0] for p in report.peers} == set(by_name)
    assert all(bed.log(name) for name in ("coordinator", "a-0", "b-1"))
    assert not bed.left(), "the testbed's containers were not removed"
