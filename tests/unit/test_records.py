"""The control plane's records (pure): a peer's announcement and a plan record survive their wire form,
and every way a stranger's record can be wrong is refused with a SchemaError that names the field."""

from __future__ import annotations

import copy
import itertools
import json
import math

import pytest
from hypothesis import given, settings, strategies as st

from hetpeer.protocol.addresses import PeerAddress
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.identity import device_id, fingerprint
from hetpeer.protocol.records import (
    MAX_CLAIMS,
    MAX_LINKS,
    Claim,
    Receipt,
    MAX_PLAN_BYTES,
    PROTOCOL_VERSION,
    LinkMeasurement,
    PeerRecord,
    owner_key,
    peers_key,
    plan_from_wire,
    plan_key,
    plan_to_wire,
    PeerSchema,
    _PEER_EXACT,
)
from hetpeer.protocol.stepcosts import RECOMPUTE_SHARE, StepCosts
from hetpeer.protocol.wire import SchemaError

KEY = b"ssh-rsa AAAAkey-of-the-signer"  # fingerprint() hashes any bytes: no RSA needed here
OTHER_KEY = b"ssh-rsa AAAAsomeone-else"
NOW = 1_000_000.0
MAX_AGE_S = 60.0
P2P = "/ip4/127.0.0.1/tcp/4001/p2p/QmPeer"
DHT_MADDR = "/dns4/peer1/tcp/31338/p2p/12D3KooWDhtNode"


def record(**changes) -> PeerRecord:
    fields = dict(
        device_id=device_id("gpu0", KEY),
        model="tiny",
        dtype="fp16",
        device_name="NVIDIA H100",
        tflops=312.5,
        memory_bytes=80 << 30,
        address=PeerAddress(direct=("10.0.0.7", 7000), p2p=(P2P,)),
        state="training",
        time=NOW - 1.5,
        epoch=3,
        layers=(4, 8),
        step=120,
        loss=2.75,
        tokens_per_s=1234.5,
        links={
            device_id("gpu1", OTHER_KEY): LinkMeasurement(0.012, 1.25e8),
            "cpu2-000000000000": LinkMeasurement(0.0, 3.0e6),
        },
        dht=(DHT_MADDR,),
        achieved_tflops=250.0,
        software="hetpeer 0.1",
    )
    fields.update(changes)
    return PeerRecord(**fields)


def parse(raw, signer: bytes = KEY, now: float = NOW, max_age_s: float = MAX_AGE_S) -> PeerRecord:
    return PeerRecord.from_wire(raw, signer, now, max_age_s)


def wire(**changes) -> dict:
    raw = record().to_wire()
    raw.update(changes)
    return raw


def refused(raw, path: str, signer: bytes = KEY, now: float = NOW) -> SchemaError:
    with pytest.raises(SchemaError) as caught:
        parse(raw, signer, now)
    assert caught.value.path == path, str(caught.value)
    assert str(caught.value).startswith(path + ":")
    return caught.value


# -- keys and identity ------------------------------------------------------------------------------


def test_keys_start_with_the_swarm_name():
    assert peers_key("alpha") == "alpha_peers"
    assert plan_key("alpha") == "alpha_plan"


def test_a_device_id_is_its_name_and_the_fingerprint_of_its_key():
    assert fingerprint(KEY) != fingerprint(OTHER_KEY)
    assert len(fingerprint(KEY)) == 12 and int(fingerprint(KEY), 16) >= 0
    assert device_id("gpu0", KEY) == f"gpu0-{fingerprint(KEY)}"
    assert device_id("0_a" + "b" * 21, KEY).startswith("0_a")  # 24 characters


@pytest.mark.parametrize("name", ["", "GPU0", "-gpu", "_gpu", "gpu-0", "gpu 0", "a" * 25, "gpu0\n", "gpü"])
def test_a_device_name_outside_the_alphabet_is_a_value_error(name):
    with pytest.raises(ValueError, match="peer name must be"):
        device_id(name, KEY)


