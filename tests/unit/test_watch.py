"""The one-line progress `hetpeer swarm` and `hetpeer testbed` print while they follow a swarm."""

from __future__ import annotations

import math

from hetpeer.coordinator.view import Progress
from hetpeer.swarm.watch import describe


def progress(**fields) -> Progress:
    base = dict(swarm="demo", coordinator_key="ab" * 32, epoch=2, step=41, loss=2.5, tokens_per_s=12345.6,
                peers_by_state={"training": 4, "standby": 2}, dropped=0)
    return Progress(**{**base, **fields})


def test_a_line_names_step_loss_throughput_plan_and_peers():
    assert describe(progress(), 200) == "step 41/200  loss 2.5000  12,346 tok/s  plan epoch 2  peers 2 standby, 4 training"
    assert describe(progress(), math.inf).startswith("step 41  loss")  # no target: until stopped


def test_before_a_plan_and_peers_it_says_so():
    line = describe(progress(epoch=-1, step=0, loss=None, tokens_per_s=0.0, peers_by_state={}), 600)
    assert line == "step 0/600  loss -  0 tok/s  no plan yet  peers none yet"