def test_owner_key_reads_the_key_of_a_marker_and_refuses_anything_else():
    assert owner_key(b"[owner:" + KEY + b"]") == KEY
    for subkey in (None, "[owner:" + KEY.decode() + "]", KEY, b"[owner:]", b"[owner:" + KEY + b"]x",
                   b"x[owner:" + KEY + b"]", b"[owner:" + KEY + b"]\n", 7):
        with pytest.raises(SchemaError, match="not an \\[owner:...\\] marker") as caught:
            owner_key(subkey)
        assert caught.value.path == "subkey"


# -- peer records -----------------------------------------------------------------------------------


def test_a_record_survives_its_wire_form_and_json():
    sent = record()
    raw = sent.to_wire()
    assert parse(raw) == sent
    assert parse(json.loads(json.dumps(raw))) == sent
    assert raw["links"]["peers"] == sorted(sent.links)


def test_a_minimal_record_survives_its_wire_form():
    sent = record(address=PeerAddress(p2p=(P2P,)), layers=None, loss=None, links={}, epoch=-1, step=0,
                  state="probing", tokens_per_s=0.0)
    raw = sent.to_wire()
    assert raw["direct"] is None and raw["layers"] is None and raw["loss"] is None
    assert parse(raw) == sent
    assert record(time=NOW + MAX_AGE_S).to_wire()["time"] == NOW + MAX_AGE_S
    assert parse(wire(time=NOW - MAX_AGE_S)).time == NOW - MAX_AGE_S  # the edges of the window are fresh


def test_a_record_whose_device_id_is_not_bound_to_its_signer_is_refused():
    error = refused(wire(), "peer.device_id", signer=OTHER_KEY)
    assert fingerprint(OTHER_KEY) in str(error) and "not bound" in str(error)
    # the right fingerprint with a name outside the alphabet, or no name at all
    for claimed in (f"GPU-{fingerprint(KEY)}", f"-{fingerprint(KEY)}", fingerprint(KEY), f"gpu0\n-{fingerprint(KEY)}"):
        refused(wire(device_id=claimed), "peer.device_id")


def test_a_record_with_an_unknown_state_is_refused():
    assert "training" in str(refused(wire(state="mining"), "peer.state"))


@pytest.mark.parametrize("field, value", [
    ("device_name", "x" * 129), ("device_name", "GPU\x1b]0;owned\x07"), ("software", "hetpeer\n1.0"), ("software", "\x1b[2J"),
])
def test_text_organizers_are_shown_is_short_and_printable(field, value):
    assert "at most 128 printable characters" in str(refused(wire(**{field: value}), f"peer.{field}"))


@pytest.mark.parametrize(
    "field, value",
    [
        ("tflops", math.nan), ("tflops", math.inf), ("tflops", -1.0), ("tflops", 0.0),
        ("tokens_per_s", math.nan), ("tokens_per_s", -0.5), ("tokens_per_s", math.inf),
        ("loss", math.nan), ("loss", -math.inf),
        ("time", math.nan), ("time", math.inf), ("time", -1.0),
        ("memory_bytes", -1), ("step", -3), ("epoch", -2),
    ],
)
def test_a_non_finite_or_negative_number_is_refused_naming_its_field(field, value):
    error = refused(wire(**{field: value}), f"peer.{field}")
    assert repr(value) in str(error) or str(value) in str(error)


@pytest.mark.parametrize(
    "field, value",
    [("latency_s", -0.001), ("latency_s", math.nan), ("latency_s", math.inf),
     ("bandwidth_bytes_per_s", 0.0), ("bandwidth_bytes_per_s", -5.0), ("bandwidth_bytes_per_s", math.inf),
     ("bandwidth_bytes_per_s", math.nan)],
)
def test_a_bad_link_measurement_is_refused_naming_the_link(field, value):
    raw = wire()
    raw["links"][field][1] = value
    refused(raw, f"peer.links.{field}[1]")


def test_link_lists_of_different_lengths_or_a_peer_twice_are_refused():
    raw = wire()
    raw["links"]["latency_s"].append(0.5)
    refused(raw, "peer.links")
    raw = wire()
    raw["links"]["peers"][1] = raw["links"]["peers"][0]
    refused(raw, "peer.links.peers")


def test_a_stale_record_and_one_from_the_future_are_refused():
    stale = refused(wire(time=NOW - MAX_AGE_S - 5), "peer.time")
    assert "stale" in str(stale) and "65.0 s ago" in str(stale)
    future = refused(wire(time=NOW + MAX_AGE_S + 5), "peer.time")
    assert "future" in str(future) and "65.0 s" in str(future)


def test_a_record_with_too_many_links_is_refused():
    def links(n: int) -> dict:
        return {"peers": [f"p{i}-000000000000" for i in range(n)], "latency_s": [0.01] * n, "bandwidth_bytes_per_s": [1e6] * n}

    assert len(parse(wire(links=links(MAX_LINKS))).links) == MAX_LINKS
    error = refused(wire(links=links(MAX_LINKS + 1)), "peer.links")
    assert str(MAX_LINKS) in str(error)


@pytest.mark.parametrize("layers", [[3, 3], [5, 2], [-1, 2], [1], [], [1, 2, 3]])
def test_bad_layers_are_refused(layers):
    refused(wire(layers=layers), "peer.layers")


@pytest.mark.parametrize("checkpoint", [[3, 3, 0, 0], [0, 2], [0, 2, 5], [0, 2, -1, 0], [-1, 2, 5, 0], [0, 2, 5, -1],
                                        [0, 2, 5, 1, 1]])
def test_bad_checkpoints_are_refused(checkpoint):
    refused(wire(checkpoint=checkpoint), "peer.checkpoint")


def test_a_checkpoint_and_a_validation_loss_survive_the_wire():
    sent = record(checkpoint=(0, 4, 250, 4000), val_loss=2.5)
    assert sent.to_wire()["checkpoint"] == [0, 4, 250, 4000]
    assert parse(sent.to_wire()) == sent


def test_another_protocol_version_is_refused():
    error = refused(wire(version=PROTOCOL_VERSION + 1), "peer.version")
    assert f"protocol {PROTOCOL_VERSION + 1}" in str(error)


@pytest.mark.parametrize(
    "field, value, path",
    [
        ("tflops", 312, "peer.tflops"),  # an int where a float belongs
        ("time", int(NOW), "peer.time"),
        ("memory_bytes", float(80 << 30), "peer.memory_bytes"),
        ("step", True, "peer.step"),  # a bool is not an int
        ("epoch", "3", "peer.epoch"),
        ("device_name", b"NVIDIA H100", "peer.device_name"),
        ("p2p", P2P, "peer.p2p"),
        ("layers", [4.0, 8.0], "peer.layers.0"),
        ("loss", "2.75", "peer.loss"),
        ("links", [{"x": 1}], "peer.links"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_not_converted(field, value, path):
    refused(wire(**{field: value}), path)


def test_a_record_that_parses_only_after_conversion_is_refused():
    raw = wire(p2p=(P2P,))  # a tuple would parse as a list
    assert "type conversions" in str(refused(raw, "peer"))
    raw = wire()
    raw["links"]["peers"] = tuple(raw["links"]["peers"])
    refused(raw, "peer")


def test_extra_and_missing_fields_are_refused():
    assert "extra fields" in str(refused(wire(admin=True), "peer.admin"))
    raw = wire()
    raw["links"]["jitter_s"] = [0.1, 0.1]
    refused(raw, "peer.links.jitter_s")
    raw = wire()
    del raw["model"]
    assert "required" in str(refused(raw, "peer.model"))
    raw = wire()
    del raw["layers"]  # optional in type, but not to be left out: the DHT's schema check would refuse it
    refused(raw, "peer")


@pytest.mark.parametrize("raw", [None, [], "record", 7, b"\x00"])
def test_a_record_that_is_not_an_object_is_refused(raw):
    with pytest.raises(SchemaError, match="^peer"):
        parse(raw)


def test_a_bad_address_is_refused():
    refused(wire(direct="no-port"), "peer.address.direct")
    refused(wire(p2p=["/ip4/1.2.3.4/tcp/1"]), "peer.address.p2p[0]")
    refused(wire(direct=None, p2p=[]), "peer.address")


def test_the_noise_scale_is_optional_but_finite_and_positive():
    assert parse(wire(noise_scale=2048.0)).noise_scale == 2048.0
    assert parse(record(noise_scale=512.0).to_wire()).noise_scale == 512.0
    assert parse(wire(noise_scale=None)).noise_scale is None
    for bad in (0.0, -5.0, math.inf, math.nan):
        refused(wire(noise_scale=bad), "peer.noise_scale")


def test_achieved_tflops_is_optional_but_finite_and_positive():
    assert parse(wire(achieved_tflops=0.75)).achieved_tflops == 0.75
    assert parse(wire(achieved_tflops=None)).achieved_tflops is None
    for bad in (0.0, -1.0, math.inf, math.nan):
        refused(wire(achieved_tflops=bad), "peer.achieved_tflops")
    refused(wire(achieved_tflops=1), "peer.achieved_tflops")  # an int where a float belongs


def test_the_dht_addresses_must_name_one_libp2p_peer():
    assert parse(wire(dht=[DHT_MADDR, "/ip4/10.0.0.7/tcp/31338/p2p/12D3KooWDhtNode"])).dht[0] == DHT_MADDR
    assert parse(wire(dht=[])).dht == ()
    refused(wire(dht=["/ip4/10.0.0.7/tcp/31338"]), "peer.dht[0]")  # no peer id: nobody could bootstrap through it
    refused(wire(dht=[DHT_MADDR, "/ip4/10.0.0.7/tcp/1/p2p/12D3KooWSomeoneElse"]), "peer.dht")
    refused(wire(dht=[DHT_MADDR] * 9), "peer.dht")
    refused(wire(dht=["/dns4/" + "x" * 300 + "/tcp/1/p2p/12D3KooWDhtNode"]), "peer.dht")
    refused(wire(dht=DHT_MADDR), "peer.dht")  # a string is not a list


ODD_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False), st.text(max_size=3),
    st.lists(st.one_of(st.integers(0, 3), st.floats(0, 3), st.text(max_size=2), st.booleans()), max_size=3),
    st.tuples(st.integers(0, 3)), st.dictionaries(st.text(max_size=2), st.integers(0, 3), max_size=2),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(sorted(wire()) + ["links.peers", "links.latency_s", "links.extra", "admin"]),
                          st.one_of(st.just("delete"), ODD_VALUES)), max_size=3))
def test_the_fast_exact_check_agrees_with_pydantic(changes):
    """The fast path passes exactly the records that pydantic parses without changing them."""
    raw = wire()
    for path, value in changes:
        where, _, name = path.rpartition(".")
        target = raw.get(where) if where else raw  # None once that object was deleted or replaced
        if not isinstance(target, dict):
            continue
        if value == "delete":
            target.pop(name, None)
        else:
            target[name] = value
    try:
        exact = PeerSchema.parse_obj(raw).dict() == raw
    except Exception:  # noqa: BLE001 - pydantic refuses in several ways (and TypeError on odd keys)
        exact = False
    assert _PEER_EXACT(raw) == exact


def test_parsing_does_not_change_the_raw_record():
    raw = wire()
    kept = copy.deepcopy(raw)
    parse(raw)
    with pytest.raises(SchemaError):
        parse(raw, signer=OTHER_KEY)
    assert raw == kept


# -- plan records -----------------------------------------------------------------------------------


def small_plan(epoch: int = 2) -> Plan:
    stages = (StagePlan(0, 0, 2, ("a-1", "b-2"), "gossip"), StagePlan(1, 2, 4, ("c-3", "d-4"), "allreduce"))
    return Plan("time", "tiny", 4, 8, 2, 2, "fp32", stages, standby=("e-5",), cost={"total_s": 1.5}, epoch=epoch)


def test_a_plan_record_survives_its_wire_form():
    plan = small_plan()
    raw = plan_to_wire(plan, NOW)
    assert set(raw) == {"plan", "time"} and isinstance(raw["plan"], str)
    assert plan_from_wire(raw) == (plan, NOW)
    assert plan_from_wire(json.loads(json.dumps(raw))) == (plan, NOW)


def test_a_plan_record_of_the_wrong_shape_is_refused():
    raw = plan_to_wire(small_plan(), NOW)
    cases = [
        (dict(raw, time=int(NOW)), "plan_record.time"),
        (dict(raw, plan=json.loads(raw["plan"])), "plan_record.plan"),  # an object, not JSON text
        (dict(raw, signer="me"), "plan_record.signer"),
        ({"plan": raw["plan"]}, "plan_record.time"),
        (None, "plan_record"),
        ({0: None}, "plan_record"),  # pydantic alone would raise TypeError on a key that is not a string
        ([["plan", raw["plan"]], ["time", NOW]], "plan_record"),  # and take a list of pairs for an object
    ]
    for bad, path in cases:
        with pytest.raises(SchemaError) as caught:
            plan_from_wire(bad)
        assert caught.value.path == path, str(caught.value)


@pytest.mark.parametrize(
    "text",
    ["{not json", "", "[" * 100_000, "1" * 5_000,
     json.dumps(small_plan().to_wire()).replace('"total_s": 1.5', '"total_s": ' + "9" * 400)],
    ids=["broken", "empty", "deep", "long-int", "huge-int"],
)
def test_plan_text_that_is_not_json_is_refused(text):
    with pytest.raises(SchemaError) as caught:
        plan_from_wire({"plan": text, "time": NOW})
    assert caught.value.path.startswith("plan"), str(caught.value)


def test_a_plan_too_big_is_refused_before_it_is_parsed():
    text = json.dumps(small_plan().to_wire())
    padded = text[:-1] + ', "pad": "' + "x" * MAX_PLAN_BYTES + '"}'
    with pytest.raises(SchemaError, match=f"at most {MAX_PLAN_BYTES}") as caught:
        plan_from_wire({"plan": padded, "time": NOW})
    assert caught.value.path == "plan_record.plan"


def test_a_plan_that_breaks_its_own_rules_is_refused():
    wire_plan = small_plan().to_wire()
    wire_plan["stages"][1]["devices"] = ["a-1", "d-4"]  # a device twice
    with pytest.raises(SchemaError, match="appears more than once") as caught:
        plan_from_wire({"plan": json.dumps(wire_plan), "time": NOW})
    assert caught.value.path == "plan.stages[1].devices"
    wire_plan = small_plan().to_wire()
    wire_plan["version"] = 99
    with pytest.raises(SchemaError, match="plan.version"):
        plan_from_wire({"plan": json.dumps(wire_plan), "time": NOW})


def test_the_device_a_peer_computes_on_is_checked():
    record = parse(wire(compute_key="0123456789abcdef", compute_share=0.25, compute_background=0.4, compute_own=0.1))
    assert (record.compute_key, record.compute_share, record.compute_background, record.compute_own) == \
        ("0123456789abcdef", 0.25, 0.4, 0.1)
    assert parse(wire()).compute_key is None
    for bad in ("0123456789ABCDEF", "0123", "x" * 16, "0123456789abcdef0"):
        refused(wire(compute_key=bad), "peer.compute_key")
    for bad in (0.0, -0.5, 1.5, math.inf):
        refused(wire(compute_share=bad), "peer.compute_share")
    for bad in (-0.1, 1.0, math.nan):
        refused(wire(compute_background=bad), "peer.compute_background")
        refused(wire(compute_own=bad), "peer.compute_own")
    refused(wire(compute_background=0.7, compute_own=0.5), "peer.compute_own")  # more than the whole device
    refused(wire(compute_share=1), "peer.compute_share")  # an int where a float belongs


def test_how_often_a_peer_timed_its_device_is_a_count_the_wire_can_carry():
    assert parse(wire(timings=3)).timings == 3 and parse(wire()).timings == 0
    for bad in (-1, 2**31, 2**64):
        refused(wire(timings=bad), "peer.timings")
    refused(wire(timings=2.0), "peer.timings")  # a float where a count belongs


def test_what_a_stage_step_costs_a_peer_beyond_its_blocks_is_checked():
    costs = [2e-4, 5e-4, 6e-10, 3e-4, 0.85, 1e-10, 1e-10, 4e-10, 9e-10, 7e-10]  # then fp16, bf16, int8, int4, int6 a value
    record = parse(wire(step_costs=costs))
    assert record.step_costs == StepCosts(*costs) and record.step_costs.to_wire() == costs
    assert record.step_costs.recompute == 0.85 and record.step_costs.int4_s_per_value == 9e-10
    assert parse(wire()).step_costs == StepCosts()  # a peer that measured nothing of it
    assert parse(wire()).step_costs.recompute == RECOMPUTE_SHARE
    older = parse(wire(step_costs=costs[:4]))  # a peer that does not time recomputation
    assert older.step_costs == StepCosts(*costs[:4]) and older.step_costs.recompute == RECOMPUTE_SHARE
    no_codecs = parse(wire(step_costs=costs[:5]))  # nor codecs
    assert no_codecs.step_costs == StepCosts(*costs[:5]) and no_codecs.step_costs.int8_s_per_value == 0.0
    for bad in ([1e-4, 1e-4, 1e-10], [1e-4] * 6, [1e-4] * 11, []):
        refused(wire(step_costs=bad), "peer.step_costs")
    for i, bad in itertools.product(range(len(costs)), (-1e-4, math.nan, math.inf, 1e3)):
        refused(wire(step_costs=costs[:i] + [bad] + costs[i + 1:]), "peer.step_costs")
    refused(wire(step_costs=costs[:9] + [2e-6]), "peer.step_costs")  # 2 us a value: no device encodes that slowly
    refused(wire(step_costs=[0, 0.0, 0.0, 0.0, 0.0]), "peer.step_costs.0")  # an int where a float belongs


def test_whether_others_can_dial_a_peer_is_checked():
    assert parse(wire()).reachable == "unknown" and not parse(wire()).behind_nat
    assert parse(wire(reachable="direct")).relay is None
    assert not parse(wire(reachable="direct")).behind_nat and parse(wire(reachable="none")).behind_nat
    relayed = parse(wire(reachable="via:relay-0123456789ab"))
    assert relayed.relay == "relay-0123456789ab" and relayed.behind_nat
    own = parse(wire()).device_id
    for bad in ("maybe", "via:", "via:not a device", f"via:{own}", "VIA:relay-0123456789ab", "direct "):
        refused(wire(reachable=bad), "peer.reachable")


def test_the_peers_a_peer_could_not_reach_are_checked_each_with_how():
    parsed = parse(wire(unreachable=["other-0123456789ab", "third-0123456789ab"], unreachable_how=["punch", "refused"]))
    assert parsed.unreachable == ("other-0123456789ab", "third-0123456789ab")
    assert parsed.failed() == {"other-0123456789ab": "punch", "third-0123456789ab": "refused"}
    own = parse(wire()).device_id
    for bad in ([own], ["x"], ["other-0123456789ab"] * 2, [f"p{i}-0123456789ab" for i in range(17)]):
        refused(wire(unreachable=bad, unreachable_how=["timeout"] * len(bad)),
                "peer.unreachable" if len(set(bad)) != len(bad) or len(bad) > 16 else "peer.unreachable[0]")
    for how in ([], ["timeout", "refused"], ["unplugged"]):  # one for each peer, each a known way of failing
        refused(wire(unreachable=["other-0123456789ab"], unreachable_how=how), "peer.unreachable_how")


def test_the_port_a_peer_punches_from_and_the_peers_it_calls_are_checked():
    calls = ["other-0123456789ab", "third-0123456789ab"]
    parsed = parse(wire(reachable="none", punch=40123, calling=calls, punched=calls[:1], relayed=calls[1:]))
    assert (parsed.punch, parsed.calling, parsed.punched, parsed.relayed) == (40123, tuple(calls), tuple(calls[:1]), tuple(calls[1:]))
    assert parse(wire()).punch == 0 and parse(wire()).calling == ()
    for bad in (-1, 65536):
        refused(wire(punch=bad), "peer.punch")
    refused(wire(punch=40123, direct=None), "peer.punch")  # a port with no address to punch to
    own = parse(wire()).device_id
    for bad in ([own], ["x"], calls[:1] * 2, [f"p{i}-0123456789ab" for i in range(17)]):
        refused(wire(calling=bad), "peer.calling" if len(set(bad)) != len(bad) or len(bad) > 16 else "peer.calling[0]")
    refused(wire(punched=[own]), "peer.punched[0]")
    refused(wire(relayed=calls[:1] * 2), "peer.relayed")


def test_two_peers_punch_to_each_other_only_when_both_are_behind_nat_punch_and_have_two_addresses():
    def peer(host: str, punch: int = 40123, reachable: str = "none") -> PeerRecord:
        return record(address=PeerAddress(direct=(host, 7000)), punch=punch, reachable=reachable)

    a, b = peer("198.51.100.1"), peer("203.0.113.9")
    assert a.punches_with(b) and b.punches_with(a)
    assert peer("198.51.100.1", reachable="via:relay-0123456789ab").punches_with(b)  # registered at a relay: still
    assert not a.punches_with(peer("203.0.113.9", punch=0))  # its NAT changes ports
    assert not a.punches_with(peer("203.0.113.9", reachable="direct"))  # dialled, not punched
    assert not a.punches_with(peer("198.51.100.1"))  # behind one address: their router would have to hairpin


# -- credit: receipts, claims, team -----------------------------------------------------------------

NEIGHBOUR = "cpu2-000000000000"


def credited(**changes) -> PeerRecord:
    fields = dict(team="red-team.1", received=(Receipt(NEIGHBOUR, 3, "activations", 100, 120, 42, 84),
                                               Receipt(NEIGHBOUR, 2, "params", 0, 99, 100, 400)),
                  trained=(Claim(2, 0, 99, 100, 400), Claim(3, 100, 120, 42, 84)))
    return record(**{**fields, **changes})


def test_receipts_claims_and_team_travel_with_the_record():
    raw = credited().to_wire()
    assert parse(json.loads(json.dumps(raw))) == credited()


@pytest.mark.parametrize("column, index, value, words", [
    ("peers", 0, "gpu0-" + "0" * 12, "another peer's device id"),  # the record's own id is set below
    ("peers", 0, "not a device", "another peer's device id"),
    ("kinds", 0, "loss", "kind must be one of"),
    ("epochs", 0, -1, "epoch non-negative"),
    ("first", 0, 121, "first <= last"),
    ("micro", 0, 0, "1 <= micro-batches"),
    ("micro", 0, 85, "1 <= micro-batches <= sequences"),
])
def test_a_bad_receipt_is_refused_naming_it(column, index, value, words):
    raw = credited().to_wire()
    if column == "peers" and value.startswith("gpu0-"):
        value = raw["device_id"]
    raw["received"][column][index] = value
    assert words in str(refused(raw, "peer.received[0]"))


def test_receipts_and_claims_of_unlike_lengths_twice_over_or_too_many_are_refused():
    raw = credited().to_wire()
    raw["received"]["last"].append(5)
    refused(raw, "peer.received")
    raw = credited().to_wire()
    raw["received"]["epochs"][1], raw["received"]["kinds"][1] = 3, "activations"
    assert "twice" in str(refused(raw, "peer.received"))
    raw = credited().to_wire()
    raw["trained"]["epochs"][1] = 2
    assert "twice" in str(refused(raw, "peer.trained"))
    many = credited(trained=tuple(Claim(e, 0, 1, 2, 4) for e in range(MAX_CLAIMS + 1))).to_wire()
    assert "at most" in str(refused(many, "peer.trained"))
    raw = credited().to_wire()
    raw["trained"]["sequences"][0] = 99  # fewer sequences than micro-batches
    refused(raw, "peer.trained[0]")


@pytest.mark.parametrize("team", ["", "-red", "r" * 33, "red team", "réd"])
def test_a_bad_team_is_refused(team):
    refused(wire(team=team), "peer.team")
